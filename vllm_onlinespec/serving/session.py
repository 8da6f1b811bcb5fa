"""One online-speculation session per worker: it only wires the stages of the data path.

    learner/factory.py   the learner, its training copy of the drafter and its objective
    serving/feedback.py  one step's verification -> feedback records -> the learner's buffer
    serving/publish.py   the learner's newest snapshot -> vLLM's drafter, between steps
    policy/cutter.py     the length head -> the verify-length policy -> each cut draft
    serving/lookup.py    prompt lookup or a suffix tree beside the drafter: its draft where it pays
    serving/metrics.py   the figures (serving/stats.py) -> a file the API server exports
    serving/guard.py     every hook's failures and silent skips, counted

The serving thread only ever does cheap things here (clone feedback rows into the buffer, swap
in the newest published weights, cut drafts); the learner thread does the training. Nothing
that goes wrong on the learning side may reach the serving path: each stage runs under its own
guard, so a stage that fails every step still leaves the others working.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch
from torch import nn

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.learner.memory import check_fits
from vllm_onlinespec.serving.lookup import LookupStage
from vllm_onlinespec.policy.cutter import DraftCutter
from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving import guard as G
from vllm_onlinespec.serving.feedback import FeedbackPipe, StepFeedback, records_from_step
from vllm_onlinespec.serving.guard import HookGuard
from vllm_onlinespec.serving.metrics import MetricsWriter
from vllm_onlinespec.serving.publish import Publisher
from vllm_onlinespec.serving.stats import BufferStats, CutterStats, LearnerStats, OnlineSpecStats
from vllm_onlinespec.serving.trace import DraftTracer
from vllm_onlinespec.serving.validate import config_from_vllm, drafter_dir, drafter_tokens

logger = logging.getLogger("vllm_onlinespec")
# Token counts the start-up probe times: decode-sized to a full verify batch of a busy server.
PROBE_TOKENS = (1, 16, 64, 256)

__all__ = ["OnlineSession", "config_from_vllm"]  # config_from_vllm: old import path


class OnlineSession:
    feature_log = None  # training/feature_log.FeatureLogWriter when `features.dir` is set
    lookup = None  # serving.lookup.LookupStage when prompt lookup is on

    def __init__(self, runner: Any, cfg: OnlineSpecConfig, guard: HookGuard | None = None) -> None:
        self.cfg = cfg
        self.runner = runner
        self.guard = guard or HookGuard()
        self.K = compat.num_speculative_tokens(runner.vllm_config)
        self.steps = 0
        self.target_swaps = 0  # in-flight swaps of the target's weights (serving/target_swap.py)
        # Under TP: rank 0 learns and publishes to every rank (compat/parallel.py).
        self.tp = compat.tp_group()
        self.leader = compat.tp_rank(self.tp) == 0
        self._tp_shared = 0  # the newest version broadcast to every rank
        self.publisher = Publisher(runner, repack=cfg.publish.repack)  # CPU only; frozen: once
        self.tracer = DraftTracer.maybe(cfg, runner, self.guard) if self.leader else None
        self.feature_log = self._feature_log(runner) if self.leader else None
        self._pipe = FeedbackPipe()  # a step's feedback, held one step on GPU (feedback.py)
        self.metrics = MetricsWriter()
        self.oracle = None
        if cfg.oracle.accept_len is not None:
            from vllm_onlinespec.serving.oracle import OracleVerifier

            self.oracle = OracleVerifier(cfg.oracle.accept_len, self.K, cfg.oracle.seed)
        self.parts = None
        self.resumed_from: str | None = None
        # The version of vLLM's drafter that proposed the drafts the next step verifies.
        self._drafted_by = 0
        drafter_path = str(drafter_dir(runner.vllm_config, cfg))  # a hub id: vLLM's snapshot
        # The drafter's own draft length; K above it is room for lookup drafts only.
        self.drafter_k = drafter_tokens(cfg, drafter_path, self.K)
        self.lookup = (LookupStage(cfg.prompt_lookup, self.K, self.drafter_k)
                       if cfg.prompt_lookup.enabled else None)
        head, trusted = self._build(runner, drafter_path)
        self.cutter = DraftCutter(cfg.length_head, self.drafter_k, head=head, head_trusted=trusted,
                                  on_skip=self.guard.skip)
        if self.cutter.needs_hidden and not compat.wrap_draft_sampler(runner, self.observe_draft_hidden):
            self.guard.skip(G.NO_DRAFT_SAMPLER)
            logger.warning("onlinespec: vLLM's drafter has no _sample_draft_tokens to read hidden "
                           "states from; the length head is not consulted")
        if self.learner is not None:
            if cfg.checkpoint.dir:
                self._resume()
            self.learner.start()
        logger.info("onlinespec: worker ready (learning=%s, algorithm=%s, K=%d); %s",
                    cfg.enabled, cfg.algorithm, self.K, self.cutter.describe())

    @classmethod
    def start(cls, runner: Any, guard: HookGuard | None = None) -> "OnlineSession":
        return cls(runner, config_from_vllm(runner.vllm_config), guard)

    @property
    def learner(self):
        return self.parts.learner if self.parts is not None else None

    @property
    def buffer(self):
        return self.parts.buffer if self.parts is not None else None

    @property
    def wants_feedback(self) -> bool:
        """A learner, a tracer, or a verify policy that keeps acceptance statistics (every
        policy but 'fixed', learning on or off) needs each step's verification."""
        return (self.learner is not None or self.tracer is not None or self.lookup is not None
                or self.feature_log is not None or self.cutter.policy_name != "fixed")

    # -- set-up ---------------------------------------------------------------------------------
    def _feature_log(self, runner: Any):
        """The served tokens' features, logged for offline training (config `features`)."""
        fcfg = self.cfg.features
        if not fcfg.dir:
            return None
        from vllm_onlinespec.drafter.checkpoint import load_drafter_config
        from vllm_onlinespec.training.feature_log import FeatureLogWriter

        dcfg = load_drafter_config(drafter_dir(runner.vllm_config, self.cfg))
        hidden = compat.target_hidden_size(runner.vllm_config)
        logger.info("onlinespec: logging target features (layers %s) to %s",
                    dcfg.target_layer_ids, fcfg.dir)
        return FeatureLogWriter(fcfg.dir, list(dcfg.target_layer_ids), hidden, fcfg.flush_tokens)

    def _build(self, runner: Any, drafter_path: str) -> tuple[nn.Module | None, bool]:
        """Build the learner (learning on) and pick the length head the cutter predicts with:
        (head, trusted). Policy 'fixed' uses no head, so none is trained for it;
        `length_head.train = false` keeps a shipped head frozen."""
        cfg = self.cfg
        wants_head = cfg.length_head.policy != "fixed"
        if cfg.enabled:
            from vllm_onlinespec.learner.device import module_device, resolve_device
            from vllm_onlinespec.learner.factory import build_learner

            embed, lm_head = compat.target_embed_and_head(runner)  # every rank: a collective
            if not self.leader:
                # Other ranks only follow rank 0's publishes; their head refreshes from them.
                head = self._checkpoint_head(drafter_path) if wants_head else None
                return head, head is not None
            # "auto": the learner lives where vLLM's drafter does (publishing stays on-device).
            device = resolve_device(cfg.learner_device,
                                    module_device(compat.drafter_module(runner)) or lm_head.device)
            # A head learning from real verification (head_lr > 0) is the cutter's to train.
            from_verification = cfg.length_head.head_lr > 0
            self.parts = build_learner(cfg, drafter_path, embed, lm_head, self.drafter_k,
                                       train_length_head=(wants_head and cfg.length_head.train
                                                          and not from_verification),
                                       device=device)
            fp = self.parts.footprint
            logger.info("onlinespec: %s", fp.describe(self.parts.learner.device))
            # Not guarded: a learner that cannot fit stops start-up, with the numbers.
            check_fits(fp, self.parts.learner.device,
                       compat.gpu_memory_utilization(getattr(runner, "vllm_config", None)))
            if not wants_head:
                return None, False
            trained = self.parts.bundle.length_head
            if trained is not None:  # trusted only if it came trained
                return trained, self.parts.checkpoint_head is not None
            if self.parts.checkpoint_head is None and from_verification and cfg.length_head.train:
                from vllm_onlinespec.drafter import LengthHead

                return LengthHead(self.parts.config.hidden_size), False  # learns from verification
            return self.parts.checkpoint_head, True
        return (self._checkpoint_head(drafter_path), True) if wants_head else (None, False)

    def _checkpoint_head(self, path: str) -> nn.Module | None:
        from vllm_onlinespec.drafter import load_drafter

        try:
            return load_drafter(path, dtype=torch.float32)[2]
        except Exception as e:  # noqa: BLE001 - no head: the policy says so in its reasons
            logger.warning("onlinespec: no length head (%s); verify policy uses population "
                           "estimates", e)
            return None

    def _resume(self) -> None:
        """Newest usable checkpoint, else a fresh start (one warning); the server comes up."""
        from vllm_onlinespec.learner.resume import resume_or_fresh

        r = resume_or_fresh(self.learner, self.cfg.checkpoint.dir)
        if r.path is None:
            return
        self.resumed_from = str(r.path)
        latest = self.learner.latest()
        self.publisher.publish(latest)
        self.cutter.refresh(latest[1], latest[0])
        self._drafted_by = self.publisher.version
        logger.info("onlinespec: resumed drafter version %d from %s", r.version, r.path)

    def probe_step_cost(self, runner: Any) -> None:
        """Start-up measurement of the target step's cost for the budget policy: timed dummy
        steps over a spread of token counts, before any request. Real steps refresh it online.
        A failed probe leaves the prior in place and says so."""
        cm = self.cutter.cost_model
        if cm is None:
            return
        try:
            t0 = time.perf_counter()
            samples = compat.time_target_steps(runner, PROBE_TOKENS)
            for n, sec in samples:
                cm.observe(n, sec)
            logger.info("onlinespec: start-up probe, %d timed target steps of %s tokens in "
                        "%.1f s: %s", len(samples), sorted({n for n, _ in samples}),
                        time.perf_counter() - t0, cm.describe())
        except Exception as e:  # noqa: BLE001 - the prior and online refits still work
            logger.warning("onlinespec: start-up cost probe failed (%s: %s); the budget starts "
                           "from the prior %s and refits from real steps",
                           type(e).__name__, e, cm.describe())

    # -- every engine step (the runner guards each call) ------------------------------------------
    def observe_step_cost(self, tokens: int, seconds: float) -> None:
        self.cutter.observe_step_cost(tokens, seconds)

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
        """Before this step's drafter runs: (the scheduler output vLLM's drafter should see,
        the draft length k it asks for), or None to leave the step alone (K). k is at most the
        drafter's own length (`drafter_tokens`); the budget's gate tells the policy the next
        step's batch and scheduled tokens besides drafts and picks k in 0..drafter_k; where
        every request has a lookup draft the hybrid rule takes, k = 0. A plain-decoding
        feature-log engine always asks for k = 0. `sampled`: this step's sampled tokens (vLLM
        drafts before it books them), which the lookup needs. Fewer than K: vLLM gets a copy of the
        scheduler output asking for k (vLLM's own dynamic-K field; at k = 0 the drafter writes
        its context K/V only, compat.install_context_only_k0)."""
        if self.cfg.features.plain:  # a data-generation engine: plain decoding, features logged
            return compat.with_spec_tokens(scheduler_output, 0), 0
        k = self.drafter_k
        if self.cutter.policy_name == "budget":
            B, base = compat.step_token_counts(scheduler_output)
            k = min(k, self.cutter.plan_next(B, base).k)
        if k and sampled is not None and self.lookup is not None and self.cfg.prompt_lookup.skip_drafter:
            req_ids = compat.batch_req_ids(self.runner)
            history = compat.tokens_before_bookkeeping(self.runner, req_ids, sampled)
            if self.lookup.prepare(req_ids, history, self._seed_bound(req_ids)):
                self.lookup.skipped_steps += 1
                k = 0
        if k >= self.K:
            return None
        return compat.with_spec_tokens(scheduler_output, k), k

    def observe_draft_time(self, k: int | None, seconds: float) -> None:
        """vLLM's drafter forward at draft length k (None: K) took `seconds`."""
        self.cutter.observe_draft_time(self.drafter_k if k is None else k, seconds)

    @property
    def times_cycles(self) -> bool:
        """Whether the runner should time whole engine cycles (the budget's gate prices them)."""
        return self.cutter.gate is not None

    def observe_cycle(self, k: int | None, batch_size: int, tokens: int, seconds: float, *,
                      verified: bool) -> None:
        """A whole engine cycle: B requests, `tokens` target tokens (drafts `verified` among
        them), drafted at k (None: the drafter's own length), `seconds` of wall time from one
        execute_model to the next."""
        self.cutter.observe_cycle(self.drafter_k if k is None else k, batch_size, tokens, seconds,
                                  verified=verified)

    def observe_draft_hidden(self, hidden: torch.Tensor) -> None:
        """Called inside vLLM's drafter, right before it samples: must never raise."""
        with self.guard(G.DRAFT_HIDDEN):
            self.cutter.observe_hidden(hidden)

    def after_step(self, runner: Any, view: compat.StepView | None, sampled: Any) -> None:
        """Feedback, publish and metrics, each under its own guard."""
        self.steps += 1
        verified_by, self._drafted_by = self._drafted_by, self.publisher.version
        with self.guard(G.FEEDBACK):
            self._feedback(view, sampled, verified_by)
        with self.guard(G.PUBLISH):
            self._publish()
        with self.guard(G.METRICS):
            self._write_metrics()

    def _feedback(self, view: compat.StepView | None, sampled: Any, drafted_by: int) -> None:
        """drafted_by: the drafter version that proposed the drafts this step verified (vLLM
        drafts at the end of a step, before that step's publish)."""
        if view is None:
            return
        if self.lookup is not None:  # before any early return: finished texts must not pile up
            self.lookup.finish(view.finished_req_ids)
        if sampled is None:
            self.guard.skip(G.NO_SAMPLER_OUTPUT)
            return
        accepted = compat.accepted_counts(sampled, view.num_draft_tokens)
        self.cutter.observe(self._drafter_rows(view, accepted), accepted, view.req_ids)
        self.cutter.forget(view.finished_req_ids)
        if self.tracer is not None:
            self.tracer.record(view, accepted, sampled)
        if self.buffer is None and self.feature_log is None:
            return
        with torch.inference_mode(False):  # the learner trains on these: no inference tensors
            fb = records_from_step(view, accepted, drafted_by, async_copy=not compat.is_cpu())
        fb.finished = list(view.finished_req_ids)
        self._deliver(self._pipe.submit(fb))

    def _deliver(self, ready: list[StepFeedback]) -> None:
        for fb in ready:
            for rec in fb.records:
                if self.feature_log is not None:
                    self.feature_log.add(rec.req_id, rec.start_pos, rec.token_ids, rec.aux,
                                         rec.target_hidden)
                if self.buffer is not None:
                    self.buffer.push(rec)
            if self.buffer is not None:
                for rid in fb.finished:
                    self.buffer.finish(rid)
        if self.buffer is not None and ready:
            self.learner.notify()

    def _drafter_rows(self, view: compat.StepView, accepted: list[int]) -> list[int] | None:
        """Draft tokens verified per request, 0 where prompt lookup drafted (counted apart):
        the verify-length policy and the head score the drafter's blocks only."""
        if self.lookup is None:
            return view.num_draft_tokens
        return self.lookup.drafter_rows(view.req_ids, view.num_draft_tokens, accepted)

    def _publish(self) -> None:
        if not self.cfg.enabled:
            return
        latest = self.learner.latest() if self.learner is not None else None  # once: the
        if self.tp is not None:  # head refresh sees what vLLM got
            latest = self._share_with_ranks(latest)
        if latest is not None and self.publisher.publish(latest):
            self.cutter.refresh(latest[1], latest[0])

    def _share_with_ranks(self, latest):
        """Rank 0's newest version reaches every rank at this same step (every rank calls this
        once per step: a collective). Returns (version, snapshot) where it is new, else None."""
        # Compared with the version last shared, which every rank holds alike (a rank-local
        # figure, e.g. rank 0's resumed publish, would let the ranks disagree and hang).
        shared = self._tp_shared
        version = compat.broadcast_version(self.tp, latest[0] if latest is not None else shared)
        if version <= shared:
            return None
        self._tp_shared = version
        snap = latest[1] if self.leader else None
        if snap is not None and hasattr(snap, "wait_ready"):
            snap.wait_ready()  # a CUDA snapshot's copy ends before the broadcast reads it
        return version, compat.broadcast_snapshot(self.tp, snap)

    def _write_metrics(self) -> None:
        if self.leader and self.metrics.due():  # one file per engine: rank 0's (it learns)
            self.metrics.write(self.stats(), self.info())

    def cut_drafts(self, drafts: Any) -> Any:
        """Cut each request's draft to the verify-length policy's choice (a prefix: lossless).
        The runner returns vLLM's drafts unchanged if this raises."""
        ids = drafts.draft_token_ids
        if not isinstance(ids, list):
            self.guard.skip(G.NON_LIST_DRAFTS)
            return drafts
        req_ids = getattr(drafts, "req_ids", None)  # lets the next step's verification score the head
        req_ids = list(req_ids) if req_ids else None
        cut = self.cutter.cut(ids, req_ids)
        if self.lookup is not None and req_ids is not None:
            cut = self._prompt_lookup(cut, req_ids)
        drafts.draft_token_ids = cut
        return drafts

    def _prompt_lookup(self, cut: list[list[int]], req_ids: list[str]) -> list[list[int]]:
        """The lookup stage's drafts (serving/lookup.py). A data-generation engine
        (features.plain) never speculates."""
        if self.cfg.features.plain:
            return cut
        return self.lookup.propose(cut, req_ids, compat.request_tokens(self.runner, req_ids),
                                   self._seed_bound(req_ids))

    def _seed_bound(self, req_ids: list[str]) -> list[bool]:
        """Requests whose exact sample depends on the drafts they are shown: seeded ones under
        vLLM's rejection sampling. Under drafter-invariant verification none is (their tokens
        depend on seed and target alone), so they may draft from other requests' text too."""
        if getattr(self.runner, "_onlinespec_invariant", None) is not None:
            return [False] * len(req_ids)
        return compat.seeded_requests(self.runner, req_ids)

    # -- reading ----------------------------------------------------------------------------------
    def stats(self) -> OnlineSpecStats:
        c, cm = self.cutter, self.cutter.cost_model
        out = OnlineSpecStats(
            steps=self.steps, published_version=self.publisher.version,
            publishes=self.publisher.count, publish_ms_last=self.publisher.last_ms,
            publish_ms_total=self.publisher.total_ms,
            oracle_accept_len=self.oracle.accept_len if self.oracle else 0.0,
            cost_a_s=cm.a if cm is not None else None,
            cost_b_s_per_token=cm.b if cm is not None else None,
            resumed_from=self.resumed_from, hooks=self.guard.stats(),
            target_swaps=self.target_swaps,
            **self._invariant_stats(),
            **({"lookup_rows": self.lookup.rows, "lookup_drafted": self.lookup.drafted,
                "lookup_accepted": self.lookup.accepted,
                "lookup_recent_rows": self.lookup.recent_rows,
                "lookup_skipped_steps": self.lookup.skipped_steps} if self.lookup else {}),
            cutter=CutterStats(policy=c.policy_name, head=c.head_state, drafted=c.drafted,
                               verified=c.verified, last_reason=c.last_reason,
                               head_updates=c.head_version, head_labels=c.feedback.labels,
                               head_feedback_updates=c.feedback.updates,
                               gate_steps=c.gate.steps if c.gate else 0,
                               gate_shut_steps=c.gate.shut_steps if c.gate else 0,
                               gate_explore_steps=c.gate.explore_steps if c.gate else 0,
                               gate_short_steps=c.gate.short_steps if c.gate else 0,
                               gate_overhead_s=c.gate.overhead.as_dict() if c.gate else {}))
        if self.learner is not None:
            out.learner = LearnerStats.from_learner(self.learner.stats())
            out.buffer = BufferStats(**self.buffer.stats())
        return out

    def _invariant_stats(self) -> dict:
        inv = getattr(self.runner, "_onlinespec_invariant", None)
        if inv is None:
            return {}
        return {"invariant_mode": inv.mode, "invariant_rows": inv.covered_steps,
                "coupled_rows": inv.coupled_rows,
                "invariant_fallbacks": dict(inv.fallbacks)}

    def digest(self) -> str:
        """sha256 of vLLM's drafter weights as loaded, read back from vLLM's module under
        checkpoint names (compare with `state_digest` of a checkpoint's `drafter.*` tensors)."""
        from vllm_onlinespec.learner.checkpoint import state_digest

        # Only a learning engine's drafter is republished (and so kept in plain, readable
        # weights); without a learner there is nothing a publish could have got wrong.
        if not self.cfg.enabled or compat.drafter_module(self.runner) is None:
            return ""
        return state_digest(compat.read_draft_weights(self.runner))

    def info(self) -> dict[str, str]:
        return {"algorithm": self.cfg.algorithm, "learning": str(self.cfg.enabled),
                "verify_policy": self.cfg.length_head.policy, "K": str(self.K),
                "prompt_lookup": str(self.lookup is not None),
                "length_head": self.cutter.head_state}

    def swap_target(self, runner: Any, reload: Callable[[], None]) -> dict:
        """Run `reload` (vLLM's in-place reload of the target's weights) with the learner
        paused, then make the learner follow (serving/target_swap.py). Not guarded: a failed
        reload must reach the caller."""
        t0 = time.perf_counter()
        dropped = 0
        with self.learner.paused() if self.learner is not None else contextlib.nullcontext():
            reload()
            if self.cfg.enabled:
                # Every rank: under TP the gather is a collective (only rank 0 has a learner).
                embed, lm_head = compat.target_embed_and_head(runner)
                if self.learner is not None:
                    self.parts.learner.loss_fn.retarget(embed, lm_head)
                    self._pipe.drop()  # the old target's features
                    dropped = self.buffer.clear()
        self.target_swaps += 1
        sec = time.perf_counter() - t0
        logger.info("onlinespec: target weights swapped in %.2f s (%d untrained feedback tokens "
                    "from the old target dropped)", sec, dropped)
        return {"seconds": sec, "dropped_tokens": dropped, "swaps": self.target_swaps}

    def flush_features(self) -> int:
        """Write the feature log's pending rows now; the rows logged so far (0 when off)."""
        if self.feature_log is None:
            return 0
        self.feature_log.flush()
        return self.feature_log.rows_written

    def close(self) -> None:
        try:
            self._deliver(self._pipe.flush())  # the last step's feedback, held on GPU
        except Exception as e:  # noqa: BLE001 - shutting down: say so, never raise
            logger.warning("onlinespec: last step's feedback at shutdown failed: %s", e)
        if self.feature_log is not None:
            try:
                self.feature_log.close()
            except Exception as e:  # noqa: BLE001 - shutting down: say so, never raise
                logger.warning("onlinespec: feature log flush at shutdown failed: %s", e)
        if self.learner is not None:
            self.learner.stop()
            if self.cfg.checkpoint.dir:
                try:
                    self.learner.save_checkpoint()
                except Exception as e:  # noqa: BLE001
                    logger.warning("onlinespec: final checkpoint failed: %s", e)
