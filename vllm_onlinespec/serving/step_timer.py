"""Timing the spans of an engine step the budget prices (target + verification, drafter).

On CPU a span is its host time. On a GPU the host returns before the kernels it queued have
run, so a host clock would price the launch, not the work: each span records two CUDA events on
vLLM's current stream and is read once its end event has completed, normally by the next step
(`poll`, never a wait). A span still pending after `max_pending` later spans is dropped rather
than waited for.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import torch

MAX_PENDING = 64


class StepTimer:
    def __init__(self, cuda: bool | None = None) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._pending: deque[tuple[Any, Any, Callable[[float], None]]] = deque()
        self.dropped = 0

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, started: Any, on_seconds: Callable[[float], None]) -> None:
        """Deliver the span's seconds to on_seconds: now on CPU, once measured on a GPU."""
        if not self.cuda:
            on_seconds(time.perf_counter() - started)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((started, end, on_seconds))
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1

    def poll(self) -> None:
        """Deliver every finished GPU span, oldest first (stops at the first unfinished one)."""
        while self._pending and self._pending[0][1].query():
            start, end, cb = self._pending.popleft()
            cb(start.elapsed_time(end) / 1e3)
