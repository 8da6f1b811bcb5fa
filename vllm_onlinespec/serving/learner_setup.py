"""The learning side of a session, built once at start-up: the learner (learner/factory.py)
with its memory checked before vLLM profiles, the length head the cutter predicts with, the
served tokens' feature log, and a resume from the newest checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.learner.memory import check_fits
from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving.validate import drafter_dir

logger = logging.getLogger("vllm_onlinespec")


@dataclass
class LearningSide:
    parts: Any  # learner.factory.LearnerParts, or None: learning off, or a rank that follows
    head: nn.Module | None  # the length head the cutter predicts with
    head_trusted: bool  # whether it came trained (a fresh head is not yet believed)


def build(cfg: OnlineSpecConfig, runner: Any, drafter_path: str, drafter_k: int,
          leader: bool) -> LearningSide:
    """Build the learner (learning on, rank 0) and pick the length head. Policy 'fixed' uses
    no head, so none is trained for it; `length_head.train = false` keeps a shipped head
    frozen."""
    wants_head = cfg.length_head.policy != "fixed"
    if not cfg.enabled:
        head = checkpoint_head(drafter_path) if wants_head else None
        return LearningSide(None, head, wants_head)
    from vllm_onlinespec.learner.device import module_device, resolve_device
    from vllm_onlinespec.learner.factory import build_learner

    embed, lm_head = compat.target_embed_and_head(runner)  # every rank: a collective
    if not leader:
        # Other ranks only follow rank 0's publishes; their head refreshes from them.
        head = checkpoint_head(drafter_path) if wants_head else None
        return LearningSide(None, head, head is not None)
    # "auto": the learner lives where vLLM's drafter does (publishing stays on-device).
    device = resolve_device(cfg.learner_device,
                            module_device(compat.drafter_module(runner)) or lm_head.device)
    # A head learning from real verification (head_lr > 0) is the cutter's to train.
    from_verification = cfg.length_head.head_lr > 0
    parts = build_learner(cfg, drafter_path, embed, lm_head, drafter_k,
                          train_length_head=(wants_head and cfg.length_head.train
                                             and not from_verification),
                          device=device)
    fp = parts.footprint
    logger.info("onlinespec: %s", fp.describe(parts.learner.device))
    # Not guarded: a learner that cannot fit stops start-up, with the numbers.
    check_fits(fp, parts.learner.device,
               compat.gpu_memory_utilization(getattr(runner, "vllm_config", None)))
    if not wants_head:
        return LearningSide(parts, None, False)
    trained = parts.bundle.length_head
    if trained is not None:  # trusted only if it came trained
        return LearningSide(parts, trained, parts.checkpoint_head is not None)
    if parts.checkpoint_head is None and from_verification and cfg.length_head.train:
        from vllm_onlinespec.drafter import LengthHead

        return LearningSide(parts, LengthHead(parts.config.hidden_size), False)
    return LearningSide(parts, parts.checkpoint_head, True)


def checkpoint_head(path: str) -> nn.Module | None:
    from vllm_onlinespec.drafter import load_drafter

    try:
        return load_drafter(path, dtype=torch.float32)[2]
    except Exception as e:  # noqa: BLE001 - no head: the policy says so in its reasons
        logger.warning("onlinespec: no length head (%s); verify policy uses population "
                       "estimates", e)
        return None


def feature_log(cfg: OnlineSpecConfig, runner: Any):
    """The served tokens' features, logged for offline training (config `features`)."""
    fcfg = cfg.features
    if not fcfg.dir:
        return None
    from vllm_onlinespec.drafter.checkpoint import load_drafter_config
    from vllm_onlinespec.training.feature_log import FeatureLogWriter

    dcfg = load_drafter_config(drafter_dir(runner.vllm_config, cfg))
    hidden = compat.target_hidden_size(runner.vllm_config)
    logger.info("onlinespec: logging target features (layers %s) to %s",
                dcfg.target_layer_ids, fcfg.dir)
    return FeatureLogWriter(fcfg.dir, list(dcfg.target_layer_ids), hidden, fcfg.flush_tokens)


def resume(learner: Any, checkpoint_dir: str) -> tuple[str, tuple[int, Any]] | None:
    """(checkpoint path, the learner's newest (version, snapshot)) after loading the newest
    usable checkpoint; None for a fresh start (one warning): the server comes up either way."""
    from vllm_onlinespec.learner.resume import resume_or_fresh

    r = resume_or_fresh(learner, checkpoint_dir)
    if r.path is None:
        return None
    logger.info("onlinespec: resumed drafter version %d from %s", r.version, r.path)
    return str(r.path), learner.latest()
