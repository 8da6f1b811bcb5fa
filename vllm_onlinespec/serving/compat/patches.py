"""Process-wide changes to vLLM, and which process gets which (vLLM 0.32.0).

The general plugin calls `apply_patches()` in every vLLM process. What it installs there:

  logging        our records go to vLLM's handlers                          every process
  CPU sampling   cpu_defects.py, via the platform's kernel-override hook     every engine on CPU
  DFlash k-norm  per-layer context-key norm (design §5.1)                   every engine on CPU
  EngineArgs     worker selection, start-up validation, Intel OpenMP,       every process, but a
                 V1 runner, no async scheduling (engine_args.py)             pass-through unless the
                                                                             engine asks for onlinespec

The first three are vLLM correctness fixes that any user of a DFlash or sampling engine on CPU
needs, so they stay on for everyone. The k-norm fix and the EngineArgs hook wait for the module
they change to be imported (`after_import`): importing vLLM's model modules and arg_utils in the
plugin cost every vLLM process ~7 s on a 2-vCPU box, mostly in processes that never use them. The EngineArgs hook has to see every engine's arguments to
notice `additional_config["onlinespec"]`, and changes nothing for the others. The Linear
plain-weights patch only matters to an engine that republishes draft weights, so it is installed
by our runner (`drafter.wrap_drafter_load`) in SpecDecodeWorker processes only.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any, Callable

import torch

from vllm_onlinespec.serving.compat import engine_args
from vllm_onlinespec.serving.compat import vllm_config as vc

logger = logging.getLogger("vllm_onlinespec")
_patched = False


def apply_patches() -> None:
    """Idempotent; cheap until vLLM's model modules are imported by vLLM itself."""
    global _patched
    if _patched:
        return
    _patched = True
    share_vllm_logging()
    _fix_cpu_sampling_defects()
    _fix_dflash_grouped_k_norm()
    _select_worker_and_validate_config()


class _ToVllmLogger(logging.Handler):
    """Hands our records to the `vllm` logger at emit time: vLLM configures its handlers late
    (logger.py:289), after this plugin has run."""

    def emit(self, record: logging.LogRecord) -> None:
        # vLLM's handlers directly, not the `vllm` logger: no second trip up to the root.
        for h in logging.getLogger("vllm").handlers:
            if record.levelno >= h.level:
                h.handle(record)


def share_vllm_logging() -> None:
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


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `fn(module)` right after the module `name` has been executed, whoever imports it
    and whenever: the finders after this one find it, and its loader's exec_module is wrapped."""

    def __init__(self, name: str, fn: Callable[[Any], None]) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run, fn = spec.loader.exec_module, self.fn

                def exec_module(module: Any) -> None:
                    run(module)
                    fn(module)

                spec.loader.exec_module = exec_module  # this module's own loader instance
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                return spec
        return None


def after_import(name: str, fn: Callable[[Any], None]) -> None:
    """fn(module) once `name` is imported: now if it already is, else right after its import."""
    if name in sys.modules:
        fn(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, fn))


DFLASH_MODULE = "vllm.model_executor.models.qwen3_dflash"


def _fix_dflash_grouped_k_norm() -> None:
    """qwen3_dflash.py:639 normalises all layers' context keys with one `ops.rms_norm` call and
    per-layer weights [L, hd]; the CPU op applies layer 0's weight to every layer (invisible with
    all-ones fresh weights, 0.75 % error with trained ones). Normalise one layer at a time.
    Installed when vLLM imports its DFlash model (a worker loading a DFlash drafter): importing
    it here would cost every vLLM process ~4.5 s of model-module imports on a 2-vCPU box."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        after_import(DFLASH_MODULE, _patch_k_norm)


def _patch_k_norm(qwen3_dflash: Any) -> None:
    ops = qwen3_dflash.ops

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = _normalize_context_k


def _select_worker_and_validate_config() -> None:
    """`additional_config={"onlinespec": {...}}` alone turns the worker on, and a bad config
    stops start-up in the calling process with one line naming the field, before any engine
    process is spawned (EngineArgs.create_engine_config, arg_utils.py:2205). Engines that do not
    ask for onlinespec get vLLM's config untouched. Installed when EngineArgs' module is
    imported (in the process that builds the engine's config; the engine core and workers,
    which never import it, are spared its ~2.8 s of imports)."""
    after_import("vllm.engine.arg_utils", _wrap_create_engine_config)


def _wrap_create_engine_config(arg_utils: Any) -> None:
    EngineArgs = arg_utils.EngineArgs
    if getattr(EngineArgs, "_onlinespec_wrapped", False):
        return
    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        requested = vc.ours_requested(self)
        if requested:
            for line in engine_args.prepare(self):  # runner, scheduling, parallelism
                _log_once(line)
            # Before vLLM's CPU platform picks an OpenMP runtime for the workers it will spawn.
            preload_intel_openmp()
        vllm_config = orig(self, *args, **kwargs)
        if not requested:
            return vllm_config
        engine_args.check(vllm_config)
        pc = vllm_config.parallel_config
        ours = pc.worker_cls in vc.WORKER_NAMES
        if "onlinespec" in vc.additional_config(vllm_config) and pc.worker_cls in vc.DEFAULT_WORKERS:
            pc.worker_cls, ours = vc.WORKER_QUALNAME, True
        if ours:
            from vllm_onlinespec.serving.validate import config_from_vllm, drafter_dir

            cfg = config_from_vllm(vllm_config)
            drafter_dir(vllm_config, cfg, allow_download=True)
            line = engine_args.piecewise_for_uneven_verify(
                vllm_config, engine_args.uneven_verify_reason(cfg))
            if line:
                _log_once(line)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._onlinespec_wrapped = True


_logged: set[str] = set()


def _log_once(line: str, key: str | None = None) -> None:
    """A process builds several engines in tests and benchmarks: say each decision once (per
    `key`: the second engine's "already preloaded" is the same decision as the first's)."""
    if (key or line) not in _logged:
        _logged.add(key or line)
        logger.info(line)


def preload_intel_openmp() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm_onlinespec.serving import openmp

    _log_once(openmp.apply_for_speculative_engine().line(), key="iomp")
