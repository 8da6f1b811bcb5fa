"""vLLM general plugin: vLLM calls `register()` in every process it starts (API server, engine
core, workers), so process-wide fixes of vLLM internals are applied here. Must stay cheap."""

from __future__ import annotations


def register() -> None:
    from vllm_onlinespec.serving import compat, metrics

    compat.apply_patches()
    metrics.register_collector()
