"""Building the online learner for a DFlash drafter: its training copy, objective and buffer.

The serving layer calls `build_learner(...)` with the drafter checkpoint, the target's frozen
embedding and LM head, and vLLM's K; tests call it the same way without an engine.

K (vLLM's `num_speculative_tokens`) and the drafter's `block_size` (K_drafter + 1) need not
agree: vLLM 0.32 takes K only from its speculative config and runs any DFlash drafter with any
K (the drafter's weights do not depend on it). The learner trains what is served: its copy of
the drafter gets block_size = K + 1, so blocks have K labels, the position weights and the
length head's label (accepted + 1) / (K + 1) use vLLM's K, and the holdback is K. Checkpoints
keep the block_size the drafter came with (the weights are the same either way).

Device: everything the learner owns (its drafter copy, the length head, the update rule's state,
batches and the loss) lives on `device` (cfg.learner_device; "auto" = where vLLM's drafter is,
which the serving layer passes). The target's embedding and LM head are read in place, never
cloned or converted: at Qwen3-8B size each is a 1.2 GB [V, H] matrix, and the loss kernels cast
a bf16 head per slice/tile themselves. Only a learner on another device than the target gets
one copy of each, in their own dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import LossConfig, OnlineSpecConfig
from ..drafter import DFlashConfig, LengthHead, load_draft_vocab, load_drafter, save_drafter
from .batches import BlockBatch, make_batch_fn
from .buffer import FeedbackBuffer
from .device import compute_dtype, learner_dtype, normalize_device, resolve_device
from .learner import OnlineLearner
from .memory import LearnerFootprint, learner_footprint

logger = logging.getLogger("vllm_onlinespec")
DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainBundle(nn.Module):
    """What the learner trains: the drafter twin and, optionally, its length head. Snapshot
    names are `drafter.*` and `length_head.*`."""

    def __init__(self, drafter: nn.Module, length_head: nn.Module | None) -> None:
        super().__init__()
        self.drafter = drafter
        self.length_head = length_head


def loss_impl(device: torch.device) -> str:
    """The fused Triton loss on CUDA when triton is importable, else the chunked PyTorch one
    (never the naive [N, V] reference: it is for tests)."""
    from ..kernels import triton_available

    return "triton" if device.type == "cuda" and triton_available() else "chunked"


def on_device(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`w` itself when it is on `device` (read in place); else one copy there, same dtype."""
    return w if w.device == device else w.detach().to(device)


