"""vLLM's worker and runner classes, and the runner's warm-up path (vLLM 0.32.0)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterable, Iterator

import torch


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def base_worker_class() -> type:
    if is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def base_runner_class() -> type:
    if is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


@contextlib.contextmanager
def cpu_worker_builds(runner_cls: type) -> Iterator[None]:
    """CPUWorker.init_device builds its runner by the module-global name `CPUModelRunner`
    (cpu_worker.py:177); point that name at our subclass while it runs."""
    from vllm.v1.worker import cpu_worker

    saved = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = saved


def time_target_steps(runner: Any, sizes: Iterable[int], reps: int = 3) -> list[tuple[int, float]]:
    """(tokens, seconds) of target-only forward steps on dummy inputs, for the step cost model.

    Uses the runner's warm-up path (`_dummy_run`) with the drafter's own dummy pass switched off:
    the budget prices verify tokens, which cost target compute only. Sizes beyond the runner's
    token capacity are clipped. One untimed run per size first (allocator and kernel warm-up).
    """
    drafter = getattr(runner, "drafter", None)
    cap = int(getattr(runner, "max_num_tokens", 1 << 30))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out: list[tuple[int, float]] = []
    if drafter is not None:
        drafter.dummy_run = lambda *a, **k: None  # instance attribute shadows the method
    try:
        for n in sorted({max(1, min(int(n), cap)) for n in sizes}):
            runner._dummy_run(n)
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                runner._dummy_run(n)
                sync()
                out.append((n, time.perf_counter() - t0))
    finally:
        if drafter is not None:
            del drafter.dummy_run
    return out
