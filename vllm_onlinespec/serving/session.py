"""One online-speculation session per worker: it only wires the stages of the data path.

    serving/learner_setup.py  the learner (learner/factory.py), its memory check, the length
                              head the cutter predicts with, the feature log, a resume
    serving/drafting.py       the budget's gate before vLLM's drafter; each draft cut to the
                              verify-length policy (policy/cutter.py) or the lookup's
                              (serving/lookup.py) where it pays
    serving/feedback.py       one step's verification -> the policy's statistics, the feature
                              log and the learner's buffer
    serving/publish.py        the learner's newest snapshot -> vLLM's drafter, between steps
                              (under TP from rank 0 to every rank)
    serving/stats.py          the figures -> serving/metrics.py, a file the API server exports
    serving/guard.py          every hook's failures and silent skips, counted

The serving thread only ever does cheap things here (clone feedback rows into the buffer, swap
in the newest published weights, cut drafts); the learner thread does the training. That thread
starts only once vLLM's `compile_or_warm_up_model` returned (`warmed_up`, called by the worker):
the session is built inside `load_model`, before vLLM profiles memory and captures its CUDA
graphs, and a CUDA call from another thread while a graph is being captured breaks the capture.
Nothing that goes wrong on the learning side may reach the serving path: each stage runs under
its own guard, so a stage that fails every step still leaves the others working.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.policy.cutter import DraftCutter
from vllm_onlinespec.serving import compat, learner_setup
from vllm_onlinespec.serving import guard as G
from vllm_onlinespec.serving.drafting import DraftStage, probe_step_cost
from vllm_onlinespec.serving.feedback import FeedbackStage
from vllm_onlinespec.serving.guard import HookGuard
from vllm_onlinespec.serving.lookup import LookupStage
from vllm_onlinespec.serving.metrics import MetricsWriter
from vllm_onlinespec.serving.publish import Publisher, RankShare, served_digest
from vllm_onlinespec.serving.stats import OnlineSpecStats, session_info, session_stats
from vllm_onlinespec.serving.target_swap import follow_swap
from vllm_onlinespec.serving.trace import DraftTracer
from vllm_onlinespec.serving.validate import config_from_vllm, drafter_dir, drafter_tokens

logger = logging.getLogger("vllm_onlinespec")


class OnlineSession:
    def __init__(self, runner: Any, cfg: OnlineSpecConfig, guard: HookGuard | None = None) -> None:
        self.cfg, self.runner = cfg, runner
        self.guard = guard or HookGuard()
        self.K = compat.num_speculative_tokens(runner.vllm_config)
        self.steps = 0
        self.target_swaps = 0  # in-flight swaps of the target's weights (serving/target_swap.py)
        # Under TP: rank 0 learns and publishes to every rank (compat/parallel.py).
        self.tp = compat.tp_group()
        self.leader = compat.tp_rank(self.tp) == 0
        self.ranks = RankShare(self.tp, self.leader)
        self.publisher = Publisher(runner, repack=cfg.publish.repack)  # CPU only; frozen: once
        self.tracer = DraftTracer.maybe(cfg, runner, self.guard) if self.leader else None
        feature_log = learner_setup.feature_log(cfg, runner) if self.leader else None
        self.metrics = MetricsWriter()
        self.oracle = None
        if cfg.oracle.accept_len is not None:
            from vllm_onlinespec.serving.oracle import OracleVerifier

            self.oracle = OracleVerifier(cfg.oracle.accept_len, self.K, cfg.oracle.seed)
        self.resumed_from: str | None = None
        self._drafted_by = 0  # the drafter version that proposed what the next step verifies
        # Serving idles when no step ran for pacing.idle_after_s: the learner's idle probe.
        self._in_step, self._last_step = False, time.monotonic()
        drafter_path = str(drafter_dir(runner.vllm_config, cfg))  # a hub id: vLLM's snapshot
        # The drafter's own draft length; K above it is room for lookup drafts only.
        self.drafter_k = drafter_tokens(cfg, drafter_path, self.K)
        self.lookup = (LookupStage(cfg.prompt_lookup, self.K, self.drafter_k)
                       if cfg.prompt_lookup.enabled else None)
        side = learner_setup.build(cfg, runner, drafter_path, self.drafter_k, self.leader)
        self.parts = side.parts
        self.cutter = DraftCutter(cfg.length_head, self.drafter_k, head=side.head,
                                  head_trusted=side.head_trusted, on_skip=self.guard.skip,
                                  lookup=self.lookup is not None)
        self.drafting = DraftStage(cfg, runner, self.cutter, self.lookup, self.drafter_k, self.K,
                                   self.guard, tp=self.tp)
        self.feedback = FeedbackStage(self.cutter, self.lookup, self.tracer, feature_log,
                                      self.learner, self.buffer, self.guard)
        if self.cutter.needs_hidden and not compat.wrap_draft_sampler(runner, self.observe_draft_hidden):
            self.guard.skip(G.NO_DRAFT_SAMPLER)
            logger.warning("onlinespec: vLLM's drafter has no _sample_draft_tokens to read hidden "
                           "states from; the length head is not consulted")
        if self.cutter.needs_confidence and not compat.wrap_draft_confidence(
                runner, self.observe_draft_confidence):
            raise ValueError("length_head.estimator 'confidence': this vLLM drafter computes no "
                             "full draft logits to read its top-1 probabilities from; use "
                             "estimator 'head'")
        if self.learner is not None:
            resumed = learner_setup.resume(self.learner, cfg.checkpoint.dir) if cfg.checkpoint.dir else None
            if resumed is not None:
                self.resumed_from, latest = resumed
                self.publisher.publish(latest)
                self.cutter.refresh(latest[1], latest[0])
                self._drafted_by = self.publisher.version
            self._start_pending = True  # warmed_up() starts it, after vLLM's graph capture
            if cfg.pacing.idle_after_s is not None:
                self.learner.idle_probe = self.serving_idle
        logger.info("onlinespec: worker ready (learning=%s, algorithm=%s, K=%d); %s",
                    cfg.enabled, cfg.update.algorithm, self.K, self.cutter.describe())

    @classmethod
    def start(cls, runner: Any, guard: HookGuard | None = None) -> "OnlineSession":
        return cls(runner, config_from_vllm(runner.vllm_config), guard)

    _start_pending = False  # a learner waits for vLLM's warm-up to end (see warmed_up)

    def warmed_up(self, runner: Any) -> None:
        """vLLM's compile_or_warm_up_model returned (memory profiled, KV cache allocated, CUDA
        graphs captured): price a step, then start the learner thread."""
        self.probe_step_cost(runner)
        self.start_learning()

    def start_learning(self) -> None:
        if self._start_pending:
            self._start_pending = False
            self.learner.start()

    learner = property(lambda self: self.parts.learner if self.parts is not None else None)
    buffer = property(lambda self: self.parts.buffer if self.parts is not None else None)
    feature_log = property(lambda self: self.feedback.feature_log)

    @property
    def wants_feedback(self) -> bool:
        """A learner, a tracer, or a verify policy that keeps acceptance statistics (every
        policy but 'fixed', learning on or off) needs each step's verification."""
        return (self.learner is not None or self.tracer is not None or self.lookup is not None
                or self.feature_log is not None or self.cutter.policy_name != "fixed")

    # -- every engine step (the runner guards each call) ------------------------------------------
    def probe_step_cost(self, runner: Any) -> None:
        probe_step_cost(self.cutter.cost_model, runner)

    def force_oracle(self, sampled: Any, logits: Any, metadata: Any) -> None:
        """Benchmark-only: rewrite the sampler's accepted lengths (serving/oracle.py)."""
        if self.oracle is not None and metadata is not None:
            self.oracle.force(sampled, logits, metadata)

    def capture(self, runner: Any) -> compat.StepView | None:
        if not self.wants_feedback:
            return None
        view = compat.step_view(runner)
        if view is None:
            self.guard.skip(G.NO_STEP_VIEW)
        return view

    def gate_drafting(self, scheduler_output: Any, sampled: Any = None) -> tuple[Any, int] | None:
        return self.drafting.gate(scheduler_output, sampled)

    def cut_drafts(self, drafts: Any) -> Any:
        return self.drafting.cut(drafts)

    def observe_draft_hidden(self, hidden: torch.Tensor) -> None:
        """Called inside vLLM's drafter, right before it samples: must never raise."""
        with self.guard(G.DRAFT_HIDDEN):
            self.cutter.observe_hidden(hidden)

    def observe_draft_confidence(self, conf: torch.Tensor) -> None:
        """Called inside vLLM's drafter, right after its logits: must never raise."""
        with self.guard(G.DRAFT_CONFIDENCE):
            self.cutter.observe_confidence(conf)

    def step_began(self) -> None:
        """An engine step starts (execute_model): serving is not idle."""
        self._in_step, self._last_step = True, time.monotonic()

    def learner_busy(self) -> bool | None:
        """Whether the learner is inside an update now (None: no learner)."""
        ln = self.learner
        return None if ln is None else bool(ln.in_update)

    def serving_idle(self) -> bool:
        """No engine step ran or is running for pacing.idle_after_s seconds (a server between
        requests, an RL engine between rounds): the learner may take every core then."""
        after = self.cfg.pacing.idle_after_s
        return (after is not None and not self._in_step
                and time.monotonic() - self._last_step > after)

    def after_step(self, runner: Any, view: compat.StepView | None, sampled: Any) -> None:
        """Feedback, publish and metrics, each under its own guard."""
        self._in_step, self._last_step = False, time.monotonic()
        self.steps += 1
        self.start_learning()  # a worker that skipped vLLM's warm-up (elastic EP): now, after it
        verified_by, self._drafted_by = self._drafted_by, self.publisher.version
        with self.guard(G.FEEDBACK):
            self.feedback.observe(view, sampled, verified_by)
        with self.guard(G.PUBLISH):
            self._publish()
        with self.guard(G.METRICS):
            self._write_metrics()

    def _publish(self) -> None:
        if not self.cfg.enabled:
            return
        latest = self.learner.latest() if self.learner is not None else None  # once: the
        if self.tp is not None:  # head refresh sees what vLLM got
            latest = self.ranks.share(latest)
        if latest is not None and self.publisher.publish(latest):
            self.cutter.refresh(latest[1], latest[0])

    def _write_metrics(self) -> None:
        if self.leader and self.metrics.due():  # one file per engine: rank 0's (it learns)
            self.metrics.write(self.stats(), self.info())

    # -- reading ----------------------------------------------------------------------------------
    def stats(self) -> OnlineSpecStats:
        return session_stats(self)

    def digest(self) -> str:
        return served_digest(self.runner, self.cfg.enabled)

    def info(self) -> dict[str, str]:
        return session_info(self)

    def swap_target(self, runner: Any, reload: Callable[[], None]) -> dict:
        return follow_swap(self, runner, reload)

    def idle(self, seconds: float) -> dict[str, float]:
        """Serving idles for `seconds`: the learner trains at full share meanwhile (returns
        early once caught up); {"seconds": 0, "updates": 0} without a learner."""
        if self.learner is None:
            return {"seconds": 0.0, "updates": 0}
        return self.learner.unthrottled(seconds)

    def flush_features(self) -> int:
        """Write the feature log's pending rows now; the rows logged so far (0 when off)."""
        if self.feature_log is None:
            return 0
        self.feature_log.flush()
        return self.feature_log.rows_written

    def close(self) -> None:
        def attempt(what: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - shutting down: say so, never raise
                logger.warning("onlinespec: %s at shutdown failed: %s", what, e)

        attempt("last step's feedback", lambda: self.feedback.deliver(self.feedback.pipe.flush()))
        if self.feature_log is not None:
            attempt("feature log flush", self.feature_log.close)
        if self.learner is not None:
            self.learner.stop()
            if self.cfg.checkpoint.dir:
                attempt("final checkpoint", self.learner.save_checkpoint)


__all__ = ["OnlineSession", "config_from_vllm"]  # config_from_vllm: old import path