class DistillObjective:
    """loss_fn(bundle, batch) for OnlineLearner: training.blocks.block_loss against the target's
    frozen embedding and LM head, used read-only in place (see the module docstring)."""

    def __init__(self, embed_w: torch.Tensor, lm_head_w: torch.Tensor, loss_cfg: LossConfig,
                 device: torch.device | str | None = None,
                 autocast: torch.dtype | None = None, draft_vocab=None) -> None:
        self.device = normalize_device(device) if device is not None else lm_head_w.device
        # bf16 matmuls under torch autocast (learner_compute_dtype); None = as the tensors are.
        self.autocast = autocast
        self.embed_w = on_device(embed_w, self.device)
        self.lm_head_w = on_device(lm_head_w, self.device)
        self.loss_cfg = loss_cfg
        self.impl = loss_impl(self.device)
        # loss.vocab "seen": the tokens of every feedback batch so far, a set that only grows
        # (served text reuses a few thousand tokens, so it stops growing early and the loss
        # projects onto ~1/5 of the LM head; blocks.LossVocab).
        self._seen = (torch.zeros(self.lm_head_w.shape[0], dtype=torch.bool, device=self.device)
                      if loss_cfg.vocab == "seen" and draft_vocab is None else None)
        # A drafter served with a reduced vocabulary (d2t) trains against exactly its rows.
        self._fixed = draft_vocab.to(self.device) if draft_vocab is not None else None
        self._vocab = None

    def retarget(self, embed_w: torch.Tensor, lm_head_w: torch.Tensor) -> None:
        """The target's weights changed (an in-flight swap): read its embedding and LM head
        again and drop the LM-head slice built from the old ones. A reduced draft vocabulary
        keeps its rows: they are the drafter's own LM head, not the target's."""
        self.embed_w = on_device(embed_w, self.device)
        self.lm_head_w = on_device(lm_head_w, self.device)
        self._vocab = None

    def vocab_for(self, ids: torch.Tensor):
        """The LossVocab covering `ids` and every token seen before (None for loss.vocab 'full').
        Rebuilt only when a batch brings a new token: the slice copies the rows it keeps."""
        from ..training.blocks import LossVocab

        if self._fixed is not None:
            return self._fixed
        if self._seen is None:
            return None
        flat = ids.flatten()
        if self._vocab is None or not bool(self._seen[flat].all()):
            self._seen[flat] = True
            self._vocab = LossVocab.of(self.lm_head_w, self._seen.nonzero().squeeze(1))
        return self._vocab

    def to_device(self, batch: BlockBatch) -> BlockBatch:
        """The batch on the learner's device (the buffer keeps feedback on the host)."""
        if batch.ids.device == self.device:
            return batch
        # non_blocking: pinned-or-not, the copies are ordered on the learner's stream before
        # the loss reads them.
        mv = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(batch, ids=mv(batch.ids), aux=mv(batch.aux),
                                   final_hidden=mv(batch.final_hidden),
                                   lengths=mv(batch.lengths), anchors=mv(batch.anchors))

    def __call__(self, model: TrainBundle, batch: BlockBatch) -> tuple[torch.Tensor, dict]:
        return self.loss(model, batch, self.vocab_for(batch.ids))

    def loss(self, model: TrainBundle, batch: BlockBatch, vocab) -> tuple[torch.Tensor, dict]:
        """The loss over `vocab` (a LossVocab, draft-vocabulary ids or None: the full head)."""
        from ..training.blocks import block_loss

        batch = self.to_device(batch)
        # Features in the training dtype (float32 on CPU; bf16 when the learner trains in bf16).
        dtype = model.drafter.dtype
        # autograd replays the recorded bf16 ops in the backward, so the gradients (of float32
        # parameters) come out of bf16 matmuls too; the update itself stays in float32.
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            loss, stats = block_loss(model.drafter, batch.ids, batch.aux.to(dtype),
                                     batch.final_hidden.to(dtype), batch.anchors, self.embed_w,
                                     self.lm_head_w, loss_cfg=self.loss_cfg,
                                     length_head=model.length_head, lengths=batch.lengths,
                                     impl=self.impl, vocab=vocab)
        return loss, stats.as_dict()

    def warm_up(self, model: TrainBundle) -> None:
        """One tiny forward and backward of the loss on the learner's device, when it runs the
        Triton kernels: they compile (and launch) now, so a Triton that cannot build them for
        this GPU stops start-up with one line, instead of failing every update on the learner
        thread while serving goes on with a frozen drafter. The seen-token vocabulary is left
        alone (the full head, or the draft vocabulary, is what the kernels read)."""
        if self.impl != "triton":
            return
        cfg = model.drafter.config
        K, T = cfg.num_draft_tokens, cfg.num_draft_tokens + 2
        on = dict(device=self.device)
        batch = BlockBatch(
            ids=torch.ones(1, T, dtype=torch.long, **on),
            aux=torch.zeros(1, T, cfg.fc_in_features, **on),
            final_hidden=torch.zeros(1, T, cfg.hidden_size, **on),
            lengths=torch.full((1,), T, dtype=torch.long, **on),
            anchors=torch.full((1, 1), T - 1 - K, dtype=torch.long, **on), num_fresh=K)
        params = [p for p in model.parameters() if p.requires_grad]
        cuda = self.device.type == "cuda"
        try:
            loss, _ = self.loss(model, batch, self._fixed)
            torch.autograd.grad(loss, params, allow_unused=True)
            if cuda:
                torch.cuda.synchronize(self.device)  # a launch error surfaces here, not later
        except Exception as e:  # noqa: BLE001 - any failure here would fail every update
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise RuntimeError(
                f"onlinespec: the learner's Triton loss kernels failed on {self.device} at "
                f"start-up ({type(e).__name__}: {first}); the drafter could never learn: fix "
                f"the Triton install for this GPU or set learner_device 'cpu'") from e
        finally:
            if cuda:  # the warm-up's transients are not the learner's held memory
                torch.cuda.empty_cache()


def served_config(config: DFlashConfig, K: int) -> DFlashConfig:
    """The drafter config the learner trains with: block_size = vLLM's K + 1."""
    if K < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1 (got {K})")
    return config if config.block_size == K + 1 else dataclasses.replace(config, block_size=K + 1)


