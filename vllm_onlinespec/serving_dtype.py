"""The dtype vLLM serves in when the user says `auto` (the default of every command here).

bfloat16 pays only where the hardware computes it natively: a GPU, or a CPU with AVX512-BF16 or
AMX tiles (measured 1.7x faster than float32 on such a box). Without them vLLM's CPU backend
(its AVX2 build) emulates bf16: on a 2-core AVX2-only AMD EPYC, plain decoding served 10.4 tok/s
in bfloat16 and 27.5 in float32 (docs/results/dtype.md). torch only; never imports vllm.
"""

from __future__ import annotations

import argparse

import torch

AUTO = "auto"
DTYPES = (AUTO, "bfloat16", "float32")


def cpu_native_bf16() -> bool:
    """True when this CPU computes bf16 matmuls in hardware: AVX512-BF16 or AMX tiles."""
    # The ISA probes vLLM's CPU platform itself uses (vllm/platforms/cpu.py).
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, p, lambda: False)()) for p in probes)


def native_bf16() -> bool:
    """True when bf16 matmuls run on hardware here: CUDA, or AVX512-BF16 / AMX on the CPU."""
    return torch.cuda.is_available() or cpu_native_bf16()


def resolve_dtype(dtype: str) -> str:
    """`auto` -> bfloat16 where native_bf16(), else float32; any other name unchanged."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if dtype != AUTO:
        return dtype
    return "bfloat16" if native_bf16() else "float32"


def resolve_dtype_arg(value: str) -> str:
    """argparse type of --dtype: the resolved dtype, so reports name what actually served."""
    try:
        return resolve_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
