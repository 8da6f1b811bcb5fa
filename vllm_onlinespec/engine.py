"""Engine arguments: what this project's CPU machines need, and nothing of it on a GPU."""

from __future__ import annotations

import os

# vLLM-on-CPU sizes its KV cache from RSS after a warm-up pass and often computes a negative
# budget on small machines; an explicit size is predictable and skips the warm-up.
DEFAULT_KV_CACHE_BYTES = int(os.environ.get("VLLM_ONLINESPEC_KV_BYTES", 1 << 30))
# The context a CPU engine is sized for (its KV cache above holds ~23k tokens of SmolLM2).
CPU_MAX_MODEL_LEN = 2048


def is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def engine_kwargs(**overrides) -> dict:
    """Keyword arguments for `vllm.LLM(...)`. On CPU: eager, a 2048-token context and an explicit
    KV cache. On GPU: CUDA graphs and the model's own context length, as plain `vllm serve`
    runs (a GPU benchmark in eager mode would measure launch overhead, not speculation); only
    the memory share is set, leaving room for the learner. Overrides win on both."""
    kw: dict = {"seed": 0}
    if is_cpu():
        kw.update(enforce_eager=True, max_model_len=CPU_MAX_MODEL_LEN,
                  kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES)
    else:
        kw["gpu_memory_utilization"] = 0.85
    kw.update(overrides)
    return kw


def serve_args(**overrides) -> list[str]:
    """The same defaults as `vllm serve` command-line flags."""
    out = []
    for k, v in engine_kwargs(**overrides).items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out
