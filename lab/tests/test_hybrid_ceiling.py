"""lab/hybrid_ceiling.py: vLLM's prompt-lookup rule and the four proposers' walks."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybrid_ceiling as H  # noqa: E402


def test_accepted_run_stops_at_first_miss():
    assert H.accepted_run([1, 2, 3], [1, 2, 4]) == 2
    assert H.accepted_run([], [1]) == 0
    assert H.accepted_run([1, 2], [1]) == 1  # the window ran out


def test_walk_policies_per_step_choices():
    # The answer repeats its prompt: prompt lookup predicts it exactly, the drafter never.
    ids = [10, 11, 12, 13, 14, 15, 16, 10, 11, 12, 13, 14, 15, 16, 10, 11]
    start, k = 8, 2
    dflash = [0] * (len(ids) - start - k)
    w = H.walk_policies(ids, start, dflash, k)
    assert w["dflash"].per_step == 1.0
    assert w["ngram"].per_step == pytest.approx(3.0) and w["oracle"].per_step == pytest.approx(3.0)
    assert w["ngram-first"].per_step == pytest.approx(3.0)
    # Where the drafter is right and lookup has nothing, the oracle and ngram-first take it.
    ids = list(range(20, 36))
    w = H.walk_policies(ids, start, [2] * (len(ids) - start - k), k)
    assert w["ngram"].per_step == 1.0 and w["ngram"].drafted_steps == 0
    assert w["oracle"].per_step == w["ngram-first"].per_step == w["dflash"].per_step == 3.0
    with pytest.raises(ValueError, match="unknown policy"):
        H.choose("both", 1, 1, 2, 2)


def test_first_token_split_and_ratio_se():
    # positions: lookup matches K=2 tokens at 0 and 2; the drafter gets the first token at 0, 1.
    ft = H.first_token([1, 2, 0, -1], [2, 0, 1, 0], [2, 0, 2, 2], 2)
    assert (ft.hit, ft.hit_dflash, ft.hit_lookup, ft.miss, ft.miss_dflash) == (2, 1, 2, 1, 1)
    assert ft.as_dict()["dflash_first_on_hit"] == 0.5
    assert H.ratio_se([10, 10, 10], [20, 20, 20]) == 0.0  # identical sequences: no spread
    se = H.ratio_se([10, 10, 10, 10], [10, 30, 10, 30])
    assert 0.2 < se < 0.7  # ~ sd of per-sequence ratios (1) / sqrt(4)


def test_tree_policies_walk_with_the_suffix_tree():
    from vllm_onlinespec.drafter.suffix_tree import SuffixTreeLookup

    ids = [10, 11, 12, 13, 14, 15, 16, 10, 11, 12, 13, 14, 15, 16, 10, 11]
    start, k = 8, 2
    dflash = [1] * (len(ids) - start - k)
    tree = H.tree_accepts(SuffixTreeLookup(), "r", ids, start, len(dflash), k, 0.5)
    assert max(tree[0]) == 2 and any(tree[1])  # the repeated prompt is drafted whole
    w = H.walk_policies(ids, start, dflash, k, tree=tree)
    assert w["tree-first"].per_step >= w["dflash"].per_step == 2.0
    assert set(H.TREE_POLICIES) <= set(w)
    assert H.choose("tree", 1, 0, 0, 2, tree=2, tree_ok=False) == 0
    assert H.choose("tree-first", 1, 0, 0, 2, tree=2, tree_ok=False) == 1
