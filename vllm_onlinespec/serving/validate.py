"""Start-up validation of an onlinespec engine: one line naming the field, before any engine
process is spawned (called from the EngineArgs hook in compat/patches.py and by the session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.serving.compat import vllm_config as vc


def config_from_vllm(vllm_config: Any) -> OnlineSpecConfig:
    """Validate `additional_config["onlinespec"]`; raises ConfigError (one line) when bad.

    K (num_speculative_tokens) is not compared with the drafter's block_size: vLLM runs a DFlash
    drafter with any K, and the learner trains the K positions vLLM serves
    (learner/factory.py)."""
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
