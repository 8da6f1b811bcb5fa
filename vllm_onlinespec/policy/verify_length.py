"""Per-request verify length: how much of each request's K-token draft the target verifies.

How the serving layer uses it (core module: no vLLM import):

* Start-up: `policy = make_policy(cfg.length_head, cost_model)`; log `policy.describe()`.
* Each step, before the drafts go to the verifier (`take_draft_token_ids`): run the length head on
  the block's hidden states (NaN / None for a request it has no prediction for, e.g. its first
  step), then `lengths, reason = policy.lengths(pred_r, K, B, base_tokens=...)` and cut request
  i's draft to `draft[:lengths[i]]`. Log or export `reason`; `policy.counters()` gives totals.
* After verification: `policy.observe(drafted, accepted)` (per request, in the same order) keeps
  the online per-position acceptance rates; the worker also feeds the step's token count and wall
  time to the cost model (`budget.StepCostModel.observe`).

No policy switches itself off or on: what it does with a batch is decided by its configuration
and, for `budget`, by the measured cost model, and every decision comes with a one-line reason.

Convention: the head predicts r = (accepted + 1) / block_size with block_size = K + 1 (the
first, already known token of the block counts; see `drafter.length_head.length_label`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from vllm_onlinespec.policy.budget import StepCostModel, plan

Pred = Tensor | Sequence[float | None] | np.ndarray | None

# A request is predicted from one of three sources; the counters and reasons use these names.
HEAD, POPULATION, FULL = "head", "population", "full"


def _np(x: Any, dtype: Any = np.float64) -> np.ndarray:
    # numpy, not torch, for everything small on the serving path: a few dozen tiny ops must not
    # wait on torch's intra-op thread pool, which on a busy box costs milliseconds per op.
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


# -- AdaFlash's rule -----------------------------------------------------------------------------


def adaflash_lengths(r: Any, K: int, rho: float, k_min: int) -> list[int]:
    """AdaFlash: clamp(round(r * K * rho), k_min, K) per request. `round` is round-half-to-even
    (np.round, like torch.round and Python's round): 2.5 -> 2, 3.5 -> 4. k_min above K gives K."""
    n = np.clip(np.round(_np(r).reshape(-1) * K * rho), min(k_min, K), K)
    return n.astype(int).tolist()


# -- per-position acceptance ---------------------------------------------------------------------


def position_acceptance(r: Any, K: int, *, shape: Tensor | None = None,
                        block_size: int | None = None) -> Tensor:
    """The head's scalar r [B] -> p [B, K] float64, p[i, k] = P(draft token k accepted | all
    tokens before it were), the input `budget.plan` needs.

    Model: p[i, k] = shape[k] ** t_i. The per-position profile `shape` comes from observed
    acceptance (`AcceptanceStats.rates()`); without it the profile is flat and the model is
    geometric (one per-token acceptance a_i = 0.5 ** t_i for every position). The exponent t_i >= 0
    is solved so that the expected number of accepted drafts matches the head:

        sum_k prod_{j<=k} p[i, j] = r_i * block_size - 1        (block_size defaults to K + 1)

    i.e. `p.cumprod(-1).sum(-1) + 1 == r * block_size` for r in [1/block_size, 1]; outside, the
    target is clamped to (0, K). Newton's method on log(sum_k Q_k ** t) (convex, decreasing in t),
    started below the root, approaches it from the left without overshoot; a few steps suffice.
    """
    return torch.from_numpy(_position_acceptance(_np(r).reshape(-1), K, shape, block_size))


def _position_acceptance(r: np.ndarray, K: int, shape: Any, block_size: int | None) -> np.ndarray:
    bs = K + 1 if block_size is None else block_size
    eps = 1e-9
    target = np.clip(r * bs - 1, eps, K * (1 - eps))
    q = np.full(K, 0.5) if shape is None else np.clip(_np(shape)[:K], 1e-6, 1 - 1e-6)
    logq = np.log(q)
    L = np.cumsum(logq)  # log Q_k: strictly decreasing, < 0
    goal = np.log(target)
    # Start left of the root: sum_k Q_k^t >= K * Q_K^t gives t* >= log(target / K) / log Q_K.
    t = np.maximum((goal - math.log(K)) / L[-1], 0.0)
    for _ in range(50):
        z = t[:, None] * L
        e = np.exp(z - z[:, :1])  # z[:, 0] is the row max: L[0] is the largest log Q
        s = e.sum(1)
        g = z[:, 0] + np.log(s) - goal
        if np.all(np.abs(g) < 1e-10):  # relative error of E[accepted]
            break
        t = np.maximum(t - g / ((e * L).sum(1) / s), 0.0)
    return np.exp(t[:, None] * logq)


class AcceptanceStats:
    """Online per-position acceptance rates from observed (drafted, accepted) pairs.

    Position k (0-based) was *tried* when the request verified more than k drafts and accepted
    the k before it; it was *accepted* when accepted > k. Counting only tried positions keeps cut
    drafts from biasing the rates (a cut position tells nothing). Counts decay per `observe` call
    (one engine step) with the given half-life; each rate is shrunk towards the pooled rate by
    `prior_count` pseudo-tries, so rarely tried late positions borrow strength from the rest.
    """

    def __init__(self, K: int, *, half_life: float = 200.0, prior_rate: float = 0.5,
                 prior_count: float = 2.0) -> None:
        self.K = K
        self._lam = 0.5 ** (1.0 / half_life)
        self.prior_rate, self.prior_count = prior_rate, prior_count
        self.tries = np.zeros(K)
        self.accepts = np.zeros(K)
        self.n_obs = 0  # requests observed (not decayed): tells whether the rates mean anything

    def observe(self, drafted: Sequence[int] | Tensor, accepted: Sequence[int] | Tensor) -> None:
        d = _np(drafted, np.int64).reshape(-1)
        a = np.minimum(_np(accepted, np.int64).reshape(-1), d)
        if d.size == 0:
            return
        k = np.arange(self.K)[None, :]
        tried = (k < d[:, None]) & (k <= a[:, None])
        self.tries = self._lam * self.tries + tried.sum(0)
        self.accepts = self._lam * self.accepts + (k < a[:, None]).sum(0)
        self.n_obs += int((d > 0).sum())

    def rates(self) -> Tensor:
        """[K] conditional acceptance per position (float64)."""
        return torch.from_numpy(self._rates())

    def _rates(self) -> np.ndarray:
        pooled = (self.accepts.sum() + self.prior_count * self.prior_rate) / (
            self.tries.sum() + self.prior_count)
        return (self.accepts + self.prior_count * pooled) / (self.tries + self.prior_count)

    def expected_fraction(self) -> float:
        """Population estimate of the head's target, (E[accepted] + 1) / (K + 1)."""
        return (float(np.cumprod(self._rates()).sum()) + 1) / (self.K + 1)

    def to_dict(self) -> dict[str, Any]:
        return {"K": self.K, "half_life": math.log(0.5) / math.log(self._lam),
                "prior_rate": self.prior_rate, "prior_count": self.prior_count,
                "tries": self.tries.tolist(), "accepts": self.accepts.tolist(), "n_obs": self.n_obs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AcceptanceStats":
        s = cls(d["K"], half_life=d["half_life"], prior_rate=d["prior_rate"],
                prior_count=d["prior_count"])
        s.tries, s.accepts = np.asarray(d["tries"], float), np.asarray(d["accepts"], float)
        s.n_obs = int(d["n_obs"])
        return s


# -- policies -------------------------------------------------------------------------------------


class VerifyPolicy(Protocol):
    name: str

    def lengths(self, pred_r: Pred, K: int, batch_size: int, **kw: Any) -> tuple[list[int], str]:
        """Verify length per request (in [k_min, K]) and a one-line reason for the decision."""
        ...

    def observe(self, drafted: Sequence[int], accepted: Sequence[int]) -> None: ...

    def describe(self) -> str: ...

    def counters(self) -> dict[str, int]: ...


class _Base:
    """Shared bookkeeping: acceptance stats, counters, and the no-prediction fallback.

    Fallback for a request without a head prediction (NaN / None, or pred_r None): once the
    stats have seen `min_obs` requests, use the population estimate (`AcceptanceStats`);
    before that, verify the full draft (what vLLM does without this plug-in). Both are counted.
    """

    name = "base"

    def __init__(self, k_min: int = 1, stats: AcceptanceStats | None = None,
                 min_obs: int = 16) -> None:
        self.k_min = k_min
        self.stats = stats
        self.min_obs = min_obs
        self._counts: Counter[str] = Counter()

    def _stats(self, K: int) -> AcceptanceStats:
        # K is fixed for an engine's life; a different K means different positions: start over.
        if self.stats is None or self.stats.K != K:
            self.stats = AcceptanceStats(K)
        return self.stats

    def observe(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Verification outcome per request of the last step (stats exist from the first
        `lengths` call on, which always precedes a verification)."""
        if self.stats is not None:
            self.stats.observe(drafted, accepted)

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def _resolve(self, pred_r: Pred, K: int, B: int) -> tuple[np.ndarray, np.ndarray]:
        """(r [B] with fallbacks filled in, source [B] of HEAD/POPULATION/FULL)."""
        if pred_r is None:
            r = np.full(B, np.nan)
        elif isinstance(pred_r, (Tensor, np.ndarray)):
            r = _np(pred_r).reshape(-1).copy()
        else:
            r = np.array([np.nan if x is None else x for x in pred_r], dtype=np.float64)
        if len(r) != B:
            raise ValueError(f"{len(r)} predictions for a batch of {B}")
        src = np.where(np.isfinite(r), HEAD, FULL).astype(object)
        stats = self._stats(K)
        if stats.n_obs >= self.min_obs:
            src[src == FULL] = POPULATION
            r[src == POPULATION] = stats.expected_fraction()
        return r, src

    def _count(self, src: np.ndarray, lengths: list[int], K: int) -> str:
        n = Counter(src.tolist())
        self._counts.update({"steps": 1, "requests": len(lengths), "draft_tokens": K * len(lengths),
                             "verified_tokens": sum(lengths)})
        self._counts.update({f"pred_{k}": v for k, v in n.items()})
        return f"{n[HEAD]} head, {n[POPULATION]} population, {n[FULL]} full (no prediction)"


class FixedPolicy(_Base):
    """Verify every drafted token (the length head is not consulted)."""

    name = "fixed"

    def lengths(self, pred_r: Pred, K: int, batch_size: int, **kw: Any) -> tuple[list[int], str]:
        self._stats(K)  # kept up to date for export, though this policy does not use it
        out = [K] * batch_size
        self._counts.update({"steps": 1, "requests": batch_size, "draft_tokens": K * batch_size,
                             "verified_tokens": K * batch_size})
        return out, f"fixed: verify all {K} draft tokens of {batch_size} requests"

    def describe(self) -> str:
        return "verify policy: fixed (every draft token verified)"


class AdaFlashPolicy(_Base):
    """AdaFlash's rule per request. AdaFlash itself turns its head off below 48 running
    requests without saying so; here that is `min_batch` (default 0 = never), and the reason
    names it whenever it applies."""

    name = "adaflash"

    def __init__(self, rho: float = 1.0, k_min: int = 1, *, min_batch: int = 0,
                 stats: AcceptanceStats | None = None, min_obs: int = 16) -> None:
        super().__init__(k_min, stats, min_obs)
        self.rho, self.min_batch = rho, min_batch

    def lengths(self, pred_r: Pred, K: int, batch_size: int, **kw: Any) -> tuple[list[int], str]:
        if batch_size < self.min_batch:
            self._counts.update({"steps": 1, "requests": batch_size, "below_min_batch": 1,
                                 "draft_tokens": K * batch_size, "verified_tokens": K * batch_size})
            return [K] * batch_size, (f"adaflash: B={batch_size} < min_batch {self.min_batch}: "
                                      f"head not used, verify all {K} draft tokens")
        r, src = self._resolve(pred_r, K, batch_size)
        out = adaflash_lengths(np.nan_to_num(r, nan=1.0), K, self.rho, self.k_min)
        out = [K if s == FULL else n for n, s in zip(out, src)]
        known = r[src != FULL]
        mean_r = f"{known.mean():.2f}" if known.size else "n/a"
        return out, (f"adaflash: verify {sum(out)}/{K * batch_size} draft tokens of {batch_size} "
                     f"requests (mean r {mean_r}, rho {self.rho:g}, k_min {self.k_min}; "
                     f"{self._count(src, out, K)})")

    def describe(self) -> str:
        gate = f"; head off below {self.min_batch} requests" if self.min_batch else ""
        return (f"verify policy: adaflash (len = clamp(round(r*K*{self.rho:g}), {self.k_min}, K); "
                f"no prediction -> population rate after {self.min_obs} requests, else full "
                f"draft{gate})")


class BudgetPolicy(_Base):
    """Share the step's verify tokens across requests to maximise expected tokens per second of
    target time (`budget.plan`), with the head's predictions turned into per-position acceptance
    (`position_acceptance`, profile from `AcceptanceStats`). `rho` means what it means in
    AdaFlash's rule (> 1 verifies more): a verified draft token's cost is scaled by 1/rho. With few requests the fixed step cost dominates and every
    token pays; with many the per-token cost does and drafts shrink — no threshold, and the reason
    shows the numbers either way.
    """

    name = "budget"

    def __init__(self, cost_model: StepCostModel, rho: float = 1.0, k_min: int = 1, *,
                 stats: AcceptanceStats | None = None, min_obs: int = 16) -> None:
        super().__init__(k_min, stats, min_obs)
        self.cost_model, self.rho = cost_model, rho

    def lengths(self, pred_r: Pred, K: int, batch_size: int, *, base_tokens: int | None = None,
                p_accept: Tensor | None = None, draft_len: int | None = None,
                **kw: Any) -> tuple[list[int], str]:
        """base_tokens: tokens the next step has besides drafts (default batch_size, one per
        request; add scheduled prefill tokens when known). p_accept [B, K]: per-position
        conditional acceptance if a per-position head provides it; rows with NaN fall back.
        draft_len: the drafts hold only this many of the K tokens (the step gate asked vLLM
        for fewer): positions past it gain nothing."""
        B = batch_size
        if B == 0:
            return [], "budget: empty batch"
        stats = self._stats(K)
        if p_accept is not None:
            p = _np(p_accept).reshape(B, K).copy()
            r, src = self._resolve(np.where(np.isfinite(p).all(-1), 1.0, np.nan), K, B)
        else:
            r, src = self._resolve(pred_r, K, B)
            p = np.empty((B, K))
            use = src == HEAD
            if use.any():
                shape = stats._rates() if stats.n_obs >= self.min_obs else None
                p[use] = _position_acceptance(r[use], K, shape, None)
        rest = src != HEAD
        if rest.any():  # population rows; full rows also need an estimate of what they yield
            p[rest] = stats._rates()[None, :K]
        k_min = np.where(src == FULL, K, min(self.k_min, K))
        if draft_len is not None and draft_len < K:
            p[:, draft_len:] = 0.0
            k_min = np.minimum(k_min, draft_len)
        a = plan(p, B if base_tokens is None else base_tokens, self.cost_model, k_min=k_min, K=K,
                 cost_scale=1.0 / self.rho)
        ms = 1e3
        stop = ("every draft token pays" if a.next_gain is None else
                f"stop: next token's gain {a.next_gain:.3f} tok < its cost "
                f"{a.next_cost_s * ms:.3f} ms x {a.rate / ms:.3f} tok/ms")
        return a.lengths, (
            f"budget: verify {a.tokens}/{a.max_tokens} draft tokens of {B} requests; "
            f"E {a.expected_tokens:.1f} tok in {a.step_s * ms:.1f} ms = {a.rate:.0f} tok/s "
            f"(all: {a.full_expected / a.full_step_s:.0f}, k_min only: "
            f"{a.min_expected / a.min_step_s:.0f}); {stop}; {self._count(src, a.lengths, K)}")

    def describe(self) -> str:
        return (f"verify policy: budget (cost model: {self.cost_model.describe()}, refreshed "
                f"online; objective tokens/s, rho {self.rho:g}, k_min {self.k_min})")


def make_policy(cfg_length_head: Any, cost_model: StepCostModel | None = None, *,
                stats: AcceptanceStats | None = None) -> VerifyPolicy:
    """Policy for `OnlineSpecConfig.length_head` (anything with .policy, .rho, .k_min)."""
    kind, rho, k_min = cfg_length_head.policy, cfg_length_head.rho, cfg_length_head.k_min
    if kind == "fixed":
        return FixedPolicy(k_min, stats)
    if kind == "adaflash":
        return AdaFlashPolicy(rho, k_min, stats=stats)
    if kind == "budget":
        return BudgetPolicy(cost_model or StepCostModel(), rho, k_min, stats=stats)
    raise ValueError(f"unknown verify policy {kind!r} (fixed, adaflash, budget)")


__all__ = ["AcceptanceStats", "AdaFlashPolicy", "BudgetPolicy", "FixedPolicy", "VerifyPolicy",
           "adaflash_lengths", "make_policy", "position_acceptance", "HEAD", "POPULATION", "FULL"]
