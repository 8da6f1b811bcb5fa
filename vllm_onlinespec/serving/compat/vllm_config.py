"""Reading vLLM's engine configuration (VllmConfig / EngineArgs attributes we rely on)."""

from __future__ import annotations

from typing import Any

WORKER_QUALNAME = "vllm_onlinespec.SpecDecodeWorker"
WORKER_NAMES = (WORKER_QUALNAME, "vllm_onlinespec.serving.worker.SpecDecodeWorker")
# What the platforms put in parallel_config.worker_cls when the user chose none (cpu.py:344).
DEFAULT_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker", "vllm.v1.worker.gpu_worker.Worker")


def additional_config(vllm_config: Any) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return dict(extra) if isinstance(extra, dict) else {}


def num_speculative_tokens(vllm_config: Any) -> int:
    """vLLM's K: draft tokens proposed per request per step (the only K vLLM 0.32 reads)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def target_hidden_size(vllm_config: Any) -> int:
    return int(vllm_config.model_config.get_hidden_size())


def served_hf_config(vllm_config: Any) -> dict:
    """The served target's HF config as a dict (what a swapped-in folder must match)."""
    return vllm_config.model_config.hf_config.to_dict()


def draft_model_path(vllm_config: Any) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    cfg = getattr(spec, "draft_model_config", None)
    return getattr(cfg, "model", None) if cfg is not None else None


def draft_model_source(vllm_config: Any) -> tuple[str | None, str | None, str | None]:
    """(model, revision, download_dir) of vLLM's drafter: how vLLM itself fetched its files."""
    spec = getattr(vllm_config, "speculative_config", None)
    cfg = getattr(spec, "draft_model_config", None)
    load = getattr(vllm_config, "load_config", None)
    return (getattr(cfg, "model", None), getattr(cfg, "revision", None),
            getattr(load, "download_dir", None))


def spec_method(vllm_config: Any) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "method", None) if spec is not None else None


def ours_requested(engine_args: Any) -> bool:
    """This project's speculative decoding, read from EngineArgs before the config is built."""
    extra = getattr(engine_args, "additional_config", None) or {}
    worker = getattr(engine_args, "worker_cls", None)
    return (isinstance(extra, dict) and "onlinespec" in extra) or worker in WORKER_NAMES



def draft_sample_method(vllm_config: Any) -> str:
    """'greedy' (vLLM's default: drafts are argmax, verified without draft probabilities) or
    'probabilistic' (the rejection sampler reads the drafter's probabilities)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return str(getattr(spec, "draft_sample_method", "greedy") or "greedy")


def tensor_parallel_size(vllm_config: Any) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
               or 1)


def logprobs_mode(vllm_config: Any) -> str:
    """vLLM's --logprobs-mode ('raw_logprobs' by default)."""
    model = getattr(vllm_config, "model_config", None)
    return str(getattr(model, "logprobs_mode", "raw_logprobs") or "raw_logprobs")


def gpu_memory_utilization(vllm_config: Any) -> float:
    """The share of the GPU vLLM budgets for itself (cache_config, default 0.9)."""
    return float(getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization",
                         0.9) or 0.9)
