"""Start-up validation of an onlinespec engine: one line naming the field, before any engine
process is spawned (called from the EngineArgs hook in compat/patches.py and by the session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.serving.compat import vllm_config as vc


def config_from_vllm(vllm_config: Any) -> OnlineSpecConfig:
    """Validate `additional_config["onlinespec"]`; raises ConfigError (one line) when bad.

    K (num_speculative_tokens) may exceed the drafter's block: the drafter then drafts its own
    length (`drafter_tokens`) and K is room for lookup drafts (drafter_tokens below)."""
    cfg = OnlineSpecConfig.from_any(vc.additional_config(vllm_config).get("onlinespec"))
    method = vc.spec_method(vllm_config)
    if method != "dflash":
        raise ConfigError(
            f"onlinespec: vllm_onlinespec.SpecDecodeWorker needs --speculative-config with "
            f"method 'dflash' (got {method!r})")
    k = vc.num_speculative_tokens(vllm_config)
    if k < 1:
        raise ConfigError(f"onlinespec: num_speculative_tokens must be >= 1 (got {k})")
    if cfg.oracle.accept_len is not None and cfg.oracle.accept_len > k + 1:
        raise ConfigError(f"onlinespec.oracle.accept_len: must be <= num_speculative_tokens + 1 "
                          f"= {k + 1} (got {cfg.oracle.accept_len:g})")
    if cfg.prompt_lookup.enabled and vc.draft_sample_method(vllm_config) != "greedy":
        # The rejection sampler would weigh lookup's tokens by the drafter's probabilities of
        # other tokens: not the target's distribution any more.
        raise ConfigError(
            f"onlinespec.prompt_lookup: needs draft_sample_method 'greedy' in "
            f"--speculative-config (got {vc.draft_sample_method(vllm_config)!r}): the rejection "
            f"sampler reads the drafter's probabilities, which lookup's tokens do not have")
    if cfg.invariant_mode(vc.tensor_parallel_size(vllm_config)) != "off" and vc.logprobs_mode(vllm_config).startswith("processed"):
        raise ConfigError(
            f"onlinespec.sampling.invariant: needs a raw --logprobs-mode (got "
            f"{vc.logprobs_mode(vllm_config)!r}); set it to 'off' to keep processed logprobs")
    if cfg.sampling.invariant == "all" and vc.tensor_parallel_size(vllm_config) > 1:
        # An unseeded request's seed is drawn per process: ranks would sample different tokens.
        raise ConfigError(
            "onlinespec.sampling.invariant: 'all' is not supported with tensor parallelism "
            f"(--tensor-parallel-size {vc.tensor_parallel_size(vllm_config)}); use 'seeded'")
    if cfg.drafter_tokens is not None and cfg.drafter_tokens > k:
        raise ConfigError(f"onlinespec.drafter_tokens: must be <= num_speculative_tokens = {k} "
                          f"(got {cfg.drafter_tokens})")
    if cfg.prompt_lookup.enabled and cfg.prompt_lookup.source == "suffix_tree":
        from vllm_onlinespec.drafter.suffix_tree import suffix_cache_class

        try:
            suffix_cache_class()
        except ImportError as e:
            raise ConfigError(f"onlinespec.{e}") from None
    return cfg


def drafter_dir(vllm_config: Any, cfg: OnlineSpecConfig, allow_download: bool = False) -> Path:
    """The local folder of the drafter the learner reads: `onlinespec.drafter` if given, else
    vLLM's speculative model, a hub id resolved to the snapshot vLLM uses (same revision and
    download dir). The API-server process may download it (vLLM would, a moment later, into
    the same cache); workers only read the cache. Raises DrafterNotFound (one line)."""
    from vllm_onlinespec.drafter.source import DrafterNotFound, resolve_drafter_dir

    model, revision, download_dir = vc.draft_model_source(vllm_config)
    name = cfg.drafter or model
    if not name:
        raise DrafterNotFound("onlinespec: no drafter (--speculative-config has no model)")
    if cfg.drafter:  # ours, not vLLM's: vLLM's revision does not apply to it
        revision = None
    return resolve_drafter_dir(name, revision, download_dir, allow_download=allow_download)


def drafter_tokens(cfg: OnlineSpecConfig, drafter_path: str, K: int) -> int:
    """Draft tokens the DFlash drafter proposes per request and step: `cfg.drafter_tokens`, else
    the block it was trained for (block_size - 1; K where its config has none), at most K. The
    learner trains, and the length head predicts, these positions."""
    if cfg.drafter_tokens is not None:
        return min(cfg.drafter_tokens, K)
    try:
        from vllm_onlinespec.drafter.checkpoint import load_drafter_config

        block = load_drafter_config(drafter_path).block_size
    except (OSError, ValueError, KeyError):  # a folder without our config: vLLM's K decides
        return K
    return max(1, min(K, block - 1))
