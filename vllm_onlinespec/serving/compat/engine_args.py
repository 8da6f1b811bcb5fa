"""What an onlinespec engine needs from vLLM's engine arguments, set or refused before vLLM
builds its config (EngineArgs.create_engine_config, arg_utils.py:2205), so a user's command
either gets a working engine or one line naming the flag, before any process is spawned.

    runner       V1 model runner: Model Runner V2 (vLLM 0.32's GPU default for dense models,
                 config/vllm.py:703) has none of the hooks we use (lab/design/mrv2_and_fleet.md)
    scheduling   no async scheduling: with it the host-side input ids of a step are placeholders
                 and take_draft_token_ids is skipped, so feedback would carry wrong labels and
                 the verify policy would never cut (the CPU platform turns it off itself)
    parallelism  tensor parallelism yes (one learner on rank 0, serving/tp_sync.py);
                 pipeline and data parallelism refused until designed
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm_onlinespec")
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_TRUE = ("1", "true", "yes", "on")


class EngineArgsError(ValueError):
    """One line naming the flag that an onlinespec engine cannot run with."""


def prepare(engine_args: Any) -> list[str]:
    """Adjust or refuse `engine_args` in place; returns the log lines of what was changed."""
    lines = []
    v2 = os.environ.get(V2_ENV)
    if v2 is not None and v2.strip().lower() in _TRUE:
        raise EngineArgsError(
            f"onlinespec: {V2_ENV}={v2} asks for Model Runner V2, which has no online-learning "
            f"hooks yet (lab/design/mrv2_and_fleet.md); unset {V2_ENV} or set it to 0")
    if v2 is None:
        # Environment, not a config field: vLLM reads it in this process (VllmConfig) and every
        # worker process inherits it; vllm.envs caches nothing until the engine core starts.
        os.environ[V2_ENV] = "0"
        lines.append(f"onlinespec: vLLM's V1 model runner selected ({V2_ENV}=0): Model Runner "
                     f"V2 has no online-learning hooks yet")

    if getattr(engine_args, "async_scheduling", None) is True:
        raise EngineArgsError(
            "onlinespec: --async-scheduling is not supported (a step's input ids are "
            "placeholders on the host and its drafts bypass the verify-length policy); "
            "use --no-async-scheduling or leave it unset")
    if getattr(engine_args, "async_scheduling", None) is None:
        engine_args.async_scheduling = False  # vLLM would turn it on for DFlash (config/vllm.py:1585)

    for flag, field in (("--pipeline-parallel-size", "pipeline_parallel_size"),
                        ("--data-parallel-size", "data_parallel_size")):
        n = int(getattr(engine_args, field, 1) or 1)
        if n > 1:
            raise EngineArgsError(
                f"onlinespec: {flag} {n} is not supported yet (tensor parallelism is: one "
                f"learner on rank 0 publishing to every rank); use {flag} 1")
    return lines


def check(vllm_config: Any) -> None:
    """After vLLM built its config: what it decided on its own must still suit us."""
    sched = getattr(vllm_config, "scheduler_config", None)
    if getattr(sched, "async_scheduling", False):
        raise EngineArgsError("onlinespec: vLLM enabled async scheduling for this engine; "
                              "pass --no-async-scheduling")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise EngineArgsError(f"onlinespec: vLLM chose Model Runner V2 for this engine (a "
                              f"feature that requires it?); online learning needs the V1 "
                              f"runner ({V2_ENV}=0)")


def uneven_verify_reason(cfg: Any) -> str | None:
    """Why an onlinespec config makes the target verify a different number of draft tokens per
    request or step (None: it never does)."""
    why = []
    if cfg.length_head.policy != "fixed":
        why.append(f"the {cfg.length_head.policy} policy cuts drafts")
    if cfg.prompt_lookup.enabled:
        why.append("prompt lookup drafts lengths of its own")
    return " and ".join(why) or None


def piecewise_for_uneven_verify(vllm_config: Any, reason: str | None) -> str | None:
    """Full CUDA graphs of the target step assume one verify shape; cut drafts make uneven
    batches. vLLM switches its own dynamic speculative decoding to piecewise graphs for that
    (VllmConfig._maybe_override_dynamic_sd_cudagraph_mode, config/vllm.py); the same here.
    Returns the log line when it changed the mode."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if reason is None or mode is None or not mode.has_full_cudagraphs():
        return None
    from vllm.config import CUDAGraphMode

    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    return (f"onlinespec: cudagraph_mode {mode.name} -> PIECEWISE: {reason}, so verify batches "
            f"are uneven (vLLM does the same for its own dynamic speculative decoding)")
