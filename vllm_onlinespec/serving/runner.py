"""The model-runner half of SpecDecodeWorker: hooks into vLLM's V1 runner.

  load_model        drafter loads with plain weights (republishable); its K = 0 step made
                    context-only; the online session starts
  execute_model     timed (step profile, the budget's step cost); each start closes the previous
                    engine cycle, whose wall time the gate compares with its model
  _sample           seeded sampled requests verified drafter-invariantly (compat/
                    invariant_sampling.py); an all-greedy step on one max per logit row
                    (compat/greedy_verify.py); the others through vLLM's rejection sampler,
                    its recovery noise drawn only for requests with drafts (compat/
                    recovery_noise.py); remembers the rejection sampler's output
                    (accepted lengths); the oracle
  propose_draft_token_ids   the budget's step gate (draft K, fewer, or vLLM's K = 0 drafter path); timed
  sample_tokens     before: a view of the target step (on GPU its features copied, before vLLM's
                    drafter can overwrite them); after: feedback -> buffer, then publish
  take_draft_token_ids   the verify-length policy cuts each request's draft

Every hook follows one pattern (serving/guard.py): vLLM's own call runs outside any guard, so
its exceptions reach vLLM unchanged and its return value is returned as is; our work before and
after it runs under a guard that counts and swallows our exceptions. Publishing happens at the
end of sample_tokens, after this step's drafter forward and before the next step's: new weights
never land in the middle of a forward.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm_onlinespec.policy.cycle_overhead import batch_bucket
from vllm_onlinespec.policy.option_choice import laggard_tokens
from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving import guard as G
from vllm_onlinespec.serving.guard import HookGuard
from vllm_onlinespec.serving.step_profile import StepProfile
from vllm_onlinespec.serving.step_timer import StepTimer

logger = logging.getLogger("vllm_onlinespec")


class OnlineSpecRunnerMixin:
    _onlinespec: Any = None
    _onlinespec_invariant: Any = None  # compat.InvariantVerifier, or None (greedy-only/off)
    _onlinespec_sampled: Any = None
    _onlinespec_span: Any = None  # this step's target span (serving/step_timer.py)
    _onlinespec_tokens: int = 0
    _onlinespec_cycle: "_Cycle | None" = None  # closed by the next execute_model
    # The last closed cycle asked vLLM's drafter for k > 0: the drafts the next cycle verifies
    # include the drafter's (not only the lookup's).
    _onlinespec_drafter_drafted: bool = False
    # The option the last closed cycle chose for the drafts the next cycle verifies, and the
    # seconds it spent drafting them (policy/option_choice.py prices the option with them).
    _onlinespec_verifying: tuple[str | None, float] = (None, 0.0)

    def _onlinespec_init(self) -> None:
        if getattr(self, "_onlinespec_guard", None) is None:
            self._onlinespec_guard = HookGuard()
            self._onlinespec_profile = StepProfile()
            self._onlinespec_timer = StepTimer()  # what the budget prices: CUDA events on GPU

    def load_model(self, *args, **kwargs):
        from vllm_onlinespec.serving.session import OnlineSession
        from vllm_onlinespec.serving.validate import config_from_vllm

        self._onlinespec_init()
        # Not guarded: a bad config or an unloadable drafter must stop start-up, loudly.
        cfg = config_from_vllm(self.vllm_config)
        if cfg.enabled or (compat.is_cpu() and cfg.publish.repack):
            # The drafter loads with plain Linear weights (vLLM would pack them for its CPU GEMM
            # and drop the originals) and the Publisher packs them itself: a learning drafter
            # must stay republishable, and a frozen one loads the same way so that frozen and
            # learning engines differ only in learning (vLLM's packing at load also steered the
            # frozen engine's budget gate differently: docs/results/drafter_packing.md).
            compat.wrap_drafter_load(self)
        out = super().load_model(*args, **kwargs)
        mode = cfg.invariant_mode(compat.tensor_parallel_size(self.vllm_config))
        self._onlinespec_invariant = compat.InvariantVerifier(mode) if mode != "off" else None
        self._onlinespec_greedy = compat.greedy_verify_enabled()
        if self._onlinespec_invariant is not None and cfg.sampling.coupled_drafts:
            self._install_coupled_drafts()
        compat.install_lean_recovery_noise()
        if cfg.length_head.k0_step != "forward" or cfg.features.plain:
            compat.install_context_only_k0(self, never_drafts=cfg.features.plain,
                                           deferred=cfg.length_head.k0_step == "deferred")
        self._onlinespec = OnlineSession(self, cfg, self._onlinespec_guard)
        return out

    def _install_coupled_drafts(self) -> None:
        """Sampled requests' drafts drawn with the verifier's noise (compat/invariant_sampling.py
        `couple`). Not under tensor parallelism: the drafter's logits are gathered on one rank."""
        if compat.tensor_parallel_size(self.vllm_config) > 1:
            return
        inv, guard = self._onlinespec_invariant, self._onlinespec_guard

        def rewrite(hidden, ids):
            with guard(G.INVARIANT):
                return inv.couple(self, self.drafter, hidden, ids)
            return ids  # reached only when coupling failed: vLLM's greedy drafts

        compat.wrap_draft_ids(self, rewrite)

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._onlinespec_init()
        guard = self._onlinespec_guard
        t0 = time.perf_counter()
        busy, batch = None, 0  # the learner's state as the step begins (None: no learner)
        label = None  # "tree@B16" (+prefill): the budget's option this step verifies
        with guard(G.EXECUTE_MODEL):
            self._onlinespec_tokens = int(scheduler_output.total_num_scheduled_tokens)
            self._onlinespec_timer.poll()  # earlier steps' GPU spans, now measured
            session = self._onlinespec
            timed = session is not None and session.drafting.times_cycles  # only the gate reads them
            reqs = compat.step_req_ids(scheduler_output) if timed else frozenset()
            self._close_cycle(t0, reqs)
            if timed:
                B, base = compat.step_token_counts(scheduler_output)
                verifies = self._onlinespec_tokens > base and self._onlinespec_drafter_drafted
                option, prev_draft_s = self._onlinespec_verifying
                self._onlinespec_cycle = _Cycle(t0, B, self._onlinespec_tokens,
                                                verifies_drafter=verifies, option=option,
                                                prev_draft_s=prev_draft_s, decode_only=base == B,
                                                reqs=reqs)
                if option is not None:
                    label = f"{option}@B{batch_bucket(B)}" + ("" if base == B else "+prefill")
            self._onlinespec_span = self._onlinespec_timer.start()
            if session is not None:
                session.step_began()  # the learner's idle probe: serving is busy
                busy = session.learner_busy()
                if busy is not None:
                    batch = len(scheduler_output.num_scheduled_tokens)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            with guard(G.EXECUTE_MODEL):
                self._onlinespec_profile.observe_target(
                    time.perf_counter() - t0, learner_busy=busy, batch_size=batch,
                    tokens=self._onlinespec_tokens, option=label)

    def _sample(self, logits, spec_decode_metadata):
        self._onlinespec_init()
        t0 = time.perf_counter()
        inv, pending = self._onlinespec_invariant, None
        if inv is not None and logits is not None:
            with self._onlinespec_guard(G.INVARIANT):
                pending = inv.before(self, logits, spec_decode_metadata)
        out = None
        if pending is not None:
            with self._onlinespec_guard(G.INVARIANT):
                if inv.replaces(self, pending):
                    # Every row's sample is the invariant one: vLLM's would be thrown away.
                    tried, pending = pending, None  # one vote per step, whatever happens
                    out = inv.sample(self, tried, spec_decode_metadata)
            # out None: the rewrite failed (counted, on every rank): vLLM samples, unrewritten.
        if (out is None and spec_decode_metadata is not None
                and getattr(self, "_onlinespec_greedy", False)):
            with self._onlinespec_guard(G.GREEDY_VERIFY):  # a failure: vLLM's path below
                out = compat.verify_greedy(self, logits, spec_decode_metadata)
                self._onlinespec_profile.lean_greedy_steps += out is not None
        if out is None:
            with compat.lean_recovery_noise():  # compat/recovery_noise.py: no unread noise
                out = super()._sample(logits, spec_decode_metadata)
            if pending is not None:
                # A failure here is counted and leaves vLLM's own (valid, not reproducible)
                # sample.
                with self._onlinespec_guard(G.INVARIANT):
                    inv.after(self, pending, spec_decode_metadata, out)
        t1 = time.perf_counter()
        with self._onlinespec_guard(G.SAMPLE):
            prof, session = self._onlinespec_profile, self._onlinespec
            prof.sample_s += t1 - t0
            self._onlinespec_sampled = out.sampled_token_ids
            if session is not None:
                with prof.ours(inside_sample_tokens=True):
                    session.force_oracle(out.sampled_token_ids, logits, spec_decode_metadata)
                    if self._onlinespec_span is not None:
                        # Target forward + verification, not drafting: what a verify token costs.
                        tokens = self._onlinespec_tokens
                        self._onlinespec_timer.stop(
                            self._onlinespec_span,
                            lambda sec: session.drafting.observe_step_cost(tokens, sec))
        self._onlinespec_span = None
        return out

    def propose_draft_token_ids(self, *args, **kwargs):
        # vLLM calls it with scheduler_output first (gpu_model_runner.py:4365), positionally.
        self._onlinespec_init()
        guard, session, k = self._onlinespec_guard, self._onlinespec, None
        if session is not None and args:
            gated = None
            with guard(G.GATE), self._onlinespec_profile.ours(inside_sample_tokens=True):
                gated = session.gate_drafting(args[0], args[1] if len(args) > 1 else None)
            if gated is not None:  # the budget's gate may ask vLLM's drafter for k < K tokens
                args, k = (gated[0], *args[1:]), gated[1]
        t0 = time.perf_counter()
        span = None
        with guard(G.PROPOSE):
            span = self._onlinespec_timer.start()
            if self._onlinespec_cycle is not None:
                self._onlinespec_cycle.proposed, self._onlinespec_cycle.k = True, k
                self._onlinespec_cycle.decided = session.drafting.option if session else None
        try:
            return super().propose_draft_token_ids(*args, **kwargs)
        finally:
            with guard(G.PROPOSE):
                dt = time.perf_counter() - t0
                self._onlinespec_profile.draft_s += dt
                if self._onlinespec_cycle is not None:
                    self._onlinespec_cycle.draft_s += dt
                if session is not None and span is not None:
                    self._onlinespec_timer.stop(
                        span, lambda sec: session.drafting.observe_draft_time(k, sec))

    def sample_tokens(self, grammar_output):
        self._onlinespec_init()
        t0 = time.perf_counter()
        guard, session = self._onlinespec_guard, self._onlinespec
        view = left = None
        self._onlinespec_sampled = None
        if session is not None:
            with guard(G.CAPTURE), self._onlinespec_profile.ours(inside_sample_tokens=True):
                view = session.capture(self)
                if (view is not None and self._onlinespec_cycle is not None
                        and session.drafting.counts_laggard):
                    left = compat.tokens_left(self, view.req_ids)  # before the sample books
                if view is not None and _copies_features(session):
                    # Before vLLM's sampler and drafter run (both inside super().sample_tokens):
                    # on GPU the drafter's CUDA graphs replay into the pool that holds the
                    # target's outputs (compat/step_view.py `own_features`).
                    view = compat.own_features(view)
        out = super().sample_tokens(grammar_output)
        if session is not None:
            with guard(G.FEEDBACK), self._onlinespec_profile.ours(inside_sample_tokens=True):
                session.after_step(self, view, self._onlinespec_sampled)
                if self._onlinespec_cycle is not None:
                    self._onlinespec_cycle.produced = session.feedback.last_yield
                    self._onlinespec_cycle.slowest = laggard_tokens(
                        left, session.feedback.last_accepted)
        with guard(G.SAMPLE):
            self._onlinespec_profile.sample_tokens_s += time.perf_counter() - t0
        return out

    def take_draft_token_ids(self):
        t0 = time.perf_counter()
        drafts = super().take_draft_token_ids()
        session = self._onlinespec
        if session is None or drafts is None:
            return drafts
        try:
            with self._onlinespec_guard(G.CUT), self._onlinespec_profile.ours(inside_sample_tokens=False):
                return session.cut_drafts(drafts)
            return drafts  # reached only when the cut failed: vLLM's drafts, uncut
        finally:
            if self._onlinespec_cycle is not None:  # drafting: the lookup's tree proposes here
                self._onlinespec_cycle.draft_s += time.perf_counter() - t0

    def _close_cycle(self, now: float, reqs: frozenset = frozenset()) -> None:
        """The previous engine cycle ended where this one starts (`reqs`: the requests this one
        schedules): its wall time to the gate. A cycle that never reached the drafter (no
        decode in it) prices nothing, nor one none of whose requests continues now: they all
        finished, and the engine may have waited for the next request inside its wall time
        (at batch 1, every request's last cycle)."""
        cycle, session = self._onlinespec_cycle, self._onlinespec
        self._onlinespec_cycle = None
        self._onlinespec_drafter_drafted = cycle is not None and cycle.drafter_drafted
        self._onlinespec_verifying = ((cycle.decided, cycle.draft_s)
                                      if cycle is not None and cycle.proposed else (None, 0.0))
        if (cycle is not None and cycle.proposed and session is not None
                and not cycle.reqs.isdisjoint(reqs)):
            session.drafting.observe_cycle(cycle.k, cycle.batch, cycle.tokens, now - cycle.start,
                                           drafter_verified=cycle.verifies_drafter)
            if cycle.option is not None and cycle.decode_only and cycle.produced:
                # The cycle's own drafting is the next option's; the drafting of what it
                # verified (the cycle before) is this option's.
                seconds = now - cycle.start - cycle.draft_s + cycle.prev_draft_s
                session.drafting.observe_option(cycle.option, cycle.batch, cycle.produced,
                                                seconds, slowest=cycle.slowest,
                                                drafts=cycle.tokens - cycle.batch)

    def onlinespec_profile(self) -> StepProfile:
        return self._onlinespec_profile

    def onlinespec_guard(self) -> HookGuard:
        return self._onlinespec_guard

    def shutdown_onlinespec(self) -> None:
        if self._onlinespec is not None:
            self._onlinespec.close()
            self._onlinespec = None


