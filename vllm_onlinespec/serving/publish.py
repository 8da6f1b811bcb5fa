"""Publishing: the learner's newest snapshot -> vLLM's drafter, in place, between engine steps."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving.step_timer import StepTimer

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
        self._timer = StepTimer()  # CUDA events on a GPU: load_weights only queues copies there

    def publish(self, latest: tuple[int, Mapping[str, torch.Tensor]]) -> bool:
        version, snapshot = latest
        if version <= self.version:
            return False
        # On CUDA the snapshot was copied on the learner's stream: order this (serving) stream
        # after that copy before load_weights reads it. No-op for CPU snapshots.
        wait_ready = getattr(snapshot, "wait_ready", None)
        self._timer.poll()  # earlier publishes' GPU time, now measured
        span = self._timer.start()
        if wait_ready is not None:
            wait_ready()
        named = [(k[len(DRAFTER_PREFIX):], v) for k, v in snapshot.items()
                 if k.startswith(DRAFTER_PREFIX)]
        compat.load_draft_weights(self.runner, named)
        if self.repack:
            compat.repack_drafter_linears(self.runner)
        self.count += 1
        was, self.version = self.version, version
        self._timer.stop(span, lambda sec: self._measured(version, was, sec))
        return True

    def _measured(self, version: int, was: int, seconds: float) -> None:
        self.last_ms = seconds * 1e3
        self.total_ms += self.last_ms
        logger.info("onlinespec: published drafter version %d (was %d) in %.1f ms",
                    version, was, self.last_ms)


class RankShare:
    """Under tensor parallelism rank 0 learns; its newest version reaches every rank at the
    same step (every rank calls `share` once per step: a collective)."""

    def __init__(self, tp: Any, leader: bool) -> None:
        self.tp, self.leader = tp, leader
        self.shared = 0  # the newest version broadcast to every rank

    def share(self, latest: tuple[int, Any] | None) -> tuple[int, Any] | None:
        """(version, snapshot) where rank 0's newest is new to the ranks, else None."""
        # Compared with the version last shared, which every rank holds alike (a rank-local
        # figure, e.g. rank 0's resumed publish, would let the ranks disagree and hang).
        shared = self.shared
        version = compat.broadcast_version(self.tp, latest[0] if latest is not None else shared)
        if version <= shared:
            return None
        self.shared = version
        snap = latest[1] if self.leader else None
        if snap is not None and hasattr(snap, "wait_ready"):
            snap.wait_ready()  # a CUDA snapshot's copy ends before the broadcast reads it
        return version, compat.broadcast_snapshot(self.tp, snap)


def served_digest(runner: Any, learning: bool) -> str:
    """sha256 of vLLM's drafter weights as loaded, read back from vLLM's module under
    checkpoint names (compare with `state_digest` of a checkpoint's `drafter.*` tensors)."""
    from vllm_onlinespec.learner.checkpoint import state_digest

    # Only a learning engine's drafter is republished (and so kept in plain, readable
    # weights); without a learner there is nothing a publish could have got wrong.
    if not learning or compat.drafter_module(runner) is None:
        return ""
    return state_digest(compat.read_draft_weights(runner))