@dataclass
class LearnerParts:
    learner: OnlineLearner
    buffer: FeedbackBuffer
    bundle: TrainBundle
    config: DFlashConfig  # as the checkpoint has it (what checkpoints are written with)
    trained_config: DFlashConfig  # block_size = K + 1
    checkpoint_head: LengthHead | None  # the head the drafter checkpoint shipped, if any
    footprint: LearnerFootprint | None = None  # its memory on the learner's device


def build_learner(cfg: OnlineSpecConfig, drafter_path: str | Path, embed_w: torch.Tensor,
                  lm_head_w: torch.Tensor, K: int, *, train_length_head: bool,
                  device: torch.device | str | None = None) -> LearnerParts:
    """A learner (not started) for the drafter at `drafter_path`, serving K draft tokens.

    train_length_head: train a length head beside the drafter (the checkpoint's, else a fresh
    one). The caller decides: a head is only worth training for a policy that consults it,
    and only when `length_head.train` asks for it.
    device: the learner's device; default cfg.learner_device, where "auto" means the device of
    the target's LM head (the serving layer passes vLLM's drafter's device instead).
    """
    dev = normalize_device(device) if device is not None else resolve_device(
        cfg.learner_device, lm_head_w.device)
    dtype = learner_dtype(cfg.learner_dtype, dev)
    if dtype != DTYPES_BY_NAME[cfg.learner_dtype]:
        logger.warning("onlinespec: learner_dtype %s ignored on %s: the learner trains in "
                       "float32 there", cfg.learner_dtype, dev)
    dcfg, drafter, ckpt_head = load_drafter(drafter_path, dtype=dtype)
    draft_vocab = load_draft_vocab(drafter_path, dtype=lm_head_w.dtype)
    drafter = drafter.to(dev)
    tcfg = served_config(dcfg, K)
    if tcfg is not dcfg:
        logger.info("onlinespec: drafter %s has block_size %d (%d draft tokens) but vLLM's "
                    "num_speculative_tokens is %d: the learner trains the %d positions vLLM "
                    "serves", drafter_path, dcfg.block_size, dcfg.num_draft_tokens, K, K)
    drafter.config = tcfg
    head = None
    if train_length_head:
        head = copy.deepcopy(ckpt_head) if ckpt_head is not None else LengthHead(dcfg.hidden_size)
        # The head is small and its MSE wants precision: float32 whatever the drafter's dtype.
        head = head.to(device=dev, dtype=torch.float32)
    bundle = TrainBundle(drafter, head)
    buffer = FeedbackBuffer.from_config(cfg)
    make_batch = make_batch_fn(cfg.batch_blocks, cfg.anchors_per_request, holdback=K,
                               stride=cfg.anchor_stride, replay=cfg.replay)

    def save_model(directory: Path) -> None:  # learner checkpoints stay loadable by vLLM
        save_drafter(directory, dcfg, bundle.drafter, bundle.length_head,
                     draft_vocab=draft_vocab)

    objective = DistillObjective(embed_w, lm_head_w, cfg.loss, dev,
                                 autocast=compute_dtype(cfg.learner_compute_dtype, dev),
                                 draft_vocab=draft_vocab)
    objective.warm_up(bundle)  # the Triton kernels compile now: a failure stops start-up
    reference, frozen = None, None
    if cfg.pacing.share_control == "gain":
        # The frozen start weights, scored on the learner's own batches: what learning bought
        # (learner/duty_cycle.py). No length head: only the drafter's acceptance is compared.
        frozen = TrainBundle(copy.deepcopy(drafter).requires_grad_(False), None)
        reference = lambda batch: objective(frozen, batch)[1]  # noqa: E731
    learner = OnlineLearner(bundle, cfg, objective, make_batch, buffer, save_model=save_model,
                            holdback=K, reference=reference)
    learner.algo.reserve()  # the rule's state now, before vLLM profiles memory (learner/memory.py)
    footprint = learner_footprint(
        learner.params, learner.algo, rows=cfg.batch_blocks * K,
        vocab=len(draft_vocab) if draft_vocab is not None else lm_head_w.shape[0],
        reference=list(frozen.parameters()) if frozen is not None else ())
    return LearnerParts(learner, buffer, bundle, dcfg, tcfg, ckpt_head, footprint)
