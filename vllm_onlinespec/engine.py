"""Engine arguments: what this project's CPU machines need, and nothing of it on a GPU."""

from __future__ import annotations

import os

# vLLM-on-CPU sizes its KV cache from RSS after a warm-up pass and often computes a negative
# budget on small machines; an explicit size is predictable and skips the warm-up.
DEFAULT_KV_CACHE_BYTES = int(os.environ.get("VLLM_ONLINESPEC_KV_BYTES", 1 << 30))
# The context a CPU engine is sized for (its KV cache above holds ~23k tokens of SmolLM2).
CPU_MAX_MODEL_LEN = 2048


# What every engine built here runs with on a GPU, as an onlinespec engine must (compat/
# engine_args.py): vLLM's V1 model runner and synchronous scheduling. Plain vLLM picks Model
# Runner V2 and async scheduling for a dense model; a benchmark whose baseline ran those would
# mix a runner change into what speculation buys. (On CPU vLLM runs V1, synchronously, anyway.)
SAME_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def engine_kwargs(**overrides) -> dict:
    """Keyword arguments for `vllm.LLM(...)`. On CPU: eager, a 2048-token context and an explicit
    KV cache. On GPU: CUDA graphs and the model's own context length, as plain `vllm serve`
    runs (a GPU benchmark in eager mode would measure launch overhead, not speculation), the
    memory share, leaving room for the learner, and synchronous scheduling (SAME_RUNNER_ENV says
    why). Overrides win on both."""
    kw: dict = {"seed": 0}
    if is_cpu():
        kw.update(enforce_eager=True, max_model_len=CPU_MAX_MODEL_LEN,
                  kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES)
    else:
        kw["gpu_memory_utilization"] = 0.85
        kw["async_scheduling"] = False  # every arm as the onlinespec engine (SAME_RUNNER_ENV)
    kw.update(overrides)
    return kw


def serve_args(**overrides) -> list[str]:
    """The same defaults as `vllm serve` command-line flags."""
    out = []
    for k, v in engine_kwargs(**overrides).items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False and k == "async_scheduling":  # a BooleanOptionalAction flag
            out.append("--no-async-scheduling")
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out
