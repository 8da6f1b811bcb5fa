"""Batch verification budget: how many draft tokens the next target step should verify.

How the serving layer uses it (core module: no vLLM import):

* After every target step the worker measures that step's wall time and its total scheduled
  token count and calls `cost_model.observe(n_tokens, seconds)`. The model refreshes itself
  online with exponential forgetting, so it follows load, thermal and batch-shape changes.
* Before the drafts go to the verifier (`take_draft_token_ids`), the verify policy
  (`verify_length.BudgetPolicy`) turns the length head's predictions into per-position acceptance
  probabilities and calls `plan`/`allocate` here; each request's draft is cut to the returned
  length (a request whose draft is already shorter simply keeps all of it).

The objective is the batch's expected generated tokens per second of target time; see `plan`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

try:  # torch is optional here: the allocator works on numpy, tensors are converted on entry
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


# -- step cost model ------------------------------------------------------------------------------


class StepCostModel:
    """Target step latency as a function of the step's token count:

        t(n) = a + b * n + c * max(0, n - knee)          (c-term only when `knee` is set)

    `a` is the fixed cost of a step (weights streamed once, launch and scheduling overhead), `b`
    the cost of one more token, `c` the extra slope once the step turns compute-bound past the
    knee. All three are constrained to be >= 0: a step never gets cheaper with more tokens, and a
    noisy fit that said so would make the allocator verify everything for free.

    Fitting is exponentially weighted least squares on decayed sufficient statistics (X'WX, X'Wy),
    plus a weak ridge pull towards the prior (a0, b0, c0) so that directions the data does not
    excite (e.g. a long run of equal-sized steps says nothing about b) stay at the prior instead
    of drifting (no RLS "wind-up"). The non-negativity constraint is solved exactly (the problem
    has <= 3 unknowns: every active set is tried). Outliers (a GC pause, a preempted core) are
    Huber-clipped against a running residual scale before they enter the statistics.

    Features are scaled by `n_scale` tokens so one `prior_weight` means "this many samples' worth
    of evidence" for the slope as for the intercept. It is small on purpose: the prior only has to
    decide what the data leaves open; 1 already biased a knee fit by 25 % in a test.
    """

    WARMUP = 8  # samples before residual clipping starts: the early fit is still the prior

    def __init__(self, a: float = 0.02, b: float = 5e-4, *, c: float = 0.0, knee: int | None = None,
                 half_life: float | None = 500.0, prior_weight: float = 0.01,
                 n_scale: float | None = None, outlier_k: float = 4.0) -> None:
        if min(a, b, c) < 0:
            raise ValueError("cost prior (a, b, c) must be >= 0")
        if half_life is not None and half_life <= 0:
            raise ValueError("half_life must be > 0 samples (None = no forgetting)")
        # The default prior (20 ms + 0.5 ms/token) is a small CPU box's order of magnitude; it
        # only matters until the first few steps are measured.
        self.knee = knee
        self.half_life = half_life
        self.prior_weight = float(prior_weight)
        self.n_scale = float(n_scale or knee or 256)
        self.outlier_k = float(outlier_k)
        self._lam = 1.0 if half_life is None else 0.5 ** (1.0 / half_life)
        p = 3 if knee is not None else 2
        self._prior = np.array([a, b * self.n_scale, c * self.n_scale][:p], dtype=np.float64)
        self._S = np.zeros((p, p))
        self._r = np.zeros(p)
        self._theta = self._prior.copy()
        self._scale = 0.0  # running robust scale of residuals, seconds
        self.n_samples = 0

    # -- parameters ---------------------------------------------------------------------------
    @property
    def a(self) -> float:
        return float(self._theta[0])

    @property
    def b(self) -> float:
        return float(self._theta[1]) / self.n_scale

    @property
    def c(self) -> float:
        return float(self._theta[2]) / self.n_scale if self.knee is not None else 0.0

    def _x(self, n: np.ndarray | float) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        cols = [np.ones_like(n), n / self.n_scale]
        if self.knee is not None:
            cols.append(np.maximum(n - self.knee, 0.0) / self.n_scale)
        return np.stack(cols, axis=-1)

    def predict(self, n: Any) -> Any:
        """t(n) in seconds; `n` scalar or array (returns the same kind)."""
        out = self._x(n) @ self._theta
        return float(out) if np.ndim(out) == 0 else out

    def marginal_cost(self, n: Any) -> Any:
        """t(n + 1) - t(n): the latency one more token adds to a step that already has n."""
        n = np.asarray(n, dtype=np.float64)
        out = self.predict(n + 1) - self.predict(n)
        return float(out) if np.ndim(out) == 0 else out

    # -- learning -----------------------------------------------------------------------------
    def observe(self, n_tokens: int, seconds: float) -> None:
        """One measured target step. Cheap (a few microseconds plus one <= 3x3 solve)."""
        if not (math.isfinite(seconds) and seconds >= 0 and n_tokens >= 0):
            return  # a broken timer must not poison the model
        x = self._x(float(n_tokens))
        y = float(seconds)
        res = y - float(x @ self._theta)
        if self.n_samples >= self.WARMUP and self._scale > 0:
            lim = self.outlier_k * self._scale
            res_c = max(-lim, min(lim, res))
            y = y - res + res_c
        else:
            res_c = res
        # The scale adapts faster than the fit: after a real level shift every residual is
        # clipped, the scale grows ~15 % per sample and the fit catches up within tens of steps.
        self._scale = 0.95 * self._scale + 0.05 * abs(res_c) if self.n_samples else abs(res)
        self._S = self._lam * self._S + np.outer(x, x)
        self._r = self._lam * self._r + x * y
        self.n_samples += 1
        self._solve()

    def fit(self, samples: Iterable[tuple[int, float]], huber_iters: int = 10) -> "StepCostModel":
        """Batch fit from (n_tokens, seconds) pairs, replacing the online statistics. All samples
        weigh the same (no forgetting); outliers are down-weighted by a few Huber IRLS rounds."""
        data = np.asarray([(n, s) for n, s in samples if math.isfinite(s)], dtype=np.float64)
        if data.size == 0:
            return self
        X, y = self._x(data[:, 0]), data[:, 1]
        w = np.ones(len(y))
        for _ in range(huber_iters + 1):
            self._S = (X * w[:, None]).T @ X
            self._r = (X * w[:, None]).T @ y
            self._solve()
            res = y - X @ self._theta
            self._scale = 1.4826 * float(np.median(np.abs(res))) + 1e-12
            lim = self.outlier_k * self._scale
            w = np.minimum(1.0, lim / np.maximum(np.abs(res), 1e-300))
        self.n_samples = len(y)
        return self

    def _solve(self) -> None:
        """argmin_{theta >= 0} sum w (y - x theta)^2 + prior_weight |theta - prior|^2, exactly."""
        p = len(self._prior)
        A = self._S + self.prior_weight * np.eye(p)
        h = self._r + self.prior_weight * self._prior
        sol = np.linalg.solve(A, h)  # A is positive definite (ridge)
        if (sol >= 0).all():  # convex problem: a feasible unconstrained optimum is the optimum
            self._theta = sol
            return
        best, best_j = np.zeros(p), 0.0  # theta = 0 is always feasible, J(0) = 0
        for k in range(1, p):  # otherwise try every proper active set
            for free in itertools.combinations(range(p), k):
                idx = list(free)
                sub = np.linalg.solve(A[np.ix_(idx, idx)], h[idx])
                if (sub < 0).any():
                    continue
                th = np.zeros(p)
                th[idx] = sub
                j = float(th @ A @ th - 2 * th @ h)
                if j < best_j:
                    best, best_j = th, j
        self._theta = best

    # -- reporting ------------------------------------------------------------------------------
    def describe(self) -> str:
        s = f"{self.a * 1e3:.1f} ms + {self.b * 1e3:.2f} ms/token"
        if self.knee is not None:
            s += f" (+{self.c * 1e3:.2f} ms/token above {self.knee})"
        return s + (f", {self.n_samples} samples" if self.n_samples else ", prior only")

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "c": self.c, "knee": self.knee,
                "half_life": self.half_life, "prior_weight": self.prior_weight,
                "n_scale": self.n_scale, "outlier_k": self.outlier_k,
                "prior": self._prior.tolist(), "S": self._S.tolist(), "r": self._r.tolist(),
                "scale": self._scale, "n_samples": self.n_samples}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepCostModel":
        """Inverse of `to_dict`; a bare {"a", "b"[, "c", "knee", ...]} dict gives a prior."""
        m = cls(d["a"], d["b"], c=d.get("c", 0.0), knee=d.get("knee"),
                half_life=d.get("half_life", 500.0), prior_weight=d.get("prior_weight", 0.01),
                n_scale=d.get("n_scale"), outlier_k=d.get("outlier_k", 4.0))
        if "S" in d:
            m._prior = np.asarray(d["prior"], dtype=np.float64)
            m._S = np.asarray(d["S"], dtype=np.float64)
            m._r = np.asarray(d["r"], dtype=np.float64)
            m._scale = float(d.get("scale", 0.0))
            m.n_samples = int(d.get("n_samples", 0))
            m._solve()
        return m


# -- allocation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Allocation:
    """One step's verify plan and the numbers behind it (for the policy's reason string)."""
    lengths: list[int]
    tokens: int               # draft tokens verified
    max_tokens: int           # draft tokens available (sum over requests of K)
    expected_tokens: float    # E[tokens this step yields]: base yield + expected accepted drafts
    step_s: float             # predicted step time with this plan (draft time x cost_scale)
    min_expected: float       # same two numbers with only the forced (k_min) tokens ...
    min_step_s: float
    full_expected: float      # ... and with every draft token verified
    full_step_s: float
    next_gain: float | None   # expected acceptance of the best token left out (None = none left)
    next_cost_s: float        # what that token would have added to the step

    @property
    def rate(self) -> float:
        return self.expected_tokens / self.step_s if self.step_s > 0 else math.inf


def _as_numpy(p: Any) -> np.ndarray:
    if torch is not None and isinstance(p, torch.Tensor):
        p = p.detach().to("cpu", torch.float64).numpy()
    return np.asarray(p, dtype=np.float64)


def plan(p_accept: Any, base_tokens: int, cost_model: StepCostModel, *,
         k_min: int | Sequence[int] = 1, K: int | None = None, base_yield: float | None = None,
         value_per_token_s: float | None = None, cost_scale: float = 1.0,
         extra_s: float = 0.0) -> Allocation:
    """Choose how many of each request's K draft tokens to verify in the next step.

    p_accept [B, K]: p[i, k] = P(draft token k of request i is accepted | tokens < k were).
    base_tokens: tokens already in the step before any draft (B verified-first tokens + prefill).
    base_yield: tokens the step yields for sure (default B: each request's bonus/corrected token).
    k_min: per-request floor (int or one per request; clamped to K). cost_scale (config `rho`)
    multiplies the time drafts add; > 1 cuts harder (costs the model does not see, e.g. KV).
    extra_s: seconds the step costs besides the target's forward whatever is verified (the
    drafter's forward, measured overhead): it dilutes each token's cost, so more pays.

    Value model. Request i's token k is accepted with probability g[i, k] = prod_{j<=k} p[i, j]
    (drafts are accepted as a prefix), so verifying it adds g[i, k] expected tokens; the step
    yields E = base_yield + sum of the chosen g's and takes T = t(base_tokens + #chosen). Every
    request in the batch waits for the same step, so each request's rate is (E_i + 1) / T and the
    batch's is E / T. Steps repeat, so by the renewal-reward theorem long-run throughput is
    E[tokens per step] / E[time per step]: maximise E / T for the next step.

    Why the search below is exact. T depends only on how many tokens are chosen, m. For a fixed m
    the best choice maximises E, i.e. takes the m largest gains. That set is a valid plan
    (a prefix of every draft) because g[i, k] never increases along k (a product of
    probabilities); with ties, its per-request counts give prefixes with the same total. So the
    optimum is max over m = 0..M of (E_0 + S_m) / T(m), S_m the sum of the m largest gains: one
    sort, one cumulative sum, one argmax — exact for any cost t(n) that depends on the total
    only, O(BK log BK).

    It is also the greedy rule "add the next-best token while (E + g) / (T + c) > E / T", i.e.
    while g > c * E / T, c = marginal cost: (E + g) / (T + c) is a mediant of E / T and g / c,
    so adding helps iff g / c beats the current rate. With non-increasing gains and marginal
    costs that never fall (linear cost, or the convex knee), once g_{m+1} <= c_{m+1} E_m / T_m
    the new rate E_{m+1} / T_{m+1} >= g_{m+1} / c_{m+1} >= g_{m+2} / c_{m+2}, so no later token
    can help either: the greedy stop is the global optimum (the tests check both).

    value_per_token_s: instead of tokens/s, value each accepted token at this many seconds and
    maximise value * S_m - added time (same exactness argument).
    """
    p = np.clip(_as_numpy(p_accept), 0.0, 1.0)
    if p.ndim != 2:
        raise ValueError(f"p_accept must be [B, K] (got shape {p.shape})")
    B = p.shape[0]
    K = p.shape[1] if K is None else int(K)
    if K > p.shape[1] or K < 0:
        raise ValueError(f"K={K} but p_accept has {p.shape[1]} positions")
    p = p[:, :K]
    kmin = np.clip(np.broadcast_to(np.asarray(k_min, dtype=np.int64), (B,)), 0, K)
    g = np.cumprod(p, axis=1)
    cols = np.arange(K)[None, :]
    forced = cols < kmin[:, None]
    n_forced = int(kmin.sum())
    e0 = (float(B) if base_yield is None else float(base_yield)) + float(g[forced].sum())

    cand = ~forced
    cand_rows = np.nonzero(cand)[0]
    cand_g = g[cand]
    desc = -np.sort(-cand_g)
    S = np.concatenate([[0.0], np.cumsum(desc)])
    m_all = np.arange(len(S), dtype=np.float64)
    t_base = cost_model.predict(float(base_tokens))
    added = cost_model.predict(base_tokens + n_forced + m_all) - t_base
    T = np.maximum(t_base + extra_s + cost_scale * added, 1e-12)
    if value_per_token_s is None:
        score = (e0 + S) / T
    else:
        score = value_per_token_s * S - cost_scale * added
    # Smallest m within rounding of the best: a zero-gain token must not win on float noise.
    best = score.max()
    m = int(np.argmax(score >= best - 1e-12 * max(1.0, abs(best))))

    # Take the m largest gains. Only the count per request matters: within a request gains never
    # increase along k, so "its c largest" and "its first c" have the same total (ties included).
    chosen = np.zeros(len(cand_g), dtype=bool)
    if m:
        thr = desc[m - 1]
        chosen = cand_g > thr
        ties = np.flatnonzero(cand_g == thr)[: m - int(chosen.sum())]
        chosen[ties] = True
    lengths = kmin + np.bincount(cand_rows[chosen], minlength=B)
    M = len(desc)
    return Allocation(
        lengths=lengths.astype(int).tolist(), tokens=int(lengths.sum()), max_tokens=B * K,
        expected_tokens=float(e0 + S[m]), step_s=float(T[m]),
        min_expected=float(e0), min_step_s=float(T[0]),
        full_expected=float(e0 + S[M]), full_step_s=float(T[M]),
        next_gain=float(desc[m]) if m < M else None,
        next_cost_s=float(T[m + 1] - T[m]) if m < M else 0.0)


def allocate(p_accept: Any, base_tokens: int, cost_model: StepCostModel,
             value_per_token_s: float | None = None, k_min: int | Sequence[int] = 1,
             K: int | None = None, **kw: Any) -> list[int]:
    """Per-request verify lengths maximising expected tokens per second; see `plan`."""
    return plan(p_accept, base_tokens, cost_model, k_min=k_min, K=K,
                value_per_token_s=value_per_token_s, **kw).lengths
