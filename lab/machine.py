"""The box a lab run measured on, as its pages state it: lscpu's CPU fields and the ISA that
decides the serving dtype (avx512_bf16 / amx_bf16 serve bfloat16; AVX2 alone, float32)."""

from __future__ import annotations

import subprocess


def box() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU family", "Model:", "CPU(s):", "Flags")
    lines = [ln for ln in out.splitlines() if ln.startswith(keep)]
    flags = next((ln for ln in lines if ln.startswith("Flags")), "")
    isa = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return "; ".join(ln.split(":", 1)[0].strip() + ": " + ln.split(":", 1)[1].strip()
                     for ln in lines if not ln.startswith("Flags")) + "; ISA: " + ",".join(isa)
