"""Verify-length policies, per-position acceptance and its online stats (core: no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.policy.verify_length import (
    AcceptanceStats, AdaFlashPolicy, BudgetPolicy, FixedPolicy, adaflash_lengths, make_policy,
    position_acceptance)

# (r, K, rho, k_min) -> clamp(round(r * K * rho), k_min, K)
ADAFLASH_TABLE = [
    (0.0, 8, 1.0, 1, 1),      # floor
    (0.05, 8, 1.0, 1, 1),     # 0.4 -> 0 -> k_min
    (0.3, 8, 1.0, 1, 2),      # 2.4 -> 2
    (0.5, 5, 1.0, 1, 2),      # 2.5 -> 2 (half to even)
    (0.7, 5, 1.0, 1, 4),      # 3.5 -> 4 (half to even)
    (0.5, 8, 1.0, 3, 4),
    (0.25, 8, 1.0, 3, 3),     # 2 -> k_min 3
    (1.0, 8, 1.0, 1, 8),
    (0.9, 8, 2.0, 1, 8),      # 14.4 -> capped at K
    (0.5, 8, 0.5, 1, 2),      # rho < 1 cuts harder
    (0.5, 15, 1.0, 1, 8),     # 7.5 -> 8
    (0.2, 4, 1.0, 6, 4),      # k_min above K -> K
]


@pytest.mark.parametrize("r,K,rho,k_min,want", ADAFLASH_TABLE)
def test_adaflash_rule(r, K, rho, k_min, want):
    assert adaflash_lengths([r], K, rho, k_min) == [want]


def test_adaflash_rule_batched():
    rs = [row[0] for row in ADAFLASH_TABLE if row[1:4] == (8, 1.0, 1)]
    want = [row[4] for row in ADAFLASH_TABLE if row[1:4] == (8, 1.0, 1)]
    assert adaflash_lengths(torch.tensor(rs), 8, 1.0, 1) == want


# -- per-position acceptance ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [None, [0.95, 0.8, 0.6, 0.5, 0.5, 0.3], [0.99, 0.01] * 3])
def test_position_acceptance_matches_the_head(shape):
    K = 6
    r = torch.linspace(1 / (K + 1), 1, 25)
    p = position_acceptance(r, K, shape=None if shape is None else torch.tensor(shape))
    assert p.shape == (25, K) and ((p >= 0) & (p <= 1)).all()
    # documented identity: expected accepted drafts + the bonus = r * block_size (K + 1)
    torch.testing.assert_close(p.cumprod(-1).sum(-1) + 1, r.double() * (K + 1), atol=1e-7, rtol=0)
    assert (p[1:] >= p[:-1] - 1e-12).all()  # a better prediction never lowers any position
    lo = position_acceptance(torch.tensor([0.0, -1.0]), K)  # below the bonus-only level: clamped
    assert lo.cumprod(-1).sum(-1).max() < 1e-6


def test_position_acceptance_models():
    K = 5
    flat = position_acceptance(torch.tensor([0.3, 0.6, 0.9]), K)
    assert torch.allclose(flat, flat[:, :1].expand_as(flat))  # geometric: one rate per request
    shape = torch.tensor([0.9, 0.8, 0.6, 0.5, 0.4], dtype=torch.float64)
    p = position_acceptance(torch.tensor([0.5]), K, shape=shape)[0]
    t = p.log() / shape.log()  # p_k = shape_k ** t: one exponent for all positions
    assert torch.allclose(t, t[0].expand_as(t))
    p2 = position_acceptance(torch.tensor([0.5]), K, block_size=K)  # other convention
    assert float(p2.cumprod(-1).sum()) + 1 == pytest.approx(0.5 * K)


def _simulate(rng, q, n, cut=True):
    """Requests whose true per-position conditional acceptance is q; drafts cut at random."""
    K = len(q)
    drafted = rng.integers(1, K + 1, n) if cut else np.full(n, K)
    ok = rng.random((n, K)) < np.asarray(q)[None, :]
    run = np.cumprod(ok, axis=1).sum(1)
    return drafted, np.minimum(run, drafted)


def test_acceptance_stats_recover_rates_despite_cut_drafts():
    rng = np.random.default_rng(0)
    q = [0.9, 0.7, 0.5, 0.3]
    s = AcceptanceStats(4, half_life=1e9)
    for _ in range(100):
        d, a = _simulate(rng, q, 64)
        s.observe(d, a)
    np.testing.assert_allclose(s.rates().numpy(), q, atol=0.03)
    assert s.n_obs == 6400
    # a naive "accepted / drafted per position" estimate would be biased by the cuts:
    assert s.expected_fraction() == pytest.approx((1 + np.cumprod(q).sum()) / 5, abs=0.02)


def test_acceptance_stats_forget():
    rng = np.random.default_rng(1)
    s = AcceptanceStats(3, half_life=20)
    for q in ([0.9, 0.9, 0.9], [0.2, 0.5, 0.5]):
        for _ in range(200):
            s.observe(*_simulate(rng, q, 32, cut=False))
    np.testing.assert_allclose(s.rates().numpy(), [0.2, 0.5, 0.5], atol=0.06)
    s2 = AcceptanceStats.from_dict(s.to_dict())
    np.testing.assert_allclose(s2.rates().numpy(), s.rates().numpy())
    assert s2._lam == pytest.approx(s._lam)


# -- policies -------------------------------------------------------------------------------------


def _cfg(policy, **kw):
    return OnlineSpecConfig.from_any({"length_head": {"policy": policy, **kw}}).length_head


def test_make_policy_and_describe():
    cost = StepCostModel(a=3.1e-3, b=4.2e-4)
    assert isinstance(make_policy(_cfg("fixed")), FixedPolicy)
    ada = make_policy(_cfg("adaflash", rho=1.5, k_min=2))
    assert isinstance(ada, AdaFlashPolicy) and (ada.rho, ada.k_min) == (1.5, 2)
    bud = make_policy(_cfg("budget"), cost)
    assert isinstance(bud, BudgetPolicy) and bud.cost_model is cost
    assert bud.describe().startswith(
        "verify policy: budget (cost model: 3.1 ms + 0.42 ms/token, prior only, refreshed online")
    for pol in (make_policy(_cfg("fixed")), ada, bud):
        line = pol.describe()
        assert line.startswith(f"verify policy: {pol.name}") and "\n" not in line


def test_fixed_policy():
    lengths, why = FixedPolicy().lengths(torch.rand(3), 4, 3)
    assert lengths == [4, 4, 4] and why.startswith("fixed:")


def test_adaflash_policy_falls_back_explicitly():
    pol = AdaFlashPolicy(rho=1.0, k_min=1, min_obs=8)
    lengths, why = pol.lengths([0.3, None, float("nan"), 1.0], 8, 4)
    assert lengths == [2, 8, 8, 8]  # no prediction and no data yet: full draft
    assert "2 head, 0 population, 2 full" in why and "\n" not in why
    pol.observe([8] * 8, [1] * 8)  # population: exactly 1 of 8 accepted
    lengths, why = pol.lengths([0.3, None], 8, 2)
    r_pop = pol.stats.expected_fraction()
    assert lengths == [2, adaflash_lengths([r_pop], 8, 1.0, 1)[0]]
    assert "1 head, 1 population, 0 full" in why
    c = pol.counters()
    assert (c["pred_head"], c["pred_full"], c["pred_population"], c["requests"]) == (3, 2, 1, 6)
    assert c["verified_tokens"] == 2 + 8 + 8 + 8 + sum(lengths)


def test_adaflash_min_batch_is_explicit():
    pol = AdaFlashPolicy(min_batch=48)
    lengths, why = pol.lengths(torch.full((10,), 0.1), 8, 10)
    assert lengths == [8] * 10 and "B=10 < min_batch 48" in why
    assert pol.counters()["below_min_batch"] == 1
    lengths, why = pol.lengths(torch.full((48,), 0.25), 8, 48)
    assert lengths == [2] * 48 and why.startswith("adaflash: verify 96/384")


def test_budget_policy_follows_the_cost_model():
    pol = BudgetPolicy(StepCostModel(a=20e-3, b=1e-5), rho=1.0, k_min=1)
    r = torch.full((4,), 0.6)
    lengths, why = pol.lengths(r, 8, 4)  # few requests, fixed cost dominates: verify it all
    assert lengths == [8] * 4 and "every draft token pays" in why
    pol.cost_model = StepCostModel(a=3e-3, b=4e-4)
    big = torch.rand(128, generator=torch.Generator().manual_seed(0))
    lengths, why = pol.lengths(big, 8, 128)  # many requests: tokens cost, drafts shrink
    assert sum(lengths) < 8 * 128 and all(1 <= n <= 8 for n in lengths)
    assert "stop: next token's gain" in why and "128 head, 0 population, 0 full" in why
    order = big.argsort()  # better predictions never get shorter drafts
    assert all(lengths[i] <= lengths[j] for i, j in zip(order[:-1].tolist(), order[1:].tolist()))
    # rho < 1 makes verification dearer (AdaFlash convention: rho scales how much is verified)
    dear = BudgetPolicy(pol.cost_model, rho=1.0 / 3.0).lengths(big, 8, 128)[0]
    assert sum(dear) <= sum(lengths) and all(1 <= n <= 8 for n in dear)


def test_budget_policy_fallbacks_and_per_position_input():
    pol = BudgetPolicy(StepCostModel(a=3e-3, b=4e-4), min_obs=4)
    lengths, why = pol.lengths(None, 6, 3)  # nothing known: full drafts, counted
    assert lengths == [6, 6, 6] and "0 head, 0 population, 3 full" in why
    pol.observe([6, 6, 6, 6], [0, 0, 1, 0])
    p = torch.tensor([[0.99] * 6, [float("nan")] * 6, [0.01] * 6], dtype=torch.float64)
    lengths, why = pol.lengths(None, 6, 3, p_accept=p, base_tokens=200)
    assert lengths[0] > lengths[2] == 1 and "2 head, 1 population, 0 full" in why
    assert pol.lengths(torch.rand(0), 6, 0)[0] == []


def test_policy_counters_total():
    pol = make_policy(_cfg("budget"), StepCostModel(a=3e-3, b=4e-4))
    for B in (1, 7, 33):
        lengths, _ = pol.lengths(torch.rand(B), 5, B)
        pol.observe([5] * B, [2] * B)
    c = pol.counters()
    assert (c["steps"], c["requests"], c["draft_tokens"]) == (3, 41, 205)
