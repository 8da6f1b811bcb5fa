"""Which CPU cores the learner thread runs on.

vLLM's CPU worker binds its process to the cores it computes on (OMP_PLACES, OMP_PROC_BIND and
the process affinity) and leaves the rest to its front end (VLLM_CPU_NUM_OF_RESERVED_CPU: one
core by default). A learner thread started inside the worker inherits that mask, so it would
time-share the serving core while the reserved one mostly idles: measured on the 2-core box,
serving then ran at ~55% of its speed. With `learner_cores: "auto"` the learner thread moves to
the online cores outside the worker's mask (the reserved ones), and stays put when there are
none (a GPU worker, or a CPU worker given every core). Only the calling thread is re-pinned.
"""

from __future__ import annotations

import logging
import os
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
