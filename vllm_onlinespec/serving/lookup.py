"""The lookup stage: a second proposer beside the DFlash drafter, applied after vLLM drafts.

    drafter's (cut) blocks + each request's text --source--> proposals --hybrid rule--> drafts

Sources (config `prompt_lookup.source`):
  ngram        vLLM's ngram rule on the request's own text (drafter/prompt_lookup.propose),
               then recently finished requests' text (prompt_lookup.RecentText) where the own
               text proposes fewer than K; a proposal replaces the drafter's block when it
               fills `min_tokens` (default K)
  suffix_tree  SuffixDecoding's trees over the request's text and finished outputs
               (drafter/suffix_tree.py); its draft replaces the drafter's block where its score
               (expected accepted tokens) reaches `suffix_min_score`
Seeded requests under vLLM's rejection sampling use their own text only (the ngram rule): a
draft that depends on what else was served would change how rejection sampling spends the
seed's random numbers. Under drafter-invariant verification (sampling.invariant) they take
every source like the others.

Under the budget policy a tree draft is priced like the drafter's blocks: each token's
acceptance is the tree's own estimate, calibrated from verification, and the step verifies the
prefix that raises expected tokens per second (policy/lookup_price.py); the ngram rule's drafts
carry no estimate and are verified whole.

Either way the target verifies what is proposed: lossless. The stage counts what it drafted
and what was accepted, apart from the drafter's rows (the verify-length policy and the length
head score only the drafter's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_onlinespec.config import PromptLookupConfig
from vllm_onlinespec.drafter import prompt_lookup
from vllm_onlinespec.policy.lookup_price import (LookupCalibration, StepPrice,
                                                 conditional_acceptance, price_drafts)


@dataclass
class Proposals:
    """One step's lookup proposals, per request of the batch (in the drafts' order)."""

    req_ids: list[str]
    tokens: list[list[int]]
    need: list[int | None]  # tokens a proposal must fill to be taken (None: the step's cap)
    from_recent: set[int]  # rows proposed from other requests' text (ngram source)
    probs: list[tuple[float, ...]]  # the tree's cumulative estimates per token (() = none)
    # Tree drafts below suffix_min_score, per row ([] = none): taken only where the drafter
    # has no block for the request (the `weak` rule, LookupStage.propose).
    weak: list[tuple[list[int], tuple[float, ...]]] | None = None


class LookupStage:
    def __init__(self, cfg: PromptLookupConfig, K: int, drafter_k: int | None = None) -> None:
        """K: the longest draft a step verifies (vLLM's num_speculative_tokens); drafter_k: the
        DFlash drafter's own draft length (default K). An ngram proposal is taken where it
        fills `min_tokens` (default drafter_k); a tree draft where its score is confident."""
        self.cfg, self.K = cfg, K
        self.drafter_k = K if drafter_k is None else drafter_k
        self.recent = None  # prompt_lookup.RecentText (ngram source), when it searches others
        self.tree = None  # drafter.suffix_tree.SuffixTreeLookup (suffix_tree source)
        if cfg.source == "suffix_tree":
            from vllm_onlinespec.drafter.suffix_tree import SuffixTreeLookup

            self.tree = SuffixTreeLookup(cfg.suffix_max_depth, cfg.suffix_max_cached_requests,
                                         cfg.suffix_max_spec_factor, cfg.suffix_min_token_prob)
        elif cfg.recent_tokens:
            self.recent = prompt_lookup.RecentText(cfg.recent_tokens, cfg.recent_min_n,
                                                   cfg.recent_max_n)
        # Each drafting request's text as of its last step (a copy: vLLM reuses the row),
        # added to `recent` when the request finishes.
        self.texts: dict[str, Any] = {}
        # Requests whose draft for the next verification came from lookup, not the drafter.
        self.pending: set[str] = set()
        self.rows = self.drafted = self.accepted = 0
        self.recent_rows = 0  # of rows, proposed from other requests' text (ngram source)
        self.skipped_steps = 0  # steps whose every request had a lookup draft: no drafter forward
        self.priced_cut = 0  # lookup draft tokens the budget left unverified
        self.weak_rows = 0  # tree drafts below suffix_min_score taken where the drafter had none
        self.calibration = LookupCalibration()  # the tree's estimates against verification
        # The chosen tree drafts' cumulative estimates, per request, as verified next step.
        self._expected: dict[str, tuple[float, ...]] = {}
        self._prepared: Proposals | None = None

    def _proposals(self, req_ids: list[str], history: list[Any], seeded: list[bool]) -> Proposals:
        cfg, K = self.cfg, self.K
        min_tokens = self.drafter_k if cfg.min_tokens is None else cfg.min_tokens
        # With the tree, only seeded requests take the ngram rule (their own text only).
        props = [prompt_lookup.propose(h, K, cfg.min_n, cfg.max_n)
                 if self.tree is None or s else [] for h, s in zip(history, seeded)]
        need: list[int | None] = [min_tokens] * len(req_ids)
        probs: list[tuple[float, ...]] = [()] * len(req_ids)
        from_recent = set()
        weak: list[tuple[list[int], tuple[float, ...]]] = [([], ())] * len(req_ids)
        if self.tree is not None:
            for i, (rid, h) in enumerate(zip(req_ids, history)):
                if seeded[i]:
                    continue  # own text only: the ngram proposal above
                d = self.tree.propose(rid, h, K)
                # The tree's score decides; a confident draft counts whatever its length.
                if d.score >= cfg.suffix_min_score:
                    props[i], need[i], probs[i] = d.tokens, 1, d.probs
                else:
                    props[i], need[i] = [], None
                    if d.tokens:
                        weak[i] = (list(d.tokens), tuple(d.probs))
        elif self.recent is not None:
            for i, (rid, h) in enumerate(zip(req_ids, history)):
                self.texts[rid] = h.copy()
                if len(props[i]) < min_tokens and not seeded[i]:  # own text has no full proposal
                    other = self.recent.propose(h, K)
                    if len(other) > len(props[i]):
                        props[i] = other
                        from_recent.add(i)
        return Proposals(list(req_ids), props, need, from_recent, probs, weak)

    def prepare(self, req_ids: list[str], history: list[Any], seeded: list[bool]) -> bool:
        """Before vLLM's drafter runs (the step's sampled tokens are already in `history`):
        the proposals `propose` will use, and whether every request has one the hybrid rule
        takes. Then the drafter's block would be thrown away for every request, and the step
        can skip the drafter (context K/V only)."""
        self._prepared = p = self._proposals(req_ids, history, seeded)
        return bool(req_ids) and all(len(t[:self.K]) >= max(1, self.K if n is None else n)
                                     for t, n in zip(p.tokens, p.need))

    def propose(self, cut: list[list[int]], req_ids: list[str], history: list[Any],
                seeded: list[bool], price: StepPrice | None = None) -> list[list[int]]:
        """The step's drafts: lookup's proposal where the hybrid rule takes it, else the
        drafter's cut block. Up to K tokens even where the budget's gate asked vLLM's drafter
        for fewer or none: the gate prices the drafter's acceptance, and a lookup match is
        accepted far more often (3.1 of 4 against 1.2 per drafted step, step_cost.md); the
        scheduler takes up to K drafts from any proposer. `price` (the budget policy): tree
        drafts cut to the prefix that pays in the next step (module docstring)."""
        p, self._prepared = self._prepared, None
        if p is None or p.req_ids != list(req_ids):  # not prepared for this batch
            p = self._proposals(req_ids, history, seeded)
        choice = prompt_lookup.choose_drafts(cut, p.tokens, [self.K] * len(cut), p.need)
        drafts, used, probs = choice.drafts, list(choice.from_lookup), list(p.probs)
        # Where the drafter has no block for a request (a step the budget gave to the tree, or
        # its block cut to nothing), suffix_min_score has nothing to choose between: any tree
        # draft is verified, as vLLM's suffix decoding verifies it, and priced below. With the
        # threshold there, the preset drafted on 49 % of its steps at batch 1 on Spec-Bench's
        # math questions, vLLM's suffix decoding on 87 %.
        for i, (toks, q) in enumerate(p.weak or ()):
            if toks and not used[i] and not drafts[i]:
                drafts[i], used[i], probs[i] = toks[:self.K], True, q
                self.weak_rows += 1
        tree_rows = [u and bool(q) for u, q in zip(used, probs)]
        if price is not None and any(tree_rows):
            scale = self.calibration.scale
            lookup_p = [conditional_acceptance(q[: len(d)], scale) if t else None
                        for d, q, t in zip(drafts, probs, tree_rows)]
            lengths = price_drafts([len(d) for d in drafts], lookup_p, price.drafter_p,
                                   price.base_tokens, price.cost_model, price.cost_scale)
            self.priced_cut += sum(len(d) - n for d, n in zip(drafts, lengths))
            drafts = [d[:n] for d, n in zip(drafts, lengths)]
        self.recent_rows += sum(used[i] for i in p.from_recent)
        self.pending = {r for r, u, d in zip(req_ids, used, drafts) if u and d}
        self._expected = {r: q for r, q, t in zip(req_ids, probs, tree_rows)
                          if t and r in self.pending}
        return drafts

    def finish(self, req_ids) -> None:
        """Finished requests: their text joins what later requests search."""
        if self.tree is not None:
            self.tree.finish(req_ids)
        for rid in req_ids:
            text = self.texts.pop(rid, None)
            if text is not None and self.recent is not None:
                self.recent.add(text)

    def drafter_rows(self, req_ids: list[str], drafted: list[int] | None,
                     accepted: list[int]) -> list[int] | None:
        """Draft tokens verified per request, 0 where lookup drafted (counted here instead)."""
        pending, self.pending = self.pending, set()
        expected, self._expected = self._expected, {}
        if not pending or drafted is None:
            return drafted
        out = []
        for rid, d, a in zip(req_ids, drafted, accepted):
            if rid in pending and d:
                self.rows += 1
                self.drafted += d
                self.accepted += a
                if rid in expected:  # the tree's estimate of the tokens it got verified
                    self.calibration.observe(a, float(np.sum(expected[rid][:d])))
                d = 0
            out.append(d)
        return out
