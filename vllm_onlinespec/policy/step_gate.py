"""The step gate: how many tokens the next engine step drafts, decided before drafting.

The budget policy cuts drafts that exist; by then the drafter's forward is paid. When no draft
token pays for its verification (on a CPU at batch 32 a speculative step at accept length ~1
costs ~3x a plain step), the best step is a plain one that also skips most of the drafter: the
runner then asks vLLM's drafter for K = 0 (vLLM's dynamic-K path, llm_base_proposer.py:617: one
query token per request, the context K/V of the step's tokens still written, so later drafts
see no hole). When only the first few draft tokens pay, the same path drafts k < K: a cheaper
forward (k + 1 query tokens per request) and nothing drafted that nobody verifies. The gate
compares, for the next step and every k in 1..K,

    speculating at k:  E_spec(k) / (t(base + verified drafts) + t_draft(k) + o_drafted(B))
                       (budget.plan over the first k positions)
    plain:             B / (t(base) + t_draft(0) + o_plain(B))

with the population's per-position acceptance (only verified drafts update it), the target's
measured cost model, the drafter's measured time per k and each kind of step's measured
overhead o beyond those two spans (whole engine cycles timed, policy/cycle_overhead.py), and
takes the best. The gate also
stays shut while the cuts of recent drafted steps verified (almost) nothing: a trusted length
head may cut every draft the population estimate would still verify. Exploration keeps the
acceptance estimate current while the gate drafts fewer than K (or none): every
`explore_every`-th such step drafts all K and the cutter verifies the full draft of up to
`explore_requests` requests. Its cost is bounded: at most one step in `explore_every` drafts at
K when the gate would not, with at most explore_requests * K verify tokens in it.
Core module: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.policy.cycle_overhead import CycleOverhead
from vllm_onlinespec.policy.verify_length import AcceptanceStats


MIN_VERIFY_PER_REQUEST = 0.05  # below this the cuts verify (almost) nothing: drafting is waste


@dataclass(frozen=True)
class GateDecision:
    k: int  # draft tokens per request the next step asks vLLM's drafter for (0 = none)
    explore: bool  # drafted only to refresh the acceptance estimate
    reason: str
    # What the measured choice picked (policy/option_choice.py): "plain", "tree" or "drafter";
    # None: no choice made (no options, or the gate's own exploration), the step is not priced.
    option: str | None = None

    @property
    def draft(self) -> bool:
        return self.k > 0


@dataclass(frozen=True)
class LengthPlan:
    """The budget's best verify plan when every request drafts k tokens (plans_by_length)."""
    tokens: int  # draft tokens verified
    rate: float  # expected tokens per second of the step (0 when nothing is verified)
    floor_s: float  # the target step with no draft verified


def plans_by_length(rates: np.ndarray, B: int, base: int, cost_model: StepCostModel,
                    extras: np.ndarray, *, cost_scale: float = 1.0) -> list[LengthPlan]:
    """`budget.plan` for B requests sharing the per-position acceptance `rates`, at every draft
    length k = 1..len(extras) (extras[k-1]: the seconds drafting at k adds), in one pass.

    Why one pass is the same: with equal rows the gains sorted in descending order are each
    position's cumulative acceptance repeated B times (it never increases along the draft), so
    the plan at length k searches the first k * B of the same sorted gains; only the step's
    extra seconds differ. Same sums in the same order as plan(): the same numbers, ~10x fewer
    Python calls (the gate decides every engine step)."""
    K = len(extras)
    g = np.cumprod(np.clip(np.asarray(rates, dtype=np.float64)[:K], 0.0, 1.0))
    desc = np.repeat(g, B)
    S = np.concatenate([[0.0], np.cumsum(desc)])
    m_all = np.arange(len(S), dtype=np.float64)
    t_base = cost_model.predict(float(base))
    added = cost_model.predict(base + m_all) - t_base
    T = np.maximum(t_base + extras[:, None] + cost_scale * added[None, :], 1e-12)
    score = (float(B) + S)[None, :] / T
    score[m_all[None, :] > (np.arange(1, K + 1) * B)[:, None]] = -np.inf
    best = score.max(axis=1, keepdims=True)
    # Smallest m within rounding of the best: a zero-gain token must not win on float noise.
    m = np.argmax(score >= best - 1e-12 * np.maximum(1.0, np.abs(best)), axis=1)
    out = []
    for k in range(K):
        mk = int(m[k])
        rate = (B + S[mk]) / T[k, mk] if mk else 0.0
        out.append(LengthPlan(tokens=mk, rate=float(rate), floor_s=float(T[k, 0] - extras[k])))
    return out


