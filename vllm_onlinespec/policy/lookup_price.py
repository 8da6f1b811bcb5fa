"""Pricing lookup drafts: how much of each suffix-tree draft the next step should verify.

The budget plans the DFlash drafter's blocks (policy/verify_length.BudgetPolicy); the lookup
stage then puts a suffix-tree draft of up to K tokens where the tree is confident
(serving/lookup.py). Verified whole, those drafts are what makes speculation lose at high
concurrency on a CPU: at 16 requests a verify token costs ~3 ms against ~80 ms for the step,
so a token pays only if it is accepted with probability above ~0.65, and vLLM's suffix
decoding (which verifies its drafts whole) serves 0.79x plain decoding there. Priced, a tree
draft is one more row of the budget's plan: its tokens' acceptance are the tree's own
estimates, each token's cost the target's measured marginal cost, and the step keeps the
prefix of each row that raises expected tokens per second. A lookup draft costs no drafter
forward, so nothing else is charged.

The tree's estimate of a token (`probs`, cumulative: the probability the draft is still
correct at that token, from the continuation counts in its suffix tree) is calibrated online:
one scale, fitted from verification, multiplies every estimate (clipped to 1). Measured rows
without an estimate (the ngram rule's drafts) are kept whole, as before.

Core module: numpy only, no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_onlinespec.policy.budget import StepCostModel, plan


@dataclass
class LookupCalibration:
    """Accepted tokens over the tree's expected tokens on the verified part of its drafts, both
    exponentially averaged per verified row (half-life in rows). Starts at scale 1 (one row
    that expected and got one token), so the first rows move it slowly."""

    half_life_rows: float = 64.0
    lo: float = 0.2
    hi: float = 2.0
    accepted: float = 0.0
    expected: float = 0.0

    def __post_init__(self) -> None:
        if self.half_life_rows <= 0 or not 0 < self.lo <= 1 <= self.hi:
            raise ValueError("LookupCalibration: want half_life_rows > 0 and 0 < lo <= 1 <= hi")
        self.accepted = self.expected = 1.0

    def observe(self, accepted: int, expected: float) -> None:
        """One verified lookup row: `accepted` of its tokens accepted, where the (unscaled)
        estimates of its verified tokens summed to `expected`."""
        if expected <= 0:
            return
        d = 0.5 ** (1.0 / self.half_life_rows)
        self.accepted = d * self.accepted + (1 - d) * float(accepted)
        self.expected = d * self.expected + (1 - d) * float(expected)

    @property
    def scale(self) -> float:
        return float(np.clip(self.accepted / max(self.expected, 1e-9), self.lo, self.hi))


@dataclass(frozen=True)
class StepPrice:
    """What the budget knows about the next step, for pricing lookup drafts: the target's
    cost model, its tokens besides drafts, the drafter's per-position acceptance (what its
    kept blocks yield; None: unknown, counted as sure) and the policy's cost scale (1 / rho)."""

    cost_model: StepCostModel
    base_tokens: int
    drafter_p: Any = None
    cost_scale: float = 1.0


def conditional_acceptance(cum_probs: Sequence[float], scale: float = 1.0) -> np.ndarray:
    """Per-token conditional acceptance (budget.plan's p) from cumulative estimates: q_j the
    probability that tokens 0..j are all accepted, scaled, clipped to [0, 1] and made
    non-increasing; p_j = q_j / q_{j-1}."""
    q = np.minimum(1.0, np.clip(np.asarray(cum_probs, dtype=np.float64), 0.0, None) * scale)
    if q.size == 0:
        return q
    q = np.minimum.accumulate(q)
    prev = np.concatenate([[1.0], q[:-1]])
    return np.where(prev > 0, q / np.maximum(prev, 1e-12), 0.0)


def price_drafts(lengths: Sequence[int], lookup_p: Sequence[np.ndarray | None],
                 drafter_p: np.ndarray | None, base_tokens: int, cost_model: StepCostModel,
                 cost_scale: float = 1.0) -> list[int]:
    """Verify lengths for a step whose row i holds `lengths[i]` draft tokens: lookup rows
    (lookup_p[i] given: their tokens' conditional acceptance) are cut to the prefix the plan
    keeps; the other rows (the drafter's blocks, already cut by the budget, or lookup rows with
    no estimate) are kept whole and count in the step's cost. drafter_p: the drafter's
    per-position acceptance (what the kept blocks are expected to yield), or None."""
    B = len(lengths)
    width = max([0, *lengths])
    if B == 0 or width == 0 or all(p is None for p in lookup_p):
        return list(lengths)
    p = np.zeros((B, width))
    k_min = np.zeros(B, dtype=np.int64)
    for i, (n, lp) in enumerate(zip(lengths, lookup_p)):
        if lp is not None:
            m = min(n, len(lp))
            p[i, :m] = lp[:m]
        else:  # kept whole: forced into the plan with what it is expected to yield
            k_min[i] = n
            if drafter_p is not None and n:
                dp = np.asarray(drafter_p, dtype=np.float64)[:n]
                p[i, : len(dp)] = dp
            elif n:
                p[i, :n] = 1.0
    a = plan(p, base_tokens, cost_model, k_min=k_min, K=width, cost_scale=cost_scale)
    return [min(int(n), int(c)) for n, c in zip(lengths, a.lengths)]
