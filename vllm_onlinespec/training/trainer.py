"""Offline training of a DFlash drafter on the target's own responses.

    samples (prompt + response ids)
      -> target features once per sequence (frozen HF target, kept in memory, cached on disk)
      -> per step: a length-bucketed batch, anchors inside the responses, block_loss, AdamW
      -> per epoch: greedy acceptance on held-out prompts; the drafter exported in vLLM's format

Features are computed once and reused by every epoch and by evaluation: a target forward costs
about as much per token as a drafter step, so recomputing them each epoch would double the
training time on a CPU.

Resuming: batch order is a function of (seed, epoch) and anchors of (seed, step), so a run
restored from `train_state/state.pt` (drafter, length head, optimizer, schedule, step) takes
exactly the steps the uninterrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..config import LossConfig
from ..drafter import DFlashConfig, DFlashDrafter, LengthHead, load_drafter, save_drafter
from .blocks import LossVocab, block_loss, response_mask, sample_anchors, walk_steps
from .features import target_features
from .generate import Sample

STATE_DIR = "train_state"
LOG_FILE = "train_log.jsonl"
META_FILE = "train_meta.json"


@dataclass
class TrainConfig:
    # drafter shape
    num_layers: int = 1
    block_size: int = 8  # K = block_size - 1 = vLLM's num_speculative_tokens
    target_layer_ids: list[int] | None = None  # None: spread num_target_features over the depth
    num_target_features: int = 3
    mask_token_id: int = 0
    # optimisation
    epochs: int = 2
    max_steps: int | None = None  # overrides epochs when set
    batch_size: int = 4  # sequences per step
    anchors_per_seq: int = 8  # blocks per sequence per step (fewer if the response is short)
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # or "linear"
    # Where training blocks are anchored: "all" response positions, or "tree-miss": only where
    # the suffix tree's draft scores below tree_min_score, the positions the hybrid proposer
    # asks the drafter for (training/tree_anchors.py).
    anchors: str = "all"
    tree_min_score: float = 1.0
    # Start from a trained drafter folder's weights (its shape, draft vocabulary and length
    # head) instead of random ones: continued training. Its fc already holds the feature
    # scale it was trained with, so features are not normalised again.
    init_from: str | None = None
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)  # loss.vocab: see blocks.LossVocab
    length_head: bool = True
    seed: int = 0
    # Divide every target feature dimension by its RMS over the training data before `fc`,
    # folded into fc's columns at export (vLLM loads the checkpoint unchanged). The target's
    # massive activations (one dimension of a late layer hundreds of times the median) would
    # otherwise dominate fc's input and its gradient.
    normalize_features: bool = False
    # Serve (and train) a reduced draft vocabulary of this many tokens, the most frequent
    # labels of the training data (vLLM's draft_vocab_size + d2t, drafter/vocab.py); it is
    # also the loss's vocabulary. None = the target's whole LM head at serving.
    draft_vocab_size: int | None = None
    # "float32", or "bfloat16": autocast the drafter's matmuls (CPUs with native bf16 dot
    # products, GPUs); master weights, optimizer and loss statistics stay float32.
    compute_dtype: str = "float32"
    # evaluation / bookkeeping
    eval_anchors: int = 16
    # Extra held-out evaluations every N steps, each with a drafter snapshot in
    # out/snapshots/step-N (the learning curve serves them); 0 = per epoch only.
    eval_every: int = 0
    log_every: int = 10
    save_every_s: float = 120.0
    target_dtype: str = "float32"  # HF target for features; CPU bf16 matmuls are slow here
    feature_dtype: str = "bfloat16"  # storage of cached features (vLLM serves bf16 features)
    feature_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        checks = {"num_layers": self.num_layers >= 1, "block_size": self.block_size >= 2,
                  "epochs": self.epochs >= 1, "batch_size": self.batch_size >= 1,
                  "anchors_per_seq": self.anchors_per_seq >= 1, "lr": self.lr > 0,
                  "min_lr_frac": 0 <= self.min_lr_frac <= 1, "warmup_steps": self.warmup_steps >= 0,
                  "schedule": self.schedule in ("cosine", "linear"),
                  "anchors": self.anchors in ("all", "tree-miss"),
                  "tree_min_score": self.tree_min_score >= 0,
                  "grad_clip": self.grad_clip > 0, "eval_anchors": self.eval_anchors >= 1,
                  "max_steps": self.max_steps is None or self.max_steps >= 1,
                  "compute_dtype": self.compute_dtype in ("float32", "bfloat16"),
                  "draft_vocab_size": self.draft_vocab_size is None or self.draft_vocab_size >= 1}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid training setting {bad[0]}={getattr(self, bad[0])!r}")
        if self.init_from is not None and self.normalize_features:
            raise ValueError("init_from: the checkpoint's fc already holds its feature scale; "
                             "leave normalize_features off")
        if self.draft_vocab_size is not None and self.loss.mode != "ce":
            raise ValueError("draft_vocab_size needs loss mode 'ce' (cached target labels "
                             "score the reduced vocabulary as vLLM serves it)")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["loss"] = self.loss.model_dump()
        return d


# -- features ---------------------------------------------------------------------------------------

@dataclass
class Example:
    """One sequence with its target features, ready for block_loss."""

    ids: Tensor  # [T] int64
    start: int  # first response position
    aux: Tensor  # [T, n*H] feature_dtype
    final: Tensor  # [T, H] feature_dtype
    tgt: Tensor | None = None  # [T] int64, the target's argmax after each position (cached labels)
    # [T] bool: positions a training block may be anchored at (None: every response position);
    # set by training/tree_anchors.py for `anchors = "tree-miss"`.
    anchor_ok: Tensor | None = None


def load_target(path: str, dtype: str = "float32") -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval().requires_grad_(False)
    return model


@dataclass
class HeldoutInputs:
    """What the offline benchmarks evaluate a drafter on: a training run's held-out answers
    with their features, and the target's embedding and LM head (float32)."""

    layer_ids: tuple[int, ...]  # the target layers the shards' aux features come from
    examples: list[Example]
    embed_w: Tensor
    lm_head_w: Tensor

    def drafter(self, path: str | Path) -> tuple[DFlashConfig, DFlashDrafter]:
        """The drafter at `path` in float32 eval mode; refuses one that reads other target
        layers than these shards hold (its features would be the wrong ones)."""
        cfg, drafter, _ = load_drafter(path)
        if tuple(cfg.target_layer_ids) != self.layer_ids:
            raise ValueError(f"{path}: target layers {list(cfg.target_layer_ids)} != the "
                             f"shards' {list(self.layer_ids)}")
        return cfg, drafter.float().eval()


