"""Suffix-tree lookup: SuffixDecoding's trees (arXiv 2411.04975, arctic-inference's C++ cache,
the one vLLM's `method: "suffix"` uses) as the lookup source beside the DFlash drafter.

Per active request a tree over its own text (prompt + output so far) and one global tree over
recently finished requests' outputs; a proposal is the most frequent continuation of the
longest suffix match, as long as each token's estimated probability stays above
`min_token_prob` and the draft stays within `max_spec_factor` x the match length. Its `score`
(the sum of those probabilities, about the tokens it expects to be accepted) is what the hybrid
rule compares with a threshold: the tree where it is confident, the drafter elsewhere.

Core module: numpy and arctic-inference only (imported lazily, with a one-line error naming
the installer when it is missing), no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

NEEDS = ("needs arctic_inference.suffix_decoding: run `python -m vllm_onlinespec.suffix_install` "
         "(`make setup` does)")
INSTALL_HINT = f"prompt_lookup.source 'suffix_tree' {NEEDS}"


def suffix_cache_class():
    """arctic-inference's SuffixDecodingCache, or a one-line ImportError naming the installer."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return SuffixDecodingCache


def require_suffix_decoding(what: str) -> None:
    """A one-line error naming `what` and the installer when arctic-inference is missing."""
    try:
        suffix_cache_class()
    except ImportError:
        raise ValueError(f"{what}: vLLM's suffix decoding {NEEDS}") from None


@dataclass(frozen=True)
class TreeDraft:
    tokens: list[int]
    score: float  # sum of the tokens' estimated probabilities (expected accepted tokens)
    # Per token, the estimated probability that the draft is still right there (cumulative,
    # non-increasing): what the budget prices a tree draft's tokens by (policy/lookup_price.py).
    probs: tuple[float, ...] = ()


class SuffixTreeLookup:
    """Requests' texts fed incrementally into a SuffixDecodingCache; `propose` per step.

    A request is started the first time it is seen, with the text it has then (its prompt and
    whatever prefill committed), and each later call appends what it gained since. `finish`
    stops it: its output stays in the global tree for later requests (up to
    `max_cached_requests`, oldest evicted first).
    """

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if max_depth < 1 or max_cached_requests < 0 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("SuffixTreeLookup: want max_depth >= 1, max_cached_requests >= 0, "
                             "max_spec_factor > 0 and 0 <= min_token_prob <= 1")
        self.max_depth, self.max_spec_factor = max_depth, max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = suffix_cache_class()(max_tree_depth=max_depth,
                                          max_cached_requests=max_cached_requests)
        self._fed: dict[str, int] = {}  # tokens of each active request already in its tree

    def _sync(self, req_id: str, text: np.ndarray) -> None:
        n = self._fed.get(req_id)
        if n is None:
            if req_id in self.cache.cached_requests:  # a reused id: forget the old output
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, text)
        elif len(text) > n:
            self.cache.add_active_response(req_id, np.ascontiguousarray(text[n:]))
        self._fed[req_id] = len(text)

    def propose(self, req_id: str, history: Sequence[int] | np.ndarray, k: int) -> TreeDraft:
        """<= k tokens continuing `history` (the request's whole committed text)."""
        text = np.ascontiguousarray(np.asarray(history), dtype=np.int32)
        self._sync(req_id, text)
        if k <= 0 or len(text) == 0:
            return TreeDraft([], 0.0)
        d = self.cache.speculate(req_id, text[-self.max_depth:], max_spec_tokens=k,
                                 max_spec_factor=self.max_spec_factor,
                                 min_token_prob=self.min_token_prob)
        return TreeDraft([int(t) for t in d.token_ids], float(d.score),
                         tuple(float(x) for x in d.probs))

    def finish(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            if self._fed.pop(rid, None) is not None:
                self.cache.stop_request(rid)

    @property
    def active(self) -> int:
        return len(self._fed)