def _copies_features(session: Any) -> bool:
    """Whether this step's target features must be copied before vLLM drafts: something reads
    them after the step (the learner's buffer, the feature log, the draft tracer), and the
    platform can overwrite them meanwhile. Not on CPU: there the runner's outputs are ordinary
    tensors its step state holds (no CUDA graph pool, no weak references), so the drafter's
    forward allocates its own and the copy would be wasted work on the serving thread."""
    if compat.is_cpu():
        return False
    return (getattr(session, "buffer", None) is not None
            or getattr(session, "feature_log", None) is not None
            or getattr(session, "tracer", None) is not None)


@dataclass
class _Cycle:
    """One engine cycle: execute_model (the target verifies last cycle's drafts), then the
    drafter proposes for the next."""
    start: float  # perf_counter at execute_model
    batch: int  # requests scheduled
    tokens: int  # target tokens scheduled, drafts included
    # The drafter's drafts were verified in it. Lookup drafts alone do not count: with the
    # suffix tree drafting most steps, a cycle the gate shut still verifies the tree's tokens,
    # and counting it as drafted left the plain price to the rare cycles that verified nothing
    # at all (request arrivals and exits), which cost 5-9 ms more than a typical one.
    verifies_drafter: bool
    proposed: bool = False  # the drafter ran (a cycle without it prices nothing)
    k: int | None = None  # draft length asked of vLLM's drafter (None: its own)
    # The budget's options (policy/option_choice.py): what this cycle verified (chosen the
    # cycle before, None: no choice) and what it chose for the next; the seconds spent drafting
    # in the cycle before and in this one; a cycle without prefill tokens is comparable.
    option: str | None = None
    decided: str | None = None
    prev_draft_s: float = 0.0
    draft_s: float = 0.0
    decode_only: bool = False
    produced: int | None = None  # tokens the step produced (1 + accepted per request)
    slowest: float | None = None  # what the request furthest from its end produced
    reqs: frozenset = frozenset()  # the requests it scheduled

    @property
    def drafter_drafted(self) -> bool:
        return self.proposed and (self.k is None or self.k > 0)


_RUNNER_CLASSES: dict[type, type] = {}


def runner_class(base: type) -> type:
    """OnlineSpecRunnerMixin over vLLM's CPU or GPU runner (cached: one class per base)."""
    if base not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[base] = type(f"OnlineSpec{base.__name__}", (OnlineSpecRunnerMixin, base), {})
    return _RUNNER_CLASSES[base]
