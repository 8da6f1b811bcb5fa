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
from contextlib import contextmanager
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
from .settings import TrainerSettings
from .shards import row_dtype

STATE_DIR = "train_state"
LOG_FILE = "train_log.jsonl"
META_FILE = "train_meta.json"


# -- features ---------------------------------------------------------------------------------------

@dataclass
class Example:
    """One sequence with its target features, ready for block_loss."""

    ids: Tensor  # [T] int64
    start: int  # first response position
    aux: Tensor  # [T, n*H] feature_dtype (fp8 shards: a ScaledFeatures, decoded when read)
    final: Tensor  # [T, H] feature_dtype
    tgt: Tensor | None = None  # [T] int64, the target's argmax after each position (cached labels)
    # [T] bool: positions a training block may be anchored at (None: every response position);
    # set by training/tree_anchors.py for `anchors = "tree-miss"`.
    anchor_ok: Tensor | None = None
    # [n*H] float32 applied to aux when read (normalize_features): the stored features stay as
    # they are on disk (memory-mapped shards are never copied whole)
    scale: Tensor | None = None

    def aux_f32(self) -> Tensor:
        """aux in float32, scaled when a feature scale is set."""
        return self.aux.float() * self.scale if self.scale is not None else self.aux.float()


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
        ids[r, :n], aux[r, :n], final[r, :n] = e.ids, e.aux_f32(), e.final.float()
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
    """1 / RMS of each aux feature dimension over (about `max_rows` of) the training rows,
    [n*H] float32; a dimension that is always 0 keeps scale 1."""
    # Whole sequences in a seeded order until max_rows: never all rows at once (the features of
    # millions of tokens do not fit in memory).
    g = torch.Generator().manual_seed(seed)
    picked, n = [], 0
    for i in torch.randperm(len(examples), generator=g).tolist():
        if n >= max_rows:
            break
        picked.append(examples[i].aux)
        n += examples[i].aux.shape[0]
    rows = torch.cat([p.float() for p in picked]) if picked else torch.zeros(0)
    rms = rows.pow(2).mean(0).sqrt()
    return torch.where(rms > 0, 1.0 / rms, torch.ones_like(rms))


def scale_features(examples: Sequence[Example], scale: Tensor) -> None:
    """Every example's aux is read scaled from now on (Example.aux_f32)."""
    for e in examples:
        e.scale = scale


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