def heldout_inputs(data_dir: str | Path, target_path: str) -> HeldoutInputs:
    """DATA_DIR/heldout's feature shards as Examples, with the target's shared matrices."""
    from .shards import iter_shards, read_manifest

    folder = Path(data_dir) / "heldout"
    header = read_manifest(folder).header
    held = [Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final)
            for r in iter_shards(folder, header)]
    target = load_target(target_path)
    return HeldoutInputs(tuple(header.layer_ids), held,
                         target.get_input_embeddings().weight.detach().float(),
                         target.get_output_embeddings().weight.detach().float())


def _samples_key(samples: Sequence[Sample], extra: dict) -> str:
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    for s in samples:
        h.update(json.dumps([s.ids, s.start]).encode())
    return h.hexdigest()[:16]


def extract_features(target: nn.Module, samples: Sequence[Sample], layer_ids: list[int], *,
                     dtype: torch.dtype = torch.bfloat16, batch_tokens: int = 8192,
                     desc: str = "features") -> list[Example]:
    """Target features for every sample, batched by similar length to waste little on padding."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    out: list[Example | None] = [None] * len(samples)
    bar = tqdm(total=sum(len(s.ids) for s in samples), desc=desc, unit="tok", leave=False)
    i = 0
    while i < len(order):
        t_max = len(samples[order[i]].ids)
        j = i + 1  # longest-last order: the batch's last sequence sets the padded length
        while j < len(order) and (j - i + 1) * len(samples[order[j]].ids) <= batch_tokens:
            j += 1
        chunk = [samples[k] for k in order[i:j]]
        t_max = max(len(s.ids) for s in chunk)
        ids = torch.zeros(len(chunk), t_max, dtype=torch.long)
        mask = torch.zeros(len(chunk), t_max, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, :len(s.ids)] = torch.tensor(s.ids)
            mask[r, :len(s.ids)] = 1
        aux, final = target_features(target, ids, mask, layer_ids)
        for r, k in enumerate(order[i:j]):
            n = len(samples[k].ids)
            out[k] = Example(ids=ids[r, :n].clone(), start=samples[k].start,
                             aux=aux[r, :n].to(dtype).clone(), final=final[r, :n].to(dtype).clone())
        bar.update(int(mask.sum()))
        i = j
    bar.close()
    return out  # type: ignore[return-value]


def cached_features(cache: Path | None, target: nn.Module, samples: Sequence[Sample],
                    layer_ids: list[int], fingerprint: dict, dtype: torch.dtype, batch_tokens: int,
                    desc: str) -> list[Example]:
    """extract_features, memoised in `cache` (a folder) by samples + target + layers + dtype."""
    path = None
    if cache is not None:
        key = _samples_key(samples, {"target": fingerprint, "layers": layer_ids, "dtype": str(dtype)})
        path = cache / f"features-{desc}-{key}.pt"
        if path.is_file():
            try:
                rows = torch.load(path, weights_only=True)
                return [Example(**r) for r in rows]
            except Exception:  # noqa: BLE001 - a torn cache file is recomputed, not fatal
                pass
    examples = extract_features(target, samples, layer_ids, dtype=dtype,
                                batch_tokens=batch_tokens, desc=desc)
    if path is not None:
        _atomic_save([dataclasses.asdict(e) for e in examples], path)
    return examples


def collate(examples: Sequence[Example]) -> dict[str, Tensor]:
    """Right-padded batch; features are upcast to fp32 here, one batch at a time."""
    t = max(len(e.ids) for e in examples)
    b = len(examples)
    ids = torch.zeros(b, t, dtype=torch.long)
    aux = torch.zeros(b, t, examples[0].aux.shape[-1])
    final = torch.zeros(b, t, examples[0].final.shape[-1])
    for r, e in enumerate(examples):
        n = len(e.ids)
        ids[r, :n], aux[r, :n], final[r, :n] = e.ids, e.aux.float(), e.final.float()
    lengths = torch.tensor([len(e.ids) for e in examples])
    starts = torch.tensor([e.start for e in examples])
    out = {"ids": ids, "aux": aux, "final": final, "lengths": lengths, "starts": starts}
    if any(e.anchor_ok is not None for e in examples):
        out["anchor_ok"] = torch.ones(b, t, dtype=torch.bool)
        for r, e in enumerate(examples):
            if e.anchor_ok is not None:
                out["anchor_ok"][r, :len(e.ids)] = e.anchor_ok
    if all(e.tgt is not None for e in examples):
        out["target_ids"] = torch.zeros(b, t, dtype=torch.long)
        for r, e in enumerate(examples):
            out["target_ids"][r, :len(e.ids)] = e.tgt
    return out


# -- feature normalisation, cached labels -----------------------------------------------------------

def feature_scale(examples: Sequence[Example], max_rows: int = 200_000, seed: int = 0) -> Tensor:
    """1 / RMS of each aux feature dimension over (up to `max_rows` sampled) training rows,
    [n*H] float32; a dimension that is always 0 keeps scale 1."""
    rows = torch.cat([e.aux for e in examples]) if examples else torch.zeros(0)
    if rows.shape[0] > max_rows:
        g = torch.Generator().manual_seed(seed)
        rows = rows[torch.randperm(rows.shape[0], generator=g)[:max_rows]]
    rms = rows.float().pow(2).mean(0).sqrt()
    return torch.where(rms > 0, 1.0 / rms, torch.ones_like(rms))


def scale_features(examples: Sequence[Example], scale: Tensor) -> None:
    """aux *= scale in place (the stored dtype)."""
    for e in examples:
        e.aux = (e.aux.float() * scale).to(e.aux.dtype)


def fold_feature_scale(drafter: DFlashDrafter, scale: Tensor) -> DFlashDrafter:
    """A copy of `drafter` whose fc reads raw features: fc(x * scale) == fc'(x) with fc's
    input columns multiplied by scale."""
    import copy

    out = copy.deepcopy(drafter)
    with torch.no_grad():
        out.fc.weight.mul_(scale.to(out.fc.weight.dtype).view(1, -1))
    return out


def _labels(e: Example) -> Tensor:
    """What the drafter learns to emit after a response position: cached target labels, else
    the sequence's own next tokens."""
    lo = max(0, e.start - 1)
    return e.tgt[lo:] if e.tgt is not None else e.ids[lo + 1:]


