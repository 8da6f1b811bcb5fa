"""Which CPU cores the learner thread runs on, and at which scheduling priority.

vLLM's CPU worker binds its process to the cores it computes on (OMP_PLACES, OMP_PROC_BIND and
the process affinity) and leaves the rest to its front end (VLLM_CPU_NUM_OF_RESERVED_CPU: one
core by default). A learner thread started inside the worker inherits that mask, so it would
time-share the serving core while the reserved one mostly idles: measured on the 2-core box,
serving then ran at ~55% of its speed. With `learner_cores: "auto"` the learner thread moves to
the online cores outside the worker's mask (the reserved ones), and stays put when there are
none (a GPU worker, or a CPU worker given every core). Only the calling thread is re-pinned.

The OpenMP runtime can undo that: vLLM preloads Intel OpenMP for its CPU workers with
KMP_AFFINITY=explicit,proclist=[serving cores], and iomp binds every thread to that list the
first time the thread calls into OpenMP (the learner's first GEMM), so a learner pinned before
its first update trains on the serving core after all (seen on the 2-core box: every thread of
the worker, the learner's included, allowed on core 0 only). `warm_openmp` makes that first
call before pinning, and `keep_pinned` re-applies the mask after each update if it moved.

Those reserved cores are not idle: vLLM's engine core (the scheduler, spinning on its workers'
queue) and the front end run there, and every engine step waits on them. `learner_priority:
"idle"` (SCHED_IDLE) lets every serving thread preempt the learner at once; beside the spinning
engine core it still trains (docs/results/learner_priority.md). On the serving core itself a
SCHED_IDLE learner starves: keep it pinned.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)


def _parse_cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def online_cpus() -> set[int]:
    try:
        with open("/sys/devices/system/cpu/online", encoding="ascii") as f:
            return _parse_cpu_list(f.read())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def learner_cpus(setting: str | Iterable[int], current: set[int], online: set[int]) -> set[int] | None:
    """The cores to pin the learner thread to, or None to leave it where it is."""
    if setting == "inherit":
        return None
    if setting == "auto":
        return (online - current) or None
    return set(setting)  # type: ignore[arg-type]


def warm_openmp() -> None:
    """Make this thread's first OpenMP call now (a small GEMM: MKL/oneDNN register the thread
    with the OpenMP runtime, which applies its affinity list), so that pinning comes after."""
    try:
        import torch

        a = torch.ones(64, 64)
        torch.mm(a, a)
    except Exception:  # noqa: BLE001 - warming is best effort; keep_pinned still checks
        pass


def keep_pinned(cpus: set[int] | None) -> bool:
    """Re-apply the learner's cores if something (an OpenMP runtime) moved the thread off
    them; True when it had moved."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        if os.sched_getaffinity(0) == cpus:
            return False
        os.sched_setaffinity(0, cpus)
        return True
    except OSError:
        return False


def pin_learner_thread(setting: str | Iterable[int]) -> set[int] | None:
    """Pin the calling thread per `setting`; returns the cores it now runs on (None = unchanged).
    Never raises: a refused mask (cpuset, non-Linux) leaves the thread where it was."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        current = os.sched_getaffinity(0)
        cpus = learner_cpus(setting, current, online_cpus())
        if cpus is None or cpus == current:
            return None
        os.sched_setaffinity(0, cpus)  # pid 0 = the calling thread only
        log.info("onlinespec: learner thread runs on cores %s (serving on %s)",
                 sorted(cpus), sorted(current))
        return cpus
    except (OSError, ValueError) as e:
        log.warning("onlinespec: could not move the learner thread (%s); it shares the serving "
                    "cores", e)
        return None


def lower_learner_priority(setting: str) -> str | None:
    """Lower the calling thread's scheduling priority: 'idle' (SCHED_IDLE), 'low' (nice 19) or
    'normal' (unchanged). Returns what was applied (None = unchanged). Never raises: a refused
    change (non-Linux, a seccomp profile) leaves the thread as it was, with one warning.
    Threads the learner starts later (OpenMP teams) inherit it."""
    if setting == "normal":
        return None
    try:
        if setting == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0 = this thread
            applied = "SCHED_IDLE"
        else:
            # setpriority on a thread id changes that thread only (Linux: threads are tasks).
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            applied = "nice 19"
        log.info("onlinespec: learner thread at %s (serving threads preempt it)", applied)
        return applied
    except (AttributeError, OSError) as e:
        log.warning("onlinespec: could not lower the learner thread's priority (%s); it "
                    "competes with serving at normal priority", e)
        return None
