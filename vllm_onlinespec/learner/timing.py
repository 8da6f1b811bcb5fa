"""Timing one span of learner work: CUDA events on a GPU, the host clock elsewhere.

On a GPU the learner's work is queued on its own stream, so a host clock around it measures
how long Python took to enqueue it; the events measure what the GPU spent. The stop
synchronises on the end event (the learner thread can afford the wait; serving never calls it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Timer:
    """`with Timer(device) as t: ...` then `t.ms`: milliseconds of the span (nan until it ends)."""

    device: torch.device
    ms: float = float("nan")
    _t0: float = field(default=0.0, repr=False)
    _events: tuple | None = field(default=None, repr=False)

    def __enter__(self) -> "Timer":
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()  # on the current stream: the learner's own inside its thread
            self._events = (start, end)
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._events is not None:
            start, end = self._events
            end.record()
            end.synchronize()
            self.ms = start.elapsed_time(end)
            self._events = None
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3
