"""The confidence estimator (policy/acceptance_estimator.py): vLLM-style acceptance estimates
from the drafter's top-1 probability, fitted online from verification, as the budget's input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_onlinespec.config import ConfigError, LengthHeadConfig, OnlineSpecConfig
from vllm_onlinespec.policy.acceptance_estimator import ConfidenceEstimator, logit
from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.policy.cutter import DraftCutter

K = 4


def verify(rng, p_true):
    """Accepted count of one draft whose tokens are accepted with conditional probs p_true."""
    a = 0
    for q in p_true:
        if rng.random() >= q:
            break
        a += 1
    return a


def test_starts_at_the_drafters_confidence_and_labels_through_the_first_rejection():
    e = ConfidenceEstimator(K)
    c = np.array([[0.9, 0.6, 0.3, 0.2]])
    assert np.allclose(e.predict(c), c, atol=1e-6)
    assert np.allclose(logit(np.array([0.5])), 0.0)
    e.record(["a"], c, e.predict(c), [4], r_pop=0.5)
    e.observe(["a"], [4], [1])  # accepted 1: labels 1, 0 at positions 0, 1; 2, 3 unlabelled
    assert e.updates == 2 and e.labels == 1
    assert e.w[2] == 1.0 and e.b[2] == 0.0  # untouched
    # A draft accepted up to its cut (2 of 4 kept): censored, learned from, not scored.
    e.record(["b"], c, e.predict(c), [2], r_pop=0.5)
    e.observe(["b"], [2], [2])
    assert e.labels == 1 and e.updates == 4
    e.observe(["zz"], [3], [1])  # never recorded: ignored
    with pytest.raises(ValueError, match="K >= 1"):
        ConfidenceEstimator(0)


def test_learns_an_overconfident_drafter_and_beats_the_population_estimate():
    """The drafter's confidence is informative but overconfident (true acceptance c^2): the
    estimator's block predictions beat the population's constant on fresh labels."""
    rng = np.random.default_rng(0)
    e = ConfidenceEstimator(K)
    pop = 0.0
    for step in range(3000):
        c = rng.uniform(0.05, 0.99, size=(1, K))
        true = c[0] ** 2
        r_pop = 0.35 if step > 0 else None
        e.record(["r"], c, e.predict(c), [K], r_pop)
        e.observe(["r"], [K], [verify(rng, true)])
    p = e.predict(np.array([[0.9, 0.9, 0.9, 0.9]]))[0]
    assert np.all(np.abs(p - 0.81) < 0.1), p  # calibrated towards c^2 from 0.9
    assert e.labels > 2000 and e.score.mse < e.score.population_mse
    assert "beats population" in e.state()


def _cutter(estimator="confidence"):
    cfg = LengthHeadConfig(policy="budget", k_min=0, gate=False, estimator=estimator)
    c = DraftCutter(cfg, K, head=None,
                    cost_model=StepCostModel(a=0.03, b=0.003, half_life=None, prior_weight=1e6))
    return c


def test_the_budget_cuts_by_the_drafters_confidence():
    c = _cutter()
    assert c.needs_confidence and not c.needs_hidden
    # 16 requests, dear verify tokens: confident rows keep more than unconfident ones.
    conf = torch.tensor([[0.99, 0.98, 0.97, 0.96]] * 8 + [[0.3, 0.2, 0.1, 0.1]] * 8)
    c.observe_confidence(conf.flatten())
    rids = [f"r{i}" for i in range(16)]
    out = c.cut([[1, 2, 3, 4]] * 16, rids)
    assert min(map(len, out[:8])) > max(map(len, out[8:])), out
    assert len(c.estimator.pending) == 16
    c.observe([len(d) for d in out], [len(d) for d in out], rids)
    assert not c.estimator.pending and c.estimator.updates > 0
    # Mis-shaped confidences: skipped, the population estimate cuts.
    skipped = []
    c.on_skip = skipped.append
    c.observe_confidence(torch.ones(3))
    c.cut([[1, 2, 3, 4]] * 2, ["x", "y"])
    assert skipped == ["no_draft_confidence"]


def test_confidence_needs_the_budget_in_one_line():
    with pytest.raises(ConfigError, match="estimator 'confidence' needs length_head.policy "
                                          "'budget'") as e:
        OnlineSpecConfig.from_any({"length_head": {"policy": "fixed", "estimator": "confidence"}})
    assert "\n" not in str(e.value)
    assert OnlineSpecConfig.from_any({"preset": "cpu", "length_head": {
        "estimator": "confidence"}}).length_head.estimator == "confidence"