def frequent_vocab(examples: Sequence[Example], lm_head_w: Tensor, size: int,
                   target_config=None) -> LossVocab:
    """The `size` most frequent labels of the examples (blocks.LossVocab), the target's
    end-of-sequence tokens always in."""
    counts = torch.bincount(torch.cat([_labels(e) for e in examples]),
                            minlength=lm_head_w.shape[0])
    eos = getattr(target_config, "eos_token_id", None) if target_config is not None else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return LossVocab.most_frequent(lm_head_w, counts, size, always=torch.tensor(eos, dtype=torch.long))


def label_coverage(examples: Sequence[Example], vocab: LossVocab) -> float:
    """Share of the examples' labels inside `vocab`."""
    labels = torch.cat([_labels(e) for e in examples])
    return float((vocab.index_of(labels) >= 0).float().mean()) if len(labels) else 1.0


def add_target_labels(examples: Sequence[Example], lm_head_w: Tensor) -> None:
    """Example.tgt = the target's argmax after each response position (blocks.target_argmax);
    prompt positions before the first anchor's are never labels and stay 0."""
    from .blocks import target_argmax

    for e in tqdm(examples, desc="target labels", unit="seq", leave=False):
        if e.tgt is None:
            lo = max(0, e.start - 1)  # the first block's first row reads position start
            e.tgt = torch.zeros(len(e.ids), dtype=torch.long)
            e.tgt[lo:] = target_argmax(e.final[lo:], lm_head_w)


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffled batches of similar-length sequences: shuffle, sort within windows of 16 batches
    by length (little padding), cut, shuffle the batches. A pure function of (seed, epoch)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    window = batch_size * 16
    batches = []
    for s in range(0, len(idx), window):
        part = sorted(idx[s:s + window], key=lambda i: lengths[i])
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


