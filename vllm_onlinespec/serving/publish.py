"""Publishing: the learner's newest snapshot -> vLLM's drafter, in place, between engine steps."""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import torch

from vllm_onlinespec.serving import compat

logger = logging.getLogger("vllm_onlinespec")
DRAFTER_PREFIX = "drafter."


class Publisher:
    """Tracks which learner version vLLM's drafter holds; swaps in newer ones."""

    def __init__(self, runner: Any, repack: bool = False) -> None:
        self.runner = runner
        self.repack = repack and compat.is_cpu()
        if self.repack:
            compat.repack_drafter_linears(runner)
        self.version = 0
        self.count = 0
        self.last_ms = float("nan")
        self.total_ms = 0.0

    def publish(self, latest: tuple[int, Mapping[str, torch.Tensor]]) -> bool:
        version, snapshot = latest
        if version <= self.version:
            return False
        # On CUDA the snapshot was copied on the learner's stream: order this (serving) stream
        # after that copy before load_weights reads it. No-op for CPU snapshots.
        wait_ready = getattr(snapshot, "wait_ready", None)
        t0 = time.perf_counter()
        if wait_ready is not None:
            wait_ready()
        named = [(k[len(DRAFTER_PREFIX):], v) for k, v in snapshot.items()
                 if k.startswith(DRAFTER_PREFIX)]
        compat.load_draft_weights(self.runner, named)
        if self.repack:
            compat.repack_drafter_linears(self.runner)
        self.last_ms = (time.perf_counter() - t0) * 1e3
        self.total_ms += self.last_ms
        self.count += 1
        logger.info("onlinespec: published drafter version %d (was %d) in %.1f ms",
                    version, self.version, self.last_ms)
        self.version = version
        return True
