"""Benchmark-only oracle verification: accept each request's draft up to a sampled length whose
mean matches a configured acceptance length, at the real cost of drafting and verifying.

vLLM's own version (`rejection_sample_method: "synthetic"`) is refused on CPU ("Synthetic
acceptance not supported with CPU sampling"); this one rewrites the rejection sampler's output
after it ran, so the target forward, the sampler and the drafter all do their normal work and
only the accepted lengths (and so the tokens) are forced. THE OUTPUT IS NOT THE TARGET'S:
config validation refuses it without an explicit environment switch (config.ORACLE_ENV).

Acceptance model: every draft position is accepted with the same conditional rate r, stopping
at the first rejection, so E[accept length] = 1 + r + r^2 + ... + r^K; r is solved for the
configured length (r = 1 at K + 1: every draft accepted).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm_onlinespec")


def expected_accept_len(rate: float, k: int) -> float:
    return 1.0 + sum(rate ** j for j in range(1, k + 1))


def conditional_rate(accept_len: float, k: int) -> float:
    """The per-position acceptance rate r with expected_accept_len(r, k) == accept_len."""
    if not 1.0 <= accept_len <= k + 1:
        raise ValueError(f"oracle accept length must be in [1, K + 1 = {k + 1}] (got {accept_len})")
    if accept_len >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: expected_accept_len is increasing in r
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accept_len(mid, k) < accept_len else (lo, mid)
    return (lo + hi) / 2


def draw_accepted(rate: float, num_draft: list[int], rng: np.random.Generator) -> list[int]:
    """Accepted drafts per request: the index of the first rejection, capped at its draft."""
    out = []
    for d in num_draft:
        if d <= 0:
            out.append(0)
            continue
        reject = rng.random(d) >= rate
        out.append(int(np.argmax(reject)) if reject.any() else d)
    return out


class OracleVerifier:
    def __init__(self, accept_len: float, k: int, seed: int = 0) -> None:
        self.accept_len = float(accept_len)
        self.rate = conditional_rate(self.accept_len, k)
        self.rng = np.random.default_rng(seed)
        self.steps = 0
        logger.warning("onlinespec: ORACLE verification on (benchmark only): drafts are accepted "
                       "to a mean length of %.2f per step (rate %.3f per position) whatever the "
                       "target says; the OUTPUT IS NOT THE TARGET'S", self.accept_len, self.rate)

    def force(self, sampled: torch.Tensor, logits: torch.Tensor, metadata: Any) -> None:
        """Rewrite `sampled` [B, K+1] in place: drafts accepted up to the drawn length, then the
        target's most likely token at the next position (the bonus when all were accepted)."""
        num_draft = [int(n) for n in metadata.num_draft_tokens]
        draft_ids = metadata.draft_token_ids.tolist()
        target_rows = metadata.target_logits_indices.tolist()
        bonus_rows = metadata.bonus_logits_indices.tolist()
        accepted = draw_accepted(self.rate, num_draft, self.rng)
        start = 0
        for i, (d, a) in enumerate(zip(num_draft, accepted)):
            if d > 0:
                row = target_rows[start + a] if a < d else bonus_rows[i]
                sampled[i, :a] = torch.tensor(draft_ids[start:start + a], dtype=sampled.dtype)
                sampled[i, a] = int(logits[row].argmax())
                sampled[i, a + 1:] = -1
            start += d
        self.steps += 1
