"""Pricing the suffix tree's drafts (policy/lookup_price.py, serving/lookup.py): each tree
draft cut to the prefix that pays in the next step, by the tree's calibrated estimates and the
target's cost per token; the drafter's blocks and unestimated drafts kept whole."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.policy.lookup_price import (LookupCalibration, StepPrice,
                                                 conditional_acceptance, price_drafts)
from vllm_onlinespec.serving.lookup import LookupStage


def cost(a, b):
    return StepCostModel(a=a, b=b, half_life=None, prior_weight=1e6)


def test_conditional_acceptance_from_cumulative_estimates():
    p = conditional_acceptance([0.8, 0.4, 0.4, 0.1])
    assert np.allclose(np.cumprod(p), [0.8, 0.4, 0.4, 0.1])
    # Scaled and clipped to 1; an increase (not a valid cumulative) is held at the minimum.
    assert np.allclose(np.cumprod(conditional_acceptance([0.8, 0.4], 2.0)), [1.0, 0.8])
    assert np.allclose(np.cumprod(conditional_acceptance([0.5, 0.6, 0.2])), [0.5, 0.5, 0.2])
    assert conditional_acceptance([]).size == 0
    assert np.allclose(conditional_acceptance([0.5, 0.0, 0.0]), [0.5, 0.0, 0.0])


def test_price_keeps_cheap_tokens_and_cuts_dear_ones():
    q = conditional_acceptance([0.9, 0.7, 0.5, 0.3, 0.2, 0.1])
    # One request, a step that costs 40 ms whatever it verifies: every token pays.
    assert price_drafts([6], [q], None, 1, cost(0.040, 1e-6)) == [6]
    # 16 requests, 3 ms per verify token on an ~80 ms step: a token pays only above ~0.6.
    out = price_drafts([6] * 16, [q] * 16, None, 16, cost(0.030, 0.003))
    assert all(n == out[0] for n in out) and 0 < out[0] < 6
    # A token pays while its cumulative estimate beats the step's rate times its cost: the
    # first tokens (0.9 > 3 ms x 16 tok / 78 ms = 0.62) do; then the step yields 30.4 tokens
    # in 126 ms and the second (0.7 < 3 ms x 241 tok/s = 0.72) does not.
    assert out[0] == 1
    # A row without an estimate (the drafter's block) is kept whole, and costs the step.
    mixed = price_drafts([4, 6], [None, q], np.array([0.5, 0.5, 0.5, 0.5]), 2, cost(0.03, 0.003))
    assert mixed[0] == 4 and mixed[1] <= 6
    assert price_drafts([3, 0], [None, None], None, 2, cost(0.03, 0.003)) == [3, 0]
    assert price_drafts([], [], None, 0, cost(0.03, 0.003)) == []


def test_calibration_follows_verification():
    c = LookupCalibration(half_life_rows=8)
    assert c.scale == 1.0
    for _ in range(200):  # the tree expected 3 tokens a row, 1.5 were accepted
        c.observe(1, 3.0) if _ % 2 else c.observe(2, 3.0)
    assert c.scale == pytest.approx(0.5, abs=0.05)
    for _ in range(200):
        c.observe(10, 1.0)
    assert c.scale == c.hi  # clipped
    c.observe(5, 0.0)  # nothing expected: ignored
    with pytest.raises(ValueError, match="half_life_rows"):
        LookupCalibration(half_life_rows=0)


def _stage():
    cfg = OnlineSpecConfig.from_any({"prompt_lookup": {"enabled": True, "source": "suffix_tree"}})
    return LookupStage(cfg.prompt_lookup, 16, 4)


def test_the_stage_prices_tree_drafts_only_under_a_step_price():
    # 16 requests each repeating its prompt: the tree proposes 8 tokens per request (as many
    # as the match is long), each estimated at 0.5.
    text = list(range(100, 140))
    hist = [np.array(text + text[:8]) + 1000 * i for i in range(16)]
    rids = [f"r{i}" for i in range(16)]
    blocks = [[0] * 4 for _ in rids]
    whole = _stage().propose(blocks, rids, hist, [False] * 16)
    assert all(len(d) == 8 for d in whole)
    # Priced on a step where a verify token costs 3 ms: shorter, each a prefix of the whole.
    st = _stage()
    dear = StepPrice(cost(0.030, 0.003), 16)
    st.calibration.accepted, st.calibration.expected = 1.0, 4.0  # the tree has been optimistic
    priced = st.propose(blocks, rids, hist, [False] * 16, dear)
    assert all(p == w[: len(p)] for p, w in zip(priced, whole))
    assert sum(map(len, priced)) < sum(map(len, whole)) and st.priced_cut > 0
    # Cheap tokens: the same drafts whole.
    cheap = _stage().propose(blocks, rids, hist, [False] * 16, StepPrice(cost(0.030, 1e-7), 16))
    assert cheap == whole


def test_verification_calibrates_the_tree():
    st = _stage()
    text = list(range(100, 140))
    hist = [np.array(text + text[:8])]
    d = st.propose([[0] * 4], ["a"], hist, [False])
    assert st.pending == {"a"} and len(d[0]) > 4
    before = st.calibration.scale
    # The target accepted none of it: the tree's estimates count for less from now on.
    assert st.drafter_rows(["a"], [len(d[0])], [0]) == [0]
    assert st.calibration.scale < before and st.accepted == 0
