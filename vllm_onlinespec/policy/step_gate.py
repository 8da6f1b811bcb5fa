"""The step gate: whether the next engine step speculates at all, decided before drafting.

The budget policy cuts drafts that exist; by then the drafter's forward is paid. When no draft
token pays for its verification (on a CPU at batch 32 a speculative step at accept length ~1
costs ~3x a plain step), the best step is a plain one that also skips most of the drafter: the
runner then asks vLLM's drafter for K = 0 (vLLM's dynamic-K path, llm_base_proposer.py:617: one
query token per request, the context K/V of the step's tokens still written, so later drafts
see no hole). The gate compares, for the next step,

    speculating:  E_spec / (t(base + verified drafts) + t_draft(K))     (budget.plan's best plan)
    plain:        B / (t(base) + t_draft(0))

with the population's per-position acceptance (only verified drafts update it), the target's
measured cost model and the drafter's measured time at K and at 0. The gate also stays shut
while the cuts of recent drafted steps verified (almost) nothing: a trusted length head may cut
every draft the population estimate would still verify. Exploration keeps the
acceptance estimate current while the gate is shut: every `explore_every`-th shut step drafts
anyway and the cutter verifies the full draft of up to `explore_requests` requests. Its cost
is bounded: at most one drafted step in `explore_every`, at most explore_requests * K verify
tokens in it. Core module: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_onlinespec.policy.budget import StepCostModel, plan
from vllm_onlinespec.policy.verify_length import AcceptanceStats


MIN_VERIFY_PER_REQUEST = 0.05  # below this the cuts verify (almost) nothing: drafting is waste


@dataclass(frozen=True)
class GateDecision:
    draft: bool  # draft K tokens for the next step (else K = 0)
    explore: bool  # drafted only to refresh the acceptance estimate
    reason: str


class DraftTimer:
    """Exponential moving average of the drafter's time per step, at K and at K = 0."""

    def __init__(self, half_life_steps: float = 32.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.ema: dict[bool, float | None] = {True: None, False: None}

    def observe(self, drafted: bool, seconds: float) -> None:
        old = self.ema[drafted]
        self.ema[drafted] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def get(self, drafted: bool, K: int) -> float:
        """Seconds. Unmeasured: a K = 0 forward is priced at 1 / (K + 1) of a K one (one query
        token per request instead of K + 1, the context K/V the same), so the gate tries the
        plain path once and measures it; an unmeasured K forward at 0."""
        v = self.ema[drafted]
        if v is None and not drafted and self.ema[True] is not None:
            v = self.ema[True] / (K + 1)
        return 0.0 if v is None else v


class StepGate:
    def __init__(self, K: int, cost_model: StepCostModel, *, explore_every: int = 32,
                 explore_requests: int = 2, min_obs: int = 16, rho: float = 1.0) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 (got {explore_every})")
        self.K, self.cost_model = K, cost_model
        self.explore_every, self.explore_requests = explore_every, explore_requests
        self.min_obs, self.rho = min_obs, rho
        self.timer = DraftTimer()
        # What the cut of recent drafted steps verified per request. The population estimate
        # only moves on verified drafts: once a trusted length head cuts every draft to 0, it
        # stops moving and would keep the gate open for drafts nobody verifies.
        self.verify_ema: float | None = None
        self.shut_streak = 0  # consecutive steps the gate kept shut
        self.steps = self.shut_steps = self.explore_steps = 0
        self.last = GateDecision(True, False, "gate: no decision yet")

    def decide(self, stats: AcceptanceStats | None, batch_size: int,
               base_tokens: int | None = None) -> GateDecision:
        """batch_size: requests in the next step; base_tokens: its tokens besides drafts (B +
        the scheduled prefill tokens when known)."""
        self.steps += 1
        B = batch_size
        base = B if base_tokens is None else max(B, int(base_tokens))
        if B == 0:
            return self._set(GateDecision(True, False, "gate: empty batch"))
        if stats is None or stats.n_obs < self.min_obs:
            n = 0 if stats is None else stats.n_obs
            return self._set(GateDecision(True, False, f"gate: open, learning acceptance "
                                                       f"({n}/{self.min_obs} requests seen)"))
        p = np.broadcast_to(stats._rates()[None, : self.K], (B, self.K))
        a = plan(p, base, self.cost_model, k_min=0, K=self.K, cost_scale=1.0 / self.rho)
        t_draft, t_plain_draft = self.timer.get(True, self.K), self.timer.get(False, self.K)
        rate_spec = a.expected_tokens / (a.step_s + t_draft) if a.tokens else 0.0
        rate_plain = B / (a.min_step_s + t_plain_draft)
        numbers = (f"spec {rate_spec:.0f} tok/s ({a.tokens} verify tokens, drafter "
                   f"{t_draft * 1e3:.1f} ms) vs plain {rate_plain:.0f} tok/s (drafter at K=0 "
                   f"{t_plain_draft * 1e3:.1f} ms)")
        cut_away = self.verify_ema is not None and self.verify_ema < MIN_VERIFY_PER_REQUEST
        if cut_away:
            numbers = (f"the length head cut recent drafts to {self.verify_ema:.2f} verify "
                       f"tokens per request; {numbers}")
        if rate_spec > rate_plain and not cut_away:
            self.shut_streak = 0
            return self._set(GateDecision(True, False, f"gate: open, {numbers}"))
        self.shut_streak += 1
        if self.shut_streak % self.explore_every == 0:
            self.explore_steps += 1
            return self._set(GateDecision(True, True, f"gate: explore (1 step in "
                                                      f"{self.explore_every}), {numbers}"))
        self.shut_steps += 1
        return self._set(GateDecision(False, False, f"gate: shut, {numbers}"))

    def observe_cut(self, verify_per_request: float) -> None:
        """After a drafted step's cut: the verify tokens per request the policy chose on its
        own (on an exploring step: before the forced full drafts)."""
        x = float(verify_per_request)
        self.verify_ema = x if self.verify_ema is None else 0.7 * self.verify_ema + 0.3 * x

    def _set(self, d: GateDecision) -> GateDecision:
        self.last = d
        return d

    def describe(self) -> str:
        return (f"step gate: drafts only when a step's best plan beats a plain step with the "
                f"drafter's measured time counted; shut -> K=0 drafter forward; explores 1 step "
                f"in {self.explore_every} ({self.explore_requests} requests' full drafts)")