def lr_lambda(cfg: TrainerSettings, total_steps: int) -> Callable[[int], float]:
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
             embed_w: Tensor, lm_head_w: Tensor, cfg: TrainerSettings,
             ctx_kv_fn: Callable[[dict[str, Tensor]], list] | None = None,
             draft_vocab: LossVocab | None = None) -> dict:
    """Held-out metrics on blocks anchored in the responses with all K labels (fixed anchors).
    ctx_kv_fn(batch) -> per-layer context K/V to draft against instead of the drafter's own.
    draft_vocab: the drafter serves this reduced vocabulary: its argmax is taken within it,
    the target's over the whole vocabulary (needs cached labels and loss mode "ce")."""
    drafter.eval()
    k = drafter.config.num_draft_tokens
    gen = torch.Generator().manual_seed(12345)
    loss_cfg, stats = cfg.loss, []
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    for s in range(0, len(order), cfg.batch_size):
        batch = collate([examples[i] for i in order[s:s + cfg.batch_size]])
        t = batch["ids"].shape[1]
        allowed = response_mask(batch["starts"], batch["lengths"], t)
        allowed &= torch.arange(t) + k < batch["lengths"].view(-1, 1)  # full windows only
        anchors = sample_anchors(allowed, batch["lengths"], cfg.eval_anchors, k, gen)
        _, st = block_loss(drafter, batch["ids"], batch["aux"], batch["final"], anchors, embed_w,
                           lm_head_w, loss_cfg=loss_cfg, length_head=length_head, lengths=batch["lengths"],
                           ctx_kv=ctx_kv_fn(batch) if ctx_kv_fn else None,
                           **_served_vocab(draft_vocab, batch.get("target_ids"), loss_cfg))
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
        _, st = block_loss(drafter, e.ids.view(1, -1), e.aux_f32().unsqueeze(0),
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


# -- the run ----------------------------------------------------------------------------------------

def drafter_config(target_config, cfg: TrainerSettings) -> DFlashConfig:
    """The DFlashConfig the settings give for a target's HF config."""
    if cfg.mask_token_id == "auto":
        raise ValueError("mask_token_id 'auto' is resolved from the tokenizer first "
                         "(training.cli.pick_mask_token)")
    return DFlashConfig.for_target(
        target_config, mask_token_id=cfg.mask_token_id, num_layers=cfg.layers,
        num_target_features=cfg.num_target_features, block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids)


@dataclass
class TrainData:
    """What a run trains and evaluates on, with the target's frozen tables in float32 (the
    drafter trains in float32 and exports bf16)."""

    train: list[Example]
    held: list[Example]
    embed_w: Tensor
    lm_head_w: Tensor


@dataclass
class Run:
    """One training run: what the step functions read and advance."""

    out: Path
    cfg: TrainerSettings
    loss: LossConfig
    dcfg: DFlashConfig
    data: TrainData
    drafter: DFlashDrafter
    length_head: LengthHead | None
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    vocab: LossVocab | None  # the rows the loss projects onto (None: the whole LM head)
    draft_vocab: LossVocab | None  # the reduced vocabulary served (None: the whole LM head)
    scale: Tensor | None  # per feature dimension (normalize_features), folded into fc at export
    total: int  # steps
    per_epoch: int
    run_key: str  # settings + data: a saved state resumes only the same run
    log: Callable[[str], None]
    step: int = 0
    evals: list[dict] = field(default_factory=list)
    window: list[dict] = field(default_factory=list)  # step stats since the last train_log row

    @property
    def state_path(self) -> Path:
        return self.out / STATE_DIR / "state.pt"


def _response_tokens(examples: Sequence[Example]) -> int:
    return sum(len(e.ids) - e.start for e in examples)


@contextmanager
def _timed(timings: dict[str, float], key: str):
    t0 = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - t0


def load_data(target_path: str, target: nn.Module | None, train_samples: Sequence[Sample],
              heldout_samples: Sequence[Sample], cfg: TrainerSettings, dcfg: DFlashConfig,
              examples, cache: Path, timings: dict[str, float], log) -> TrainData:
    """The examples (given, else the target's features, cached in `cache`) and the target's
    tables. Loading the HF target is cheap next to running it, so it is always loaded (for its
    embedding and LM head) and only run for features the cache lacks."""
    from .generate import model_fingerprint

    with _timed(timings, "load_target_s"):
        fp = {"object": id(target)} if target is not None else model_fingerprint(target_path)
        if target is None:
            target = load_target(target_path, cfg.target_dtype)
        cache = cache if fp.get("path") else None  # in-memory targets (tests) are not cached
    fdtype = row_dtype(cfg.feature_dtype)
    with _timed(timings, "features_s"):
        if examples is not None:
            train_ex, held_ex = list(examples[0]), list(examples[1])
            if len(train_ex) != len(train_samples) or len(held_ex) != len(heldout_samples):
                raise ValueError(f"examples ({len(train_ex)}, {len(held_ex)}) do not match the "
                                 f"samples ({len(train_samples)}, {len(heldout_samples)})")
        else:
            train_ex = cached_features(cache, target, train_samples, dcfg.target_layer_ids, fp,
                                       fdtype, cfg.feature_batch_tokens, "train")
            held_ex = cached_features(cache, target, heldout_samples, dcfg.target_layer_ids, fp,
                                      fdtype, cfg.feature_batch_tokens,
                                      "heldout") if heldout_samples else []
    log(f"features: {len(train_ex)} train sequences ({sum(len(e.ids) for e in train_ex)} "
        f"tokens, {_response_tokens(train_ex)} response), {len(held_ex)} held out, "
        f"{timings['features_s']:.0f} s")
    embed_w = target.get_input_embeddings().weight.detach().float()
    if embed_w.shape[0] <= dcfg.mask_token_id:
        raise ValueError(f"mask token {dcfg.mask_token_id} has no embedding row "
                         f"(vocab {embed_w.shape[0]})")
    return TrainData(train_ex, held_ex, embed_w,
                     target.get_output_embeddings().weight.detach().float())


def add_labels_and_anchors(cfg: TrainerSettings, k: int, data: TrainData,
                           timings: dict[str, float], log) -> None:
    """Loss mode ce: the target's argmax labels, once (the step's only use of the target's
    head). Anchors tree-miss: the positions where the suffix tree's score stays low."""
    if cfg.loss_mode == "ce":
        with _timed(timings, "labels_s"):
            add_target_labels(data.train + data.held, data.lm_head_w)
        log(f"target labels: {_response_tokens(data.train)} response positions, "
            f"{timings['labels_s']:.0f} s")
    if cfg.anchors == "tree-miss":
        from .tree_anchors import mark_tree_misses

        with _timed(timings, "tree_anchors_s"):
            share = mark_tree_misses(data.train, cfg.tree_min_score, k)
        log(f"anchors: the {share:.1%} of response positions where the suffix tree's score stays "
            f"below {cfg.tree_min_score:g} ({timings['tree_anchors_s']:.0f} s)")


def loss_vocabs(cfg: TrainerSettings, data: TrainData, target_config,
                log) -> tuple[LossVocab | None, LossVocab | None]:
    """(the rows the loss projects onto, the reduced draft vocabulary served). loss_vocab seen:
    every token of the training sequences and their labels, known up front; a draft vocabulary
    (init_from's, or the draft_vocab_size most frequent labels) replaces it."""
    train_ex, lm_head_w = data.train, data.lm_head_w
    vocab = (LossVocab.of(lm_head_w, torch.cat([e.ids for e in train_ex]
                                               + [e.tgt for e in train_ex if e.tgt is not None]))
             if cfg.loss_vocab == "seen" else None)
    draft_vocab = None
    if cfg.init_from is not None:
        from ..drafter.checkpoint import load_draft_vocab

        draft_vocab = load_draft_vocab(cfg.init_from, dtype=torch.float32)
        if draft_vocab is not None:
            vocab = draft_vocab
            log(f"draft vocabulary: {cfg.init_from}'s {len(vocab)} tokens "
                f"({label_coverage(train_ex, vocab):.2%} of the training labels)")
    elif cfg.draft_vocab_size is not None:
        draft_vocab = vocab = frequent_vocab(train_ex, lm_head_w, cfg.draft_vocab_size,
                                             target_config)
        log(f"draft vocabulary: the {len(vocab)} most frequent labels ("
            f"{label_coverage(train_ex, vocab):.2%} of the training labels), served as d2t")
    if vocab is not None and draft_vocab is None:
        log(f"loss vocabulary: {len(vocab)} of {lm_head_w.shape[0]} tokens (those in the "
            f"training sequences)")
    return vocab, draft_vocab


def new_run(out: Path, cfg: TrainerSettings, dcfg: DFlashConfig, data: TrainData, vocabs,
            train_samples: Sequence[Sample], log) -> Run:
    """The drafter (fresh, or init_from's weights), its length head, AdamW and the schedule;
    with normalize_features the features scaled (by a saved state's scale when resuming)."""
    drafter = DFlashDrafter(dcfg).float()
    length_head = LengthHead(dcfg.hidden_size).float() if cfg.length_head else None
    if cfg.init_from is not None:
        _init_from(cfg.init_from, dcfg, drafter, length_head)
        log(f"weights: from {cfg.init_from}")
    params = list(drafter.parameters()) + (list(length_head.parameters())
                                           if length_head is not None else [])
    opt = make_optimizer(params, cfg.lr, cfg.weight_decay)
    per_epoch = math.ceil(len(data.train) / cfg.batch_size)
    total = cfg.steps or per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    state_path = out / STATE_DIR / "state.pt"
    scale = None
    if cfg.normalize_features:
        scale = (torch.load(state_path, weights_only=False)["feature_scale"]
                 if state_path.is_file() else feature_scale(data.train, seed=cfg.seed))
        scale_features(data.train + data.held, scale)
        log(f"features: normalised per dimension (RMS before: median "
            f"{float((1 / scale).median()):.2f}, max {float((1 / scale).max()):.1f}), folded "
            f"into fc at export")
    run_key = hashlib.sha256(json.dumps(
        {"cfg": cfg.trainer_json(), "dcfg": dcfg.to_hf_dict(),
         "data": _samples_key(train_samples, {})}, sort_keys=True).encode()).hexdigest()[:16]
    return Run(out, cfg, cfg.loss, dcfg, data, drafter, length_head, params, opt, sched,
               *vocabs, scale, total, per_epoch, run_key, log)


def resume(run: Run) -> None:
    """Continue from the saved state, refused when its settings or data differ; without one,
    a new train_log."""
    if not run.state_path.is_file():
        (run.out / LOG_FILE).unlink(missing_ok=True)
        return
    st = torch.load(run.state_path, weights_only=False)
    if st.get("run_key") != run.run_key:
        raise ValueError(f"{run.out} holds a training run with other settings or data; "
                         f"use a new --out or delete {run.out / STATE_DIR}")
    run.drafter.load_state_dict(st["drafter"])
    if run.length_head is not None:
        run.length_head.load_state_dict(st["length_head"])
    run.opt.load_state_dict(st["optimizer"])
    run.sched.load_state_dict(st["scheduler"])
    run.step, run.evals, run.window = st["step"], st["evals"], st["window"]
    torch.set_rng_state(st["torch_rng"])
    random.setstate(st["py_rng"])
    _truncate_log(run.out / LOG_FILE, run.step)  # rows logged after the save are redone
    run.log(f"resumed at step {run.step}/{run.total} from {run.state_path}")


def save_state(run: Run) -> None:
    _atomic_save({"run_key": run.run_key, "step": run.step, "evals": run.evals,
                  "window": run.window, "drafter": run.drafter.state_dict(),
                  "length_head": (run.length_head.state_dict()
                                  if run.length_head is not None else None),
                  "optimizer": run.opt.state_dict(), "scheduler": run.sched.state_dict(),
                  "feature_scale": run.scale,
                  "loss_vocab_ids": run.vocab.ids if run.vocab is not None else None,
                  "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()},
                 run.state_path)


def run_meta(run: Run, meta: dict | None) -> dict:
    """train_meta.json: the caller's keys, then the data, the drafter's shape and settings."""
    d = run.data
    return {**(meta or {}), "train_sequences": len(d.train),
            "train_tokens": sum(len(e.ids) for e in d.train),
            "train_response_tokens": _response_tokens(d.train), "heldout_sequences": len(d.held),
            "heldout_response_tokens": _response_tokens(d.held),
            "loss_vocab_size": len(run.vocab) if run.vocab is not None else int(d.lm_head_w.shape[0]),
            "num_speculative_tokens": run.dcfg.num_draft_tokens,
            "block_size": run.dcfg.block_size, "target_layer_ids": run.dcfg.target_layer_ids,
            "drafter_parameters": run.drafter.num_parameters(), "steps_total": run.total,
            "train_config": run.cfg.trainer_json()}


def run_eval(run: Run, epoch: float) -> None:
    """Held-out acceptance now (after the last step also the served-like walk), logged."""
    d = run.data
    if not d.held:
        return
    t1 = time.perf_counter()
    ev = evaluate(run.drafter, run.length_head, d.held, d.embed_w, d.lm_head_w, run.cfg,
                  draft_vocab=run.draft_vocab)
    if run.step >= run.total:  # the served-like figure, once (walk_eval's docstring)
        ev.update(walk_eval(run.drafter, d.held, d.embed_w, d.lm_head_w, run.loss,
                            draft_vocab=run.draft_vocab))
        run.log(f"step {run.step}: held-out acceptance walking the answers as serving does "
                f"{ev['walk_acceptance']:.3f} tokens/step ({ev['walk_steps']} steps)")
    # Response tokens of the sequences trained on so far (repeats counted): the learning
    # curve's x axis within one run.
    ev.update(epoch=epoch, step=run.step, eval_s=round(time.perf_counter() - t1, 1),
              response_tokens_seen=round(run.step / run.per_epoch * _response_tokens(d.train)))
    run.evals.append(ev)
    _log(run.out, {"event": "eval", **ev})
    run.log(f"epoch {epoch} step {run.step}: held-out acceptance {ev['acceptance']:.3f} "
            f"tokens/step (accepted {ev['accepted']:.3f} of {run.dcfg.num_draft_tokens}, "
            f"{ev['blocks']} blocks), loss {ev['loss']:.3f}, match@1 {ev['match'][0]:.3f} "
            f"[{ev['eval_s']:.0f} s]")


def take_step(run: Run, batch: list[int]) -> None:
    cfg, d = run.cfg, run.data
    st, gnorm = train_step(run.drafter, collate([d.train[i] for i in batch]),
                           cfg.anchors_per_seq, cfg.seed * 1_000_003 + run.step, d.embed_w,
                           d.lm_head_w, run.opt, run.params, loss_cfg=run.loss,
                           grad_clip=cfg.grad_clip, length_head=run.length_head,
                           vocab=run.vocab, compute_dtype=getattr(torch, cfg.compute_dtype))
    run.sched.step()
    run.step += 1
    run.window.append({**st.as_dict(), "grad_norm": float(gnorm)})


def train_row(run: Run, elapsed_s: float) -> dict:
    """train_log.jsonl's row for the steps since the last one: their stats' weighted means."""
    w = run.window
    return {"event": "train", "step": run.step, "epoch": run.step / run.per_epoch,
            "lr": run.opt.param_groups[0]["lr"],
            **{key: round(_weighted(w, key, weight), 5) for key, weight in (
                ("loss", "rows"), ("distill", "rows"), ("length", "blocks"),
                ("accepted", "full_blocks"), ("match_1", "rows"), ("grad_norm", "rows"))},
            "rows": int(sum(x["rows"] for x in w)),  # supervised draft rows
            "elapsed_s": round(elapsed_s, 1)}


def export(run: Run, folder: Path) -> None:
    export_drafter(folder, run.dcfg, run.drafter, run.length_head, run.scale, run.draft_vocab)


def checkpoint(run: Run, last_save: float) -> float:
    """After a step: the extra evaluation and snapshot (eval_every); at an epoch's end or the
    last step the evaluation, the exported drafter and the state; else the state every
    save_every_s. Returns when the state was last saved."""
    cfg, step, per_epoch = run.cfg, run.step, run.per_epoch
    if cfg.eval_every and step % cfg.eval_every == 0 and step % per_epoch and step < run.total:
        run_eval(run, step / per_epoch)
        export(run, _snapshot_dir(run.out, step))
    if step % per_epoch == 0 or step == run.total:
        run_eval(run, math.ceil(step / per_epoch))
        if cfg.eval_every:
            export(run, _snapshot_dir(run.out, step))
        export(run, run.out)
        save_state(run)
        return time.perf_counter()
    if time.perf_counter() - last_save > cfg.save_every_s:
        save_state(run)
        return time.perf_counter()
    return last_save


def train_loop(run: Run, stop_after: int | None, t_train: float) -> bool:
    """Steps to the last one, or to `stop_after` with the state saved (as a crash would leave
    it); True when stopped early. Batches are a function of (seed, epoch): a resumed run takes
    the steps the uninterrupted one would have."""
    cfg, lengths = run.cfg, [len(e.ids) for e in run.data.train]
    last_save = time.perf_counter()
    bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step", leave=False)
    stopped = False
    while run.step < run.total and not stopped:
        epoch, pos = divmod(run.step, run.per_epoch)
        for batch in epoch_batches(lengths, cfg.batch_size, cfg.seed, epoch)[pos:]:
            take_step(run, batch)
            bar.update()
            if run.step % cfg.log_every == 0 or run.step == run.total:
                row = train_row(run, time.perf_counter() - t_train)
                _log(run.out, row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accepted'] + 1:.2f}")
                run.window.clear()
            last_save = checkpoint(run, last_save)
            stopped = stop_after is not None and run.step >= stop_after
            if stopped:
                save_state(run)
            if run.step >= run.total or stopped:
                break
    bar.close()
    return stopped


def train(target_path: str, train_samples: Sequence[Sample], heldout_samples: Sequence[Sample],
          out: str | os.PathLike, cfg: TrainerSettings, *, target: nn.Module | None = None,
          stop_after: int | None = None, meta: dict | None = None,
          examples: tuple[Sequence[Example], Sequence[Example]] | None = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) a drafter in `out`; returns when done or after `stop_after` steps.

    `cfg.mask_token_id`: an int (training.cli.pick_mask_token resolves 'auto').
    `target`: an already loaded HF target (tests); by default loaded from target_path.
    `stop_after`: stop early after this global step, as a crash would (state is saved).
    `examples`: (train, held-out) features already computed (feature shards), matching the
    samples one to one; then the target is loaded only for its embedding and LM head.
    """
    from transformers import AutoConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    tcfg = target.config if target is not None else AutoConfig.from_pretrained(target_path)
    dcfg = drafter_config(tcfg, cfg)
    if not train_samples:
        raise ValueError("no training samples")
    data = load_data(target_path, target, train_samples, heldout_samples, cfg, dcfg, examples,
                     out / STATE_DIR, timings, log)
    add_labels_and_anchors(cfg, dcfg.num_draft_tokens, data, timings, log)
    run = new_run(out, cfg, dcfg, data, loss_vocabs(cfg, data, tcfg, log), train_samples, log)
    resume(run)
    meta = run_meta(run, meta)
    t_train, t_eval0 = time.perf_counter(), 0.0
    if run.step == 0 and not run.evals:
        run_eval(run, 0)
        t_eval0 = time.perf_counter() - t_train
    run.drafter.train()
    stopped = train_loop(run, stop_after, t_train)
    timings["train_s"] = time.perf_counter() - t_train - t_eval0
    timings["eval_s"] = sum(e.get("eval_s", 0) for e in run.evals)
    if not stopped:
        meta.update(evals=run.evals, timings={**meta.get("timings", {}), **timings})
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return TrainResult(out=out, steps=run.step, evals=run.evals, timings=timings,
                       drafter=run.drafter, length_head=run.length_head, config=dcfg)
