"""Building the online learner for a DFlash drafter: its training copy, objective and buffer.

The serving layer calls `build_learner(...)` with the drafter checkpoint, the target's frozen
embedding and LM head, and vLLM's K; tests call it the same way without an engine.

K (vLLM's `num_speculative_tokens`) and the drafter's `block_size` (K_drafter + 1) need not
agree: vLLM 0.32 takes K only from its speculative config and runs any DFlash drafter with any
K (the drafter's weights do not depend on it). The learner trains what is served: its copy of
the drafter gets block_size = K + 1, so blocks have K labels, the position weights and the
length head's label (accepted + 1) / (K + 1) use vLLM's K, and the holdback is K. Checkpoints
keep the block_size the drafter came with (the weights are the same either way).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import LossConfig, OnlineSpecConfig
from ..drafter import DFlashConfig, LengthHead, load_drafter, save_drafter
from .batches import make_batch_fn
from .buffer import FeedbackBuffer
from .learner import OnlineLearner

logger = logging.getLogger("vllm_onlinespec")


class TrainBundle(nn.Module):
    """What the learner trains: the drafter twin and, optionally, its length head. Snapshot
    names are `drafter.*` and `length_head.*`."""

    def __init__(self, drafter: nn.Module, length_head: nn.Module | None) -> None:
        super().__init__()
        self.drafter = drafter
        self.length_head = length_head


class DistillObjective:
    """loss_fn(bundle, batch) for OnlineLearner: training.blocks.block_loss against the target's
    frozen embedding and LM head (float32 CPU copies)."""

    def __init__(self, embed_w: torch.Tensor, lm_head_w: torch.Tensor, loss_cfg: LossConfig) -> None:
        with torch.inference_mode(False):
            self.embed_w = embed_w.detach().to("cpu", torch.float32).clone()
            self.lm_head_w = lm_head_w.detach().to("cpu", torch.float32).clone()
        self.loss_cfg = loss_cfg

    def __call__(self, model: TrainBundle, batch: Any) -> tuple[torch.Tensor, dict]:
        from ..training.blocks import block_loss

        loss, stats = block_loss(model.drafter, batch.ids, batch.aux.float(),
                                 batch.final_hidden.float(), batch.anchors, self.embed_w,
                                 self.lm_head_w, loss_cfg=self.loss_cfg,
                                 length_head=model.length_head, lengths=batch.lengths)
        return loss, stats.as_dict()


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


def build_learner(cfg: OnlineSpecConfig, drafter_path: str | Path, embed_w: torch.Tensor,
                  lm_head_w: torch.Tensor, K: int, *, train_length_head: bool) -> LearnerParts:
    """A learner (not started) for the drafter at `drafter_path`, serving K draft tokens.

    train_length_head: train a length head beside the drafter (the checkpoint's, else a fresh
    one). The caller decides: a head is only worth training for a policy that consults it,
    and only when `length_head.train` asks for it.
    """
    dcfg, drafter, ckpt_head = load_drafter(drafter_path, dtype=torch.float32)
    tcfg = served_config(dcfg, K)
    if tcfg is not dcfg:
        logger.info("onlinespec: drafter %s has block_size %d (%d draft tokens) but vLLM's "
                    "num_speculative_tokens is %d: the learner trains the %d positions vLLM "
                    "serves", drafter_path, dcfg.block_size, dcfg.num_draft_tokens, K, K)
    drafter.config = tcfg
    head = None
    if train_length_head:
        head = copy.deepcopy(ckpt_head) if ckpt_head is not None else LengthHead(dcfg.hidden_size)
        head = head.to(torch.float32)
    bundle = TrainBundle(drafter, head)
    buffer = FeedbackBuffer.from_config(cfg)
    make_batch = make_batch_fn(cfg.batch_blocks, cfg.anchors_per_request, holdback=K)

    def save_model(directory: Path) -> None:  # learner checkpoints stay loadable by vLLM
        save_drafter(directory, dcfg, bundle.drafter, bundle.length_head)

    learner = OnlineLearner(bundle, cfg, DistillObjective(embed_w, lm_head_w, cfg.loss),
                            make_batch, buffer, save_model=save_model, holdback=K)
    return LearnerParts(learner, buffer, bundle, dcfg, tcfg, ckpt_head)