class DraftTimer:
    """Exponential moving average of the drafter's time per step, per draft length k."""

    def __init__(self, half_life_steps: float = 32.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.ema: dict[int, float] = {}

    def observe(self, k: int, seconds: float) -> None:
        old = self.ema.get(k)
        self.ema[k] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def get(self, k: int, K: int) -> float:
        """Seconds for a forward at draft length k. Unmeasured lengths are priced by the query
        block, k + 1 tokens per request (the context K/V is the same at every k): linear
        between the shortest and longest lengths measured, or proportional to k + 1 from the
        one measured, so the gate tries a cheaper length once and then measures it. Nothing
        measured: 0."""
        if k in self.ema:
            return self.ema[k]
        if not self.ema:
            return 0.0
        lo, hi = min(self.ema), max(self.ema)
        if lo == hi:
            return self.ema[lo] * (k + 1) / (lo + 1)
        slope = (self.ema[hi] - self.ema[lo]) / (hi - lo)
        return max(0.0, self.ema[lo] + slope * (k - lo))


class StepGate:
    def __init__(self, K: int, cost_model: StepCostModel, *, explore_every: int = 32,
                 explore_requests: int = 2, min_obs: int = 16, rho: float = 1.0) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 (got {explore_every})")
        self.K, self.cost_model = K, cost_model
        self.explore_every, self.explore_requests = explore_every, explore_requests
        self.min_obs, self.rho = min_obs, rho
        self.timer = DraftTimer()
        # Whole engine cycles measured against the two modelled spans: the rest of a step
        # (sampler, bookkeeping, hooks) priced per kind of step (policy/cycle_overhead.py).
        self.overhead = CycleOverhead()
        # What the cut of recent drafted steps verified per request. The population estimate
        # only moves on verified drafts: once a trusted length head cuts every draft to 0, it
        # stops moving and would keep the gate open for drafts nobody verifies.
        self.verify_ema: float | None = None
        self.shut_streak = 0  # consecutive steps the gate kept shut
        self.steps = self.shut_steps = self.explore_steps = self.short_steps = 0
        self.best_k = 0  # the draft length of the last decision's best speculative plan
        self.last = GateDecision(K, False, "gate: no decision yet")

    def decide(self, stats: AcceptanceStats | None, batch_size: int,
               base_tokens: int | None = None) -> GateDecision:
        """batch_size: requests in the next step; base_tokens: its tokens besides drafts (B +
        the scheduled prefill tokens when known)."""
        self.steps += 1
        B = batch_size
        base = B if base_tokens is None else max(B, int(base_tokens))
        if B == 0:
            return self._set(GateDecision(self.K, False, "gate: empty batch"))
        if stats is None or stats.n_obs < self.min_obs:
            n = 0 if stats is None else stats.n_obs
            return self._set(GateDecision(self.K, False, f"gate: open, learning acceptance "
                                                         f"({n}/{self.min_obs} requests seen)"))
        # The best draft length: DFlash drafts one block shape per batch, so k is the batch's;
        # each k's verify plan is the budget's exact allocation over the first k positions.
        over_spec, over_plain = self.overhead.get(True, B), self.overhead.get(False, B)
        extras = np.array([self.timer.get(k, self.K) + over_spec for k in range(1, self.K + 1)])
        plans = plans_by_length(stats._rates()[: self.K], B, base, self.cost_model, extras,
                                cost_scale=1.0 / self.rho)
        best_k, rate_spec, best = 0, 0.0, None
        for k, a in enumerate(plans, start=1):
            if a.rate > rate_spec:
                best_k, rate_spec, best = k, a.rate, a
        floor_s = plans[-1].floor_s  # the target step with no draft verified
        self.best_k = best_k
        t_plain_draft = self.timer.get(0, self.K)
        rate_plain = B / max(floor_s + t_plain_draft + over_plain, 1e-9)
        numbers = (f"spec {rate_spec:.0f} tok/s at k={best_k} ("
                   f"{best.tokens if best else 0} verify tokens, drafter "
                   f"{self.timer.get(best_k, self.K) * 1e3:.1f} ms) vs plain {rate_plain:.0f} "
                   f"tok/s (drafter at k=0 {t_plain_draft * 1e3:.1f} ms)")
        if self.overhead.ema:
            numbers += (f", measured step overhead {over_spec * 1e3:+.1f} ms drafted / "
                        f"{over_plain * 1e3:+.1f} ms plain")
        cut_away = self.verify_ema is not None and self.verify_ema < MIN_VERIFY_PER_REQUEST
        if cut_away:
            numbers = (f"the length head cut recent drafts to {self.verify_ema:.2f} verify "
                       f"tokens per request; {numbers}")
        open_ = rate_spec > rate_plain and not cut_away
        if open_ and best_k == self.K:
            self.shut_streak = 0
            return self._set(GateDecision(self.K, False, f"gate: open, {numbers}"))
        # Shut, or drafting fewer than K: the estimate of the later positions only moves when
        # they are verified, so every explore_every-th such step drafts and verifies all K.
        self.shut_streak += 1
        if self.shut_streak % self.explore_every == 0:
            self.explore_steps += 1
            return self._set(GateDecision(self.K, True, f"gate: explore (1 step in "
                                                        f"{self.explore_every}), {numbers}"))
        if open_:
            self.short_steps += 1
            return self._set(GateDecision(best_k, False, f"gate: open at k={best_k}, {numbers}"))
        self.shut_steps += 1
        return self._set(GateDecision(0, False, f"gate: shut, {numbers}"))

    def observe_cycle(self, k: int, batch_size: int, target_tokens: int, seconds: float, *,
                      drafter_verified: bool = False) -> None:
        """One whole engine cycle (execute_model start to the next) that ran the target on
        `target_tokens` tokens and drafted k per request: what it cost beyond the model. It
        counts as a drafted cycle if the drafter drafted (k > 0) or its drafts were verified
        in it: the sampler and bookkeeping work of a draft lands in the cycle after the one
        that drafted it. Lookup drafts verified in a cycle do not make it a drafted one: the
        gate decides the drafter's k, and a step it shuts still verifies them."""
        modelled = self.cost_model.predict(float(target_tokens)) + self.timer.get(k, self.K)
        self.overhead.observe(k > 0 or drafter_verified, batch_size, seconds, modelled)

    def observe_cut(self, verify_per_request: float) -> None:
        """After a drafted step's cut: the verify tokens per request the policy chose on its
        own (on an exploring step: before the forced full drafts)."""
        x = float(verify_per_request)
        self.verify_ema = x if self.verify_ema is None else 0.7 * self.verify_ema + 0.3 * x

    def _set(self, d: GateDecision) -> GateDecision:
        self.last = d
        return d

    def describe(self) -> str:
        return (f"step gate: drafts k <= {self.K} tokens, the length whose best plan beats a "
                f"plain step by most with the drafter's measured time at that k counted; shut "
                f"-> k=0 drafter forward; explores 1 step in {self.explore_every} of those below "
                f"K ({self.explore_requests} requests' full drafts)")
