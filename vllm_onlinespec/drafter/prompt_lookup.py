"""Prompt lookup: the second proposer beside the DFlash drafter (pure functions, no vLLM).

A request's own text often predicts what follows: code repeats identifiers, answers quote the
question, lists repeat their scaffolding. `propose` is vLLM's ngram rule (v1/spec_decode/
ngram_proposer.py): the longest n in [min_n, max_n] whose last n tokens occur earlier, at the
earliest such occurrence, and the <= k tokens after it. `choose_drafts` is the hybrid rule that
serving applies after the drafter has run: a request whose lookup proposal is long enough
verifies it instead of the drafter's block; every other request keeps the drafter's (cut) block.
Measured offline on held-out greedy answers (benchmarks/hybrid_ceiling.py): 2.29 tokens per
verify step against 1.44 for the drafter alone and 1.84 for lookup alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The <= k tokens that followed the earliest earlier occurrence of the longest recurring
    suffix n-gram (n in [min_n, max_n]); [] when no suffix of min_n tokens recurs or k <= 0."""
    # vLLM's token rows are int32 arrays: compare them as they are (no copy per step).
    t = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    n_len = int(t.shape[0])
    if k <= 0:
        return []
    for n in range(min(max_n, n_len - 1), min_n - 1, -1):
        # Windows starting at 0 .. n_len - n - 1: every occurrence but the suffix itself.
        windows = sliding_window_view(t[: n_len - 1], n)
        hits = np.flatnonzero((windows == t[n_len - n:]).all(axis=1))
        if hits.size:
            j = int(hits[0]) + n
            return t[j:j + k].tolist()
    return []


@dataclass
class HybridChoice:
    """One step's drafts after the hybrid rule, and which rows came from prompt lookup."""

    drafts: list[list[int]]
    from_lookup: list[bool]

    @property
    def lookup_rows(self) -> int:
        return sum(self.from_lookup)


def choose_drafts(drafter: Sequence[list[int]], lookup: Sequence[list[int]],
                  caps: Sequence[int], min_tokens: int | None) -> HybridChoice:
    """Per request: its lookup proposal cut to `caps[i]` (the draft length the step allowed it,
    0 = no drafting) if that leaves at least `min_tokens` tokens (None: all of caps[i]), else the
    drafter's block unchanged. Either is a proposal the target verifies in full: lossless."""
    drafts, used = [], []
    for d, p, cap in zip(drafter, lookup, caps):
        p = list(p[:cap])
        need = cap if min_tokens is None else min_tokens
        ok = cap > 0 and len(p) >= max(1, need)
        drafts.append(p if ok else list(d))
        used.append(ok)
    return HybridChoice(drafts, used)
