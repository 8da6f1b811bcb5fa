"""`vllm_onlinespec.SpecDecodeWorker`: vLLM's CPU or GPU worker with the online-learning runner.

Select it with `--worker-cls vllm_onlinespec.SpecDecodeWorker` (or `LLM(worker_cls=...)`) and
configure it with `--additional-config '{"onlinespec": {...}}'`.
"""

from __future__ import annotations

from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving.runner import runner_class

_Base = compat.base_worker_class()


class SpecDecodeWorker(_Base):  # type: ignore[misc, valid-type]
    """A worker whose model runner feeds verification feedback to an online learner."""

    def init_device(self):
        runner_cls = runner_class(compat.base_runner_class())
        if compat.is_cpu():
            with compat.cpu_worker_builds(runner_cls):
                return super().init_device()
        return super().init_device()

    def _make_model_runner(self):  # GPU worker hook (gpu_worker.py:563)
        if getattr(self, "use_v2_model_runner", False):  # gpu_worker.py:237, from VllmConfig
            # The EngineArgs hook selects V1 for every engine that asks for onlinespec; only a
            # worker_cls given without `additional_config` can get here with V2.
            raise RuntimeError("vllm_onlinespec.SpecDecodeWorker needs vLLM's V1 model runner; "
                               "set VLLM_USE_V2_MODEL_RUNNER=0")
        return runner_class(compat.base_runner_class())(self.vllm_config, self.device)

    def _session(self):
        """The model runner's OnlineSession, or None (no onlinespec runner, or not built yet)."""
        return getattr(getattr(self, "model_runner", None), "_onlinespec", None)

    def compile_or_warm_up_model(self, *args, **kwargs):
        out = super().compile_or_warm_up_model(*args, **kwargs)
        runner = getattr(self, "model_runner", None)
        session = getattr(runner, "_onlinespec", None)
        if session is not None:  # compiled, KV cache allocated, CUDA graphs captured: price
            session.warmed_up(runner)  # a step, then start the learner thread
        return out

    def onlinespec_stats(self) -> dict:
        """Learner, buffer, publishing, cutter and hook figures: `OnlineSpecStats.to_dict()`
        (a plain dict crosses the RPC boundary; read it back with
        `vllm_onlinespec.serving.stats.OnlineSpecStats.from_dict` or `stats.fetch(llm)`)."""
        session = self._session()
        return session.stats().to_dict() if session is not None else {}

    def onlinespec_step_profile(self) -> dict:
        """Accumulated per-phase worker time (serving/step_profile.py) and per-step means."""
        runner = getattr(self, "model_runner", None)
        prof = runner.onlinespec_profile() if hasattr(runner, "onlinespec_profile") else None
        if prof is None:
            return {}
        return {**prof.as_dict(), "per_step_ms": prof.per_step_ms()}

    def onlinespec_flush_features(self) -> int:
        """Write the feature log's pending rows (config `features.dir`); rows logged so far."""
        session = self._session()
        return session.flush_features() if session is not None else 0

    def onlinespec_idle(self, seconds: float) -> dict:
        """The engine idles (e.g. between RL rollout rounds): let the learner train at full share
        for at most `seconds`, back early once it has caught up. {"seconds", "updates"}."""
        session = self._session()
        return session.idle(float(seconds)) if session is not None else {"seconds": 0.0, "updates": 0}

    def onlinespec_defects(self) -> str:
        """The start-up line of cpu_defects: which vLLM-CPU sampling defects were patched here."""
        from vllm_onlinespec.serving import cpu_defects

        report = cpu_defects.LAST_REPORT
        return report.line() if report is not None else "onlinespec: defect probes did not run"

    def onlinespec_digest(self) -> str:
        """sha256 of vLLM's drafter weights as loaded (read back from vLLM's module), to check
        resumes and publishes against a checkpoint's `drafter.*` tensors."""
        session = self._session()
        return session.digest() if session is not None else ""

    def onlinespec_swap_target(self, path: str) -> dict:
        """Replace the target's weights by the HF folder `path` in place (vLLM's
        reload_weights), with the learner following (serving/target_swap.py). A folder that
        does not fit is one line and nothing changes."""
        from vllm_onlinespec.serving.target_swap import check_swap

        check_swap(compat.served_hf_config(self.vllm_config), path)
        runner = getattr(self, "model_runner", None)
        session = getattr(runner, "_onlinespec", None)
        reload = lambda: self.reload_weights(weights_path=path)  # noqa: E731 - vLLM's own path
        if session is None:
            reload()
            return {"seconds": None, "dropped_tokens": 0, "swaps": None}
        return session.swap_target(runner, reload)

    def onlinespec_push_target(self, weights: bytes | dict) -> dict:
        """Replace the target's weights by `weights` (a safetensors buffer, or a dict, of HF
        checkpoint names to tensors, every weight) in place through vLLM's reload_weights, with
        the learner following. A push that does not fit is one line and nothing changes
        (serving/target_swap.check_push)."""
        from vllm_onlinespec.serving.target_swap import check_push, unpack_push

        items = check_push(compat.served_hf_config(self.vllm_config), unpack_push(weights))
        runner = getattr(self, "model_runner", None)
        session = getattr(runner, "_onlinespec", None)
        reload = lambda: self.reload_weights(weights_iterator=iter(items))  # noqa: E731
        if session is None:
            reload()
            return {"seconds": None, "dropped_tokens": 0, "swaps": None}
        return session.swap_target(runner, reload)

    # vLLM's weight-transfer engine (start_weight_update, update_weights chunks,
    # finish_weight_update): the NCCL / CUDA-IPC path RL frameworks push a new policy through.
    def finish_weight_update(self, *args, **kwargs) -> None:
        """Once the target's new weights are in, the learner follows as after a swap (paused for
        the finish, the new embedding and LM head read, the old target's feedback dropped)."""
        session = self._session()
        finish = lambda: super(SpecDecodeWorker, self).finish_weight_update(*args, **kwargs)  # noqa: E731
        if session is None or getattr(self, "_weight_update_is_draft", False):
            return finish()
        session.swap_target(self.model_runner, finish)
        return None

    def start_draft_weight_update(self, *args, **kwargs) -> None:
        """Refused while the learner trains the drafter: its next publish would overwrite the
        pushed weights."""
        session = self._session()
        if session is not None and session.cfg.enabled:
            raise RuntimeError("onlinespec: the online learner owns the drafter's weights; push "
                               "drafter weights with learning off (onlinespec.enabled = false)")
        return super().start_draft_weight_update(*args, **kwargs)

    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)
        if runner is not None and hasattr(runner, "shutdown_onlinespec"):
            runner.shutdown_onlinespec()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()
