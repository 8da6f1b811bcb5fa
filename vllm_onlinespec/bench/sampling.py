"""Does a speculative engine sample from the target's distribution? A goodness-of-fit check.

Many requests of one prompt, each with its own seed, generate two tokens. The first comes from
vLLM's plain sampler (prefill), the second from the rejection sampler (the draft verified after
prefill). Under the target, P(t1, t2) = p(t1) * p(t2 | t1) with vLLM's temperature / top_k /
top_p filtering; the observed pairs are binned (every pair expected >= 5 times, the rest in one
bin) and compared with Pearson's chi-square, in the spirit of vLLM's
`test_rejection_sampling_approximates_target_distribution`. The most likely pair also gets a
z-score, which is what a sampler that ignores temperature (draws the argmax) blows up.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class SamplingParamsSpec:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off (vLLM's -1 / 0)
    top_p: float = 1.0

    def label(self) -> str:
        parts = [f"T={self.temperature:g}"]
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.top_p < 1:
            parts.append(f"top_p={self.top_p:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class FitResult:
    n: int  # observed pairs
    bins: int
    chi2: float
    df: int
    p_value: float
    top_pair: tuple[int, int]
    top_expected: float
    top_observed: int
    z_top: float  # (observed - expected) / sd of the most likely pair's count

    def summary(self) -> str:
        return (f"chi2 {self.chi2:.1f} on {self.df} df (p = {self.p_value:.3g}), most likely "
                f"pair {self.top_observed} vs {self.top_expected:.1f} expected (z = {self.z_top:+.2f}), "
                f"n = {self.n}")


def filtered_probs(logits: torch.Tensor, spec: SamplingParamsSpec) -> torch.Tensor:
    """Probabilities the way vLLM's sampler forms them (sampler/ops/topk_topp_sampler.py):
    logits / T, then top_k, then top_p on the sorted probabilities, at least one token kept."""
    x = logits.double() / spec.temperature
    srt, idx = x.sort(descending=False)
    V = srt.shape[-1]
    if spec.top_k and spec.top_k < V:
        kth = srt[..., V - spec.top_k:V - spec.top_k + 1]  # keep the dim: rows broadcast
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if spec.top_p < 1:
        p = srt.softmax(-1)
        cum = p.cumsum(-1)
        drop = cum <= 1 - spec.top_p
        drop[..., -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    out = torch.full_like(x, float("-inf")).scatter(-1, idx, srt)
    return out.softmax(-1)


@torch.no_grad()
def pair_probabilities(model, prompt_ids: list[int], spec: SamplingParamsSpec, n: int,
                       min_expected: float = 5.0) -> dict[tuple[int, int], float]:
    """P(t1, t2) under the target for every pair that can reach `min_expected` in n draws."""
    ids = torch.tensor([prompt_ids])
    p1 = filtered_probs(model(ids).logits[0, -1].float(), spec)
    firsts = [int(t) for t in torch.nonzero(p1 * n >= min_expected).flatten()]
    if not firsts:
        return {}
    batch = torch.tensor([prompt_ids + [t] for t in firsts])
    p2 = filtered_probs(model(batch).logits[:, -1].float(), spec)
    out = {}
    for row, t1 in enumerate(firsts):
        for t2 in torch.nonzero(p1[t1] * p2[row] * n >= min_expected).flatten().tolist():
            out[(t1, int(t2))] = float(p1[t1] * p2[row, t2])
    return out


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def goodness_of_fit(pairs: Iterable[tuple[int, int]], expected: dict[tuple[int, int], float],
                    min_expected: float = 5.0) -> FitResult:
    """Pearson chi-square of observed pairs against `expected` probabilities (plus one 'other'
    bin for the mass outside them, merged into the smallest bin when it is too thin)."""
    seen = Counter(pairs)
    n = sum(seen.values())
    if n == 0 or not expected:
        raise ValueError("no observations or no expected pairs to test against")
    keys = sorted(expected, key=expected.get, reverse=True)
    obs = [seen.get(k, 0) for k in keys]
    exp = [n * expected[k] for k in keys]
    other_obs, other_exp = n - sum(obs), n * max(0.0, 1.0 - sum(expected.values()))
    if other_exp >= min_expected:
        obs.append(other_obs)
        exp.append(other_exp)
    else:
        obs[-1] += other_obs
        exp[-1] += other_exp
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = max(1, len(obs) - 1)
    top = keys[0]
    e_top, p_top = n * expected[top], expected[top]
    z = (seen.get(top, 0) - e_top) / math.sqrt(max(1e-12, n * p_top * (1 - p_top)))
    return FitResult(n=n, bins=len(obs), chi2=chi2, df=df, p_value=chi2_sf(chi2, df),
                     top_pair=top, top_expected=e_top, top_observed=seen.get(top, 0), z_top=z)
