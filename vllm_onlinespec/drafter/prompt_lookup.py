"""Prompt lookup: the second proposer beside the DFlash drafter (pure functions, no vLLM).

A request's own text often predicts what follows: code repeats identifiers, answers quote the
question, lists repeat their scaffolding. `propose` is vLLM's ngram rule (v1/spec_decode/
ngram_proposer.py): the longest n in [min_n, max_n] whose last n tokens occur earlier, at the
earliest such occurrence, and the <= k tokens after it. `choose_drafts` is the hybrid rule that
serving applies after the drafter has run: a request whose lookup proposal is long enough
verifies it instead of the drafter's block; every other request keeps the drafter's (cut) block.
Measured offline on held-out greedy answers (lab/hybrid_ceiling.py): 2.29 tokens per
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
                  caps: Sequence[int], min_tokens: int | None | Sequence[int | None]
                  ) -> HybridChoice:
    """Per request: its lookup proposal cut to `caps[i]` (the draft length the step allowed it,
    0 = no drafting) if that leaves at least `min_tokens` tokens (None: all of caps[i]; a
    sequence: per request), else the drafter's block unchanged. Either is a proposal the target
    verifies in full: lossless."""
    needs = list(min_tokens) if isinstance(min_tokens, Sequence) else [min_tokens] * len(caps)
    drafts, used = [], []
    for d, p, cap, need in zip(drafter, lookup, caps, needs):
        p = list(p[:cap])
        need = cap if need is None else need
        ok = cap > 0 and len(p) >= max(1, need)
        drafts.append(p if ok else list(d))
        used.append(ok)
    return HybridChoice(drafts, used)


class RecentText:
    """The token ids of recently finished requests, searched where a request's own text has no
    match: lookup across requests (SuffixDecoding's idea, arXiv 2411.04975, with vLLM's ngram
    rule). Answers of one domain share their scaffolding ("Let's break it down", "So the total
    is", units, the format of a sum), which no single request's text holds before it writes it.

    A bounded FIFO of whole texts (oldest dropped first) joined by a separator no token equals,
    indexed by its `min_n`-grams. `propose` takes the occurrence whose match with the history's
    suffix is longest (up to `max_n`), the latest on a tie, and the <= k tokens after it, never
    across a separator. What this learns is only which text was served: no weights, no
    gradient, nothing the target does not verify.
    """

    SEP = -1

    def __init__(self, max_tokens: int, min_n: int = 3, max_n: int = 8,
                 max_candidates: int = 32):
        if max_tokens < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"RecentText: want max_tokens >= 1 and 1 <= min_n <= max_n, got "
                             f"{max_tokens}, {min_n}, {max_n}")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self.max_candidates = max_candidates  # the latest occurrences of a frequent n-gram only
        self._texts: list[np.ndarray] = []
        self._flat = np.zeros(0, dtype=np.int64)
        self._index: dict[tuple[int, ...], list[int]] = {}

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self._texts)

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """A finished request's text (kept whole; the oldest texts go past max_tokens)."""
        t = np.asarray(tokens, dtype=np.int64)[-self.max_tokens:]
        if t.size < self.min_n + 1:
            return
        self._texts.append(t)
        while self.tokens > self.max_tokens:
            self._texts.pop(0)
        # Rebuilt whole at each finished request (a few ms for 4k tokens), not per step.
        sep = np.array([self.SEP], dtype=np.int64)
        self._flat = np.concatenate([x for t in self._texts for x in (t, sep)])
        flat, n = self._flat.tolist(), self.min_n
        index: dict[tuple[int, ...], list[int]] = {}
        for end, key in enumerate(zip(*(flat[i:] for i in range(n))), start=n - 1):
            index.setdefault(key, []).append(end)  # end: the n-gram's last position
        self._index = index

    def propose(self, history: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """<= k tokens that followed the longest match of the history's suffix (>= min_n
        tokens) in the recent texts; [] where none matches or k <= 0."""
        h = np.asarray(history)
        n = self.min_n
        if k <= 0 or h.shape[0] < n:
            return []
        ends = self._index.get(tuple(int(x) for x in h[-n:]))
        if not ends:
            return []
        best_end, best_len = -1, 0
        tail = h[-self.max_n:][::-1].tolist()  # the history backwards from its last token
        flat = self._flat
        for end in reversed(ends[-self.max_candidates:]):  # latest first: wins ties
            m = n
            while m < len(tail) and end - m >= 0 and flat[end - m] == tail[m]:
                m += 1
            if m > best_len:
                best_end, best_len = end, m
        out = flat[best_end + 1: best_end + 1 + k].tolist()
        return out[: out.index(self.SEP)] if self.SEP in out else out