# -- schedule, checkpoints --------------------------------------------------------------------------

def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * shape
    return f


def _atomic_save(obj: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_drafter(out: Path, dcfg: DFlashConfig, drafter: DFlashDrafter,
                   length_head: LengthHead | None, scale: Tensor | None = None,
                   draft_vocab: LossVocab | None = None) -> None:
    """Put a vLLM-loadable drafter into `out` itself, next to train_state/ and the logs.

    save_drafter swaps whole folders, which would drop our other files, so it writes a sibling
    folder whose files are then moved in one by one (each os.replace is atomic). The weight index
    tells vLLM which .safetensors to read, so the other files in `out` never reach its loader.
    """
    if scale is not None:
        drafter = fold_feature_scale(drafter, scale)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        folder = save_drafter(tmp / "d", dcfg, drafter, length_head, draft_vocab=draft_vocab)
        names = sorted(p.name for p in folder.iterdir())
        for name in sorted(names, key=lambda n: n == "config.json"):  # config last
            os.replace(folder / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- one step ---------------------------------------------------------------------------------------

def make_optimizer(params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    # No decay on norms (gains) or biases: decaying them towards 0 only fights the init of 1.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def train_step(drafter: DFlashDrafter, batch: dict[str, Tensor], anchors_per_seq: int,
               anchor_seed: int, embed_w: Tensor, lm_head_w: Tensor, opt: torch.optim.Optimizer,
               params: list[nn.Parameter], *, loss_cfg: LossConfig, grad_clip: float,
               length_head: LengthHead | None = None, vocab: LossVocab | None = None,
               compute_dtype: torch.dtype = torch.float32):
    """One optimizer step on a collated batch: anchors inside the responses (drawn from
    `anchor_seed`), block_loss, clipped AdamW step. Returns (BlockStats, grad norm)."""
    t = batch["ids"].shape[1]
    gen = torch.Generator().manual_seed(anchor_seed)
    allowed = response_mask(batch["starts"], batch["lengths"], t)
    if "anchor_ok" in batch:
        allowed = allowed & batch["anchor_ok"]
    anchors = sample_anchors(allowed, batch["lengths"], anchors_per_seq,
                             drafter.config.num_draft_tokens, gen)
    with torch.autocast("cpu" if batch["ids"].device.type == "cpu" else "cuda",
                        dtype=compute_dtype, enabled=compute_dtype != torch.float32):
        loss, st = block_loss(drafter, batch["ids"], batch["aux"], batch["final"], anchors,
                              embed_w, lm_head_w, loss_cfg=loss_cfg, length_head=length_head,
                              lengths=batch["lengths"], vocab=vocab,
                              target_ids=batch.get("target_ids"))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return st, gnorm


# -- the loop ---------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    out: Path
    steps: int
    evals: list[dict]  # one per evaluation, epoch 0 = before training
    timings: dict[str, float]
    drafter: DFlashDrafter
    length_head: LengthHead | None
    config: DFlashConfig


def _weighted(stats: list[dict], key: str, weight: str) -> float:
    pairs = [(s[key], s[weight]) for s in stats if s[weight] > 0 and not math.isnan(s[key])]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else math.nan


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, length_head: LengthHead | None, examples: Sequence[Example],
             embed_w: Tensor, lm_head_w: Tensor, cfg: TrainConfig,
             ctx_kv_fn: Callable[[dict[str, Tensor]], list] | None = None,
             draft_vocab: LossVocab | None = None) -> dict:
    """Held-out metrics on blocks anchored in the responses with all K labels (fixed anchors).
    ctx_kv_fn(batch) -> per-layer context K/V to draft against instead of the drafter's own.
    draft_vocab: the drafter serves this reduced vocabulary: its argmax is taken within it,
    the target's over the whole vocabulary (needs cached labels and loss mode "ce")."""
    drafter.eval()
    k = drafter.config.num_draft_tokens
    gen = torch.Generator().manual_seed(12345)
    stats = []
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    for s in range(0, len(order), cfg.batch_size):
        batch = collate([examples[i] for i in order[s:s + cfg.batch_size]])
        t = batch["ids"].shape[1]
        allowed = response_mask(batch["starts"], batch["lengths"], t)
        allowed &= torch.arange(t) + k < batch["lengths"].view(-1, 1)  # full windows only
        anchors = sample_anchors(allowed, batch["lengths"], cfg.eval_anchors, k, gen)
        _, st = block_loss(drafter, batch["ids"], batch["aux"], batch["final"], anchors, embed_w,
                           lm_head_w, loss_cfg=cfg.loss, length_head=length_head, lengths=batch["lengths"],
                           ctx_kv=ctx_kv_fn(batch) if ctx_kv_fn else None,
                           **_served_vocab(draft_vocab, batch.get("target_ids"), cfg.loss))
        stats.append(st.as_dict())
    drafter.train()
    out = {key: _weighted(stats, key, "rows") for key in ("loss", "distill")}
    out["length"] = _weighted(stats, "length", "blocks")
    out["accepted"] = _weighted(stats, "accepted", "full_blocks")
    out["acceptance"] = out["accepted"] + 1
    out["blocks"] = int(sum(s["full_blocks"] for s in stats))
    out["match"] = [round(_weighted(stats, f"match_{i + 1}", "rows"), 4) for i in range(k)]
    return out


def _served_vocab(draft_vocab: LossVocab | None, target_ids: Tensor | None,
                  loss_cfg: LossConfig | None) -> dict:
    """block_loss keywords that score a reduced-vocabulary drafter as vLLM serves it."""
    if draft_vocab is None:
        return {}
    if target_ids is None or loss_cfg is None or loss_cfg.mode != "ce":
        raise ValueError("evaluating a reduced draft vocabulary needs cached target labels "
                         "and loss mode 'ce' (the target's argmax over its whole vocabulary)")
    return {"vocab": draft_vocab, "target_ids": target_ids}


@torch.no_grad()
def block_accepts(drafter: DFlashDrafter, e: Example, embed_w: Tensor, lm_head_w: Tensor,
                  loss_cfg: LossConfig | None = None, chunk: int = 64,
                  draft_vocab: LossVocab | None = None) -> list[int]:
    """Greedy drafts accepted by a block anchored at each answer position of `e` that has a
    full window (index 0 = the answer's first position, e.start); whole vocabulary."""
    k = drafter.config.num_draft_tokens
    n = len(e.ids)
    pos = torch.arange(e.start, max(e.start, n - k))  # full windows only
    acc: list[int] = []
    for s in range(0, len(pos), chunk):
        anchors = pos[s:s + chunk].view(1, -1)
        _, st = block_loss(drafter, e.ids.view(1, -1), e.aux.float().unsqueeze(0),
                           e.final.float().unsqueeze(0), anchors, embed_w, lm_head_w,
                           loss_cfg=loss_cfg, lengths=torch.tensor([n]),
                           **_served_vocab(draft_vocab, e.tgt.view(1, -1) if e.tgt is not None
                                           else None, loss_cfg))
        acc += st.per_block[0].tolist()
    return acc


@torch.no_grad()
def walk_eval(drafter: DFlashDrafter, examples: Sequence[Example], embed_w: Tensor,
              lm_head_w: Tensor, loss_cfg: LossConfig | None = None, chunk: int = 64,
              draft_vocab: LossVocab | None = None) -> dict:
    """Held-out acceptance as serving measures it: a block at every answer position, then a
    greedy walk through each answer (blocks.walk_acceptance). Whole vocabulary, one sequence
    at a time; ~10x the cost of `evaluate`, so the trainer runs it once, at the end."""
    drafter.eval()
    k = drafter.config.num_draft_tokens
    steps = tokens = full = 0
    for e in examples:
        walked = walk_steps(block_accepts(drafter, e, embed_w, lm_head_w, loss_cfg, chunk,
                                          draft_vocab), k)
        steps, tokens = steps + len(walked), tokens + sum(walked) + len(walked)
        full += sum(a == k for a in walked)
    drafter.train()
    # full_block_share: steps that accepted all K drafts, the only ones a longer block could
    # extend, so (K' - K) x this share bounds what K' > K drafts add per step.
    return {"walk_acceptance": tokens / steps if steps else math.nan, "walk_steps": steps,
            "walk_full_block_share": full / steps if steps else math.nan}


def _snapshot_dir(out: Path, step: int) -> Path:
    d = out / "snapshots" / f"step-{step:06d}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _truncate_log(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _log(out: Path, row: dict) -> None:
    with open(out / LOG_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _init_from(path: str, dcfg: DFlashConfig, drafter: DFlashDrafter,
               length_head: LengthHead | None) -> None:
    """Copy a trained drafter folder's weights into this run's drafter (and length head, when
    both have one); a shape that differs is one line naming the field."""
    from ..drafter.checkpoint import load_drafter

    icfg, idrafter, ihead = load_drafter(path, dtype=torch.float32)
    mine, theirs = dcfg.to_hf_dict(), icfg.to_hf_dict()
    for key in sorted(set(mine) | set(theirs)):
        if key not in ("torch_dtype", "draft_vocab_size") and mine.get(key) != theirs.get(key):
            raise ValueError(f"--init-from {path}: its {key} is {theirs.get(key)!r}, this run's "
                             f"{mine.get(key)!r}")
    drafter.load_state_dict(idrafter.state_dict())
    if length_head is not None and ihead is not None:
        length_head.load_state_dict(ihead.state_dict())


def train(target_path: str, train_samples: Sequence[Sample], heldout_samples: Sequence[Sample],
          out: str | os.PathLike, cfg: TrainConfig, *, target: nn.Module | None = None,
          stop_after: int | None = None, meta: dict | None = None,
          examples: tuple[Sequence[Example], Sequence[Example]] | None = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) a drafter in `out`; returns when done or after `stop_after` steps.

    `target`: an already loaded HF target (tests); by default loaded from target_path.
    `stop_after`: stop early after this global step, as a crash would (state is saved).
    `examples`: (train, held-out) features already computed (feature shards), matching the
    samples one to one; then the target is loaded only for its embedding and LM head.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_dir = out / STATE_DIR
    timings: dict[str, float] = {}
    torch.manual_seed(cfg.seed)

    from transformers import AutoConfig

    from .generate import model_fingerprint

    tcfg = target.config if target is not None else AutoConfig.from_pretrained(target_path)
    dcfg = DFlashConfig.for_target(
        tcfg, mask_token_id=cfg.mask_token_id, num_layers=cfg.num_layers,
        num_target_features=cfg.num_target_features, block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids)
    k = dcfg.num_draft_tokens
    if not train_samples:
        raise ValueError("no training samples")

    # Target + features. Loading the HF target is cheap next to running it, so it is always
    # loaded (for its embedding and LM head) and only run for features the cache lacks.
    t0 = time.perf_counter()
    fp = {"object": id(target)} if target is not None else model_fingerprint(target_path)
    if target is None:
        target = load_target(target_path, cfg.target_dtype)
    cache = state_dir if fp.get("path") else None  # in-memory targets (tests) are not cached
    timings["load_target_s"] = time.perf_counter() - t0
    fdtype = getattr(torch, cfg.feature_dtype)
    t0 = time.perf_counter()
    if examples is not None:
        train_ex, held_ex = list(examples[0]), list(examples[1])
        if len(train_ex) != len(train_samples) or len(held_ex) != len(heldout_samples):
            raise ValueError(f"examples ({len(train_ex)}, {len(held_ex)}) do not match the samples "
                             f"({len(train_samples)}, {len(heldout_samples)})")
    else:
        train_ex = cached_features(cache, target, train_samples, dcfg.target_layer_ids, fp, fdtype,
                                   cfg.feature_batch_tokens, "train")
        held_ex = cached_features(cache, target, heldout_samples, dcfg.target_layer_ids, fp, fdtype,
                                  cfg.feature_batch_tokens, "heldout") if heldout_samples else []
    timings["features_s"] = time.perf_counter() - t0
    n_tok = sum(len(e.ids) for e in train_ex)
    n_resp = sum(len(e.ids) - e.start for e in train_ex)
    log(f"features: {len(train_ex)} train sequences ({n_tok} tokens, {n_resp} response), "
        f"{len(held_ex)} held out, {timings['features_s']:.0f} s")

    # Frozen target tables in fp32 (the drafter trains in fp32 and exports bf16); the rest of
    # the target is not needed any more.
    embed_w = target.get_input_embeddings().weight.detach().float()
    lm_head_w = target.get_output_embeddings().weight.detach().float()
    if embed_w.shape[0] <= dcfg.mask_token_id:
        raise ValueError(f"mask token {dcfg.mask_token_id} has no embedding row "
                         f"(vocab {embed_w.shape[0]})")
    target = None
    if cfg.loss.mode == "ce":  # the step's only use of the target's head: do it once
        t0 = time.perf_counter()
        add_target_labels(train_ex + held_ex, lm_head_w)
        timings["labels_s"] = time.perf_counter() - t0
        log(f"target labels: {sum(len(e.ids) - e.start for e in train_ex)} response positions, "
            f"{timings['labels_s']:.0f} s")
    if cfg.anchors == "tree-miss":
        from .tree_anchors import mark_tree_misses

        t0 = time.perf_counter()
        share = mark_tree_misses(train_ex, cfg.tree_min_score, k)
        timings["tree_anchors_s"] = time.perf_counter() - t0
        log(f"anchors: the {share:.1%} of response positions where the suffix tree's score stays "
            f"below {cfg.tree_min_score:g} ({timings['tree_anchors_s']:.0f} s)")
    # loss.vocab "seen": every token of the training sequences (and their labels) is known up front.
    vocab = (LossVocab.of(lm_head_w, torch.cat([e.ids for e in train_ex]
                                               + [e.tgt for e in train_ex if e.tgt is not None]))
             if cfg.loss.vocab == "seen" else None)
    draft_vocab = None
    if cfg.init_from is not None:
        from ..drafter.checkpoint import load_draft_vocab

        draft_vocab = load_draft_vocab(cfg.init_from, dtype=torch.float32)
        if draft_vocab is not None:
            vocab = draft_vocab
            log(f"draft vocabulary: {cfg.init_from}'s {len(vocab)} tokens "
                f"({label_coverage(train_ex, vocab):.2%} of the training labels)")
    elif cfg.draft_vocab_size is not None:
        draft_vocab = vocab = frequent_vocab(train_ex, lm_head_w, cfg.draft_vocab_size, tcfg)
        log(f"draft vocabulary: the {len(vocab)} most frequent labels ("
            f"{label_coverage(train_ex, vocab):.2%} of the training labels), served as d2t")
    if vocab is not None and draft_vocab is None:
        log(f"loss vocabulary: {len(vocab)} of {lm_head_w.shape[0]} tokens (those in the "
            f"training sequences)")

    drafter = DFlashDrafter(dcfg).float()
    length_head = LengthHead(dcfg.hidden_size).float() if cfg.length_head else None
    if cfg.init_from is not None:
        _init_from(cfg.init_from, dcfg, drafter, length_head)
        log(f"weights: from {cfg.init_from}")
    params = list(drafter.parameters()) + (list(length_head.parameters()) if length_head is not None else [])
    opt = make_optimizer(params, cfg.lr, cfg.weight_decay)
    lengths = [len(e.ids) for e in train_ex]
    per_epoch = math.ceil(len(train_ex) / cfg.batch_size)
    total = cfg.max_steps or per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))

    scale = None
    if cfg.normalize_features:
        st_path = state_dir / "state.pt"
        scale = (torch.load(st_path, weights_only=False)["feature_scale"] if st_path.is_file()
                 else feature_scale(train_ex, seed=cfg.seed))
        scale_features(train_ex + held_ex, scale)
        log(f"features: normalised per dimension (RMS before: median {float((1 / scale).median()):.2f},"
            f" max {float((1 / scale).max()):.1f}), folded into fc at export")

    run_key = hashlib.sha256(json.dumps(
        {"cfg": cfg.to_json(), "dcfg": dcfg.to_hf_dict(), "data": _samples_key(train_samples, {})},
        sort_keys=True).encode()).hexdigest()[:16]
    step, evals, window = 0, [], []  # window: step stats since the last train_log row
    state_path = state_dir / "state.pt"
    if state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        if st.get("run_key") != run_key:
            raise ValueError(f"{out} holds a training run with other settings or data; "
                             f"use a new --out or delete {state_dir}")
        drafter.load_state_dict(st["drafter"])
        if length_head is not None:
            length_head.load_state_dict(st["length_head"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, evals, window = st["step"], st["evals"], st["window"]
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        _truncate_log(out / LOG_FILE, step)  # rows logged after the save are redone
        log(f"resumed at step {step}/{total} from {state_path}")
    else:
        (out / LOG_FILE).unlink(missing_ok=True)

    def save_state() -> None:
        _atomic_save({"run_key": run_key, "step": step, "evals": evals, "window": window,
                      "drafter": drafter.state_dict(),
                      "length_head": length_head.state_dict() if length_head is not None else None,
                      "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                      "feature_scale": scale,
                      "loss_vocab_ids": vocab.ids if vocab is not None else None,
                      "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}, state_path)

    def run_eval(epoch: int) -> None:
        if not held_ex:
            return
        t1 = time.perf_counter()
        ev = evaluate(drafter, length_head, held_ex, embed_w, lm_head_w, cfg,
                      draft_vocab=draft_vocab)
        if step >= total:  # the served-like figure, once (walk_eval's docstring)
            ev.update(walk_eval(drafter, held_ex, embed_w, lm_head_w, cfg.loss,
                                draft_vocab=draft_vocab))
            log(f"step {step}: held-out acceptance walking the answers as serving does "
                f"{ev['walk_acceptance']:.3f} tokens/step ({ev['walk_steps']} steps)")
        # Response tokens of the sequences trained on so far (repeats counted): the learning
        # curve's x axis within one run.
        ev.update(epoch=epoch, step=step, eval_s=round(time.perf_counter() - t1, 1),
                  response_tokens_seen=round(step / per_epoch * n_resp))
        evals.append(ev)
        _log(out, {"event": "eval", **ev})
        log(f"epoch {epoch} step {step}: held-out acceptance {ev['acceptance']:.3f} tokens/step "
            f"(accepted {ev['accepted']:.3f} of {k}, {ev['blocks']} blocks), loss {ev['loss']:.3f}, "
            f"match@1 {ev['match'][0]:.3f} [{ev['eval_s']:.0f} s]")

    meta = dict(meta or {})
    meta.update(train_sequences=len(train_ex), train_tokens=n_tok, train_response_tokens=n_resp,
                heldout_sequences=len(held_ex),
                heldout_response_tokens=sum(len(e.ids) - e.start for e in held_ex),
                loss_vocab_size=len(vocab) if vocab is not None else int(lm_head_w.shape[0]),
                num_speculative_tokens=k, block_size=dcfg.block_size,
                target_layer_ids=dcfg.target_layer_ids, drafter_parameters=drafter.num_parameters(),
                steps_total=total, train_config=cfg.to_json())

    t_train, t_eval0 = time.perf_counter(), 0.0
    if step == 0 and not evals:
        t1 = time.perf_counter()
        run_eval(0)
        t_eval0 = time.perf_counter() - t1
    drafter.train()
    last_save = time.perf_counter()
    bar = tqdm(total=total, initial=step, desc="train", unit="step", leave=False)
    stopped = False
    while step < total and not stopped:
        epoch, pos = divmod(step, per_epoch)
        batches = epoch_batches(lengths, cfg.batch_size, cfg.seed, epoch)
        for b in batches[pos:]:
            st, gnorm = train_step(drafter, collate([train_ex[i] for i in b]),
                                   cfg.anchors_per_seq, cfg.seed * 1_000_003 + step, embed_w,
                                   lm_head_w, opt, params, loss_cfg=cfg.loss,
                                   grad_clip=cfg.grad_clip, length_head=length_head, vocab=vocab,
                                   compute_dtype=getattr(torch, cfg.compute_dtype))
            sched.step()
            step += 1
            window.append({**st.as_dict(), "grad_norm": float(gnorm)})
            bar.update()
            if step % cfg.log_every == 0 or step == total:
                row = {"event": "train", "step": step, "epoch": step / per_epoch,
                       "lr": opt.param_groups[0]["lr"],
                       **{key: round(_weighted(window, key, w), 5) for key, w in (
                           ("loss", "rows"), ("distill", "rows"), ("length", "blocks"),
                           ("accepted", "full_blocks"), ("match_1", "rows"),
                           ("grad_norm", "rows"))},
                       "rows": int(sum(w["rows"] for w in window)),  # supervised draft rows
                       "elapsed_s": round(time.perf_counter() - t_train, 1)}
                _log(out, row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accepted'] + 1:.2f}")
                window.clear()
            if cfg.eval_every and step % cfg.eval_every == 0 and step % per_epoch and step < total:
                run_eval(step / per_epoch)
                export_drafter(_snapshot_dir(out, step), dcfg, drafter, length_head, scale,
                               draft_vocab)
            if step % per_epoch == 0 or step == total:
                run_eval(math.ceil(step / per_epoch))
                if cfg.eval_every:
                    export_drafter(_snapshot_dir(out, step), dcfg, drafter, length_head, scale,
                               draft_vocab)
                export_drafter(out, dcfg, drafter, length_head, scale, draft_vocab)
                save_state()
                last_save = time.perf_counter()
            elif time.perf_counter() - last_save > cfg.save_every_s:
                save_state()
                last_save = time.perf_counter()
            if stop_after is not None and step >= stop_after:
                save_state()
                stopped = True
            if step >= total or stopped:
                break
    bar.close()
    timings["train_s"] = time.perf_counter() - t_train - t_eval0
    timings["eval_s"] = sum(e.get("eval_s", 0) for e in evals)
    if not stopped:
        meta.update(evals=evals, timings={**meta.get("timings", {}), **timings})
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return TrainResult(out=out, steps=step, evals=evals, timings=timings, drafter=drafter,
                       length_head=length_head, config=dcfg)
