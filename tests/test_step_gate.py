"""The budget's step gate (policy/step_gate.py): a step speculates only when its best plan,
with the drafter's measured time counted, beats a plain step; exploration while shut is
bounded; the cutter passes a K = 0 step through and verifies exploring requests in full."""

import numpy as np
import pytest

from vllm_onlinespec.config import ConfigError, LengthHeadConfig, OnlineSpecConfig
from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.policy.cutter import DraftCutter
from vllm_onlinespec.policy.step_gate import StepGate
from vllm_onlinespec.policy.verify_length import AcceptanceStats

K = 4


def stats_with_rate(rate: float, n: int = 64) -> AcceptanceStats:
    """Population statistics whose per-position acceptance is ~rate (full drafts verified)."""
    s = AcceptanceStats(K)
    rng = np.random.default_rng(0)
    for _ in range(n):
        acc = 0
        while acc < K and rng.random() < rate:
            acc += 1
        s.observe([K], [acc])
    return s


def cost(a=0.05, b=1e-3):
    return StepCostModel(a=a, b=b, half_life=None, prior_weight=1e6)  # the prior is the model


def brute_force_rates(stats, B, base, cm, t_draft, t_plain):
    """Every uniform verify length n = 0..K for all B requests: the best rate with drafts vs plain."""
    p = stats._rates()[:K]
    g = np.cumprod(p)
    best = 0.0
    for n in range(1, K + 1):
        e = B + B * g[:n].sum()
        best = max(best, e / (cm.predict(base + B * n) + t_draft))
    return best, B / (cm.predict(base) + t_plain)


@pytest.mark.parametrize("rate,b,t_draft", [(0.9, 2e-4, 0.005), (0.2, 2e-3, 0.005),
                                            (0.6, 1e-3, 0.0), (0.6, 1e-3, 0.2)])
def test_gate_opens_exactly_when_speculating_beats_a_plain_step(rate, b, t_draft):
    st, cm = stats_with_rate(rate), cost(b=b)
    g = StepGate(K, cm, explore_every=10**6)
    g.timer.observe(K, t_draft)
    g.timer.observe(0, 0.001)
    d = g.decide(st, batch_size=8, base_tokens=8)
    spec, plain = brute_force_rates(st, 8, 8, cm, t_draft, 0.001)
    # uniform lengths are a subset of budget.plan's choices: if they beat plain, so does plan
    if spec > plain * 1.001:
        assert d.draft, d.reason
    if not d.draft:
        assert spec <= plain * 1.001, d.reason
    assert ("open" in d.reason) == d.draft and "tok/s" in d.reason


def test_the_drafters_time_can_shut_the_gate():
    st, cm = stats_with_rate(0.5), cost(a=0.05, b=1e-3)
    cheap, dear = StepGate(K, cm, explore_every=10**6), StepGate(K, cm, explore_every=10**6)
    for g, t in ((cheap, 0.0), (dear, 0.5)):
        g.timer.observe(K, t)
        g.timer.observe(0, 0.001)  # vLLM's K = 0 path: one query token per request
    assert cheap.decide(st, 4, 4).draft and not dear.decide(st, 4, 4).draft


def test_prefill_tokens_in_the_step_change_the_price():
    """A step already long with prefill chunks: a few verify tokens add little to its time, so
    drafts that do not pay in a pure decode step pay there (and the other way round)."""
    st = stats_with_rate(0.3)
    g = StepGate(K, cost(a=0.01, b=5e-3), explore_every=10**6)
    assert not g.decide(st, 4, base_tokens=4).draft
    assert g.decide(st, 4, base_tokens=512).draft


def test_gate_stays_open_until_acceptance_is_measured():
    g = StepGate(K, cost(b=1.0), min_obs=16)
    assert g.decide(None, 4, 4).draft
    assert g.decide(stats_with_rate(0.1, n=3), 4, 4).draft


def test_exploration_is_bounded():
    st, cm = stats_with_rate(0.05), cost(b=5e-3)
    g = StepGate(K, cm, explore_every=8)
    ds = [g.decide(st, 32, 32) for _ in range(100)]
    explore = [d for d in ds if d.draft]
    assert all(d.explore for d in explore) and len(explore) == 100 // 8
    assert g.explore_steps == 12 and g.shut_steps == 88
    with pytest.raises(ValueError, match="explore_every"):
        StepGate(K, cm, explore_every=1)


def budget_cutter(**kw):
    cfg = LengthHeadConfig(policy="budget", k_min=0, explore_every=4, explore_requests=1, **kw)
    return DraftCutter(cfg, K, cost_model=cost(b=5e-3))


def test_cutter_passes_a_k0_step_through_without_counting_a_skip():
    skips = []
    c = budget_cutter()
    c.on_skip = skips.append
    c.policy._stats(K)
    c.policy.stats = stats_with_rate(0.05)
    d = c.plan_next(3, 3)
    assert not d.draft
    assert c.cut([[], [], []]) == [[], [], []] and not skips
    assert c.last_reason.startswith("gate: shut")


def test_cutter_verifies_exploring_requests_in_full_and_can_cut_others_to_nothing():
    c = budget_cutter()
    c.policy.stats = stats_with_rate(0.05)
    decisions = [c.plan_next(3, 3) for _ in range(4)]
    assert decisions[-1].explore
    out = c.cut([[1, 2, 3, 4]] * 3)
    assert out[0] == [1, 2, 3, 4]  # explore_requests = 1
    assert out[1] == [] and out[2] == []  # k_min = 0: nothing of these pays
    assert "gate: explore" in c.last_reason


def test_gate_settings_are_validated_with_the_field_named():
    for bad, field in (({"explore_every": 1}, "explore_every"), ({"k_min": -1}, "k_min"),
                       ({"explore_requests": 0}, "explore_requests")):
        with pytest.raises(ConfigError, match=field):
            OnlineSpecConfig.from_any({"length_head": {"policy": "budget", **bad}})


def test_step_timer_on_cpu_delivers_host_seconds_at_once():
    import time

    from vllm_onlinespec.serving.step_timer import StepTimer

    t, got = StepTimer(cuda=False), []
    span = t.start()
    time.sleep(0.01)
    t.stop(span, got.append)
    assert len(got) == 1 and 0.009 < got[0] < 1.0
    t.poll()  # nothing pending on CPU
    assert len(got) == 1


def test_gate_shuts_while_the_length_head_cuts_every_draft_away():
    """The population estimate says drafts pay, but the (trusted) head cuts them all to 0:
    drafting is waste, so the gate shuts; an exploring step that shows the head verifying
    again reopens it."""
    st, cm = stats_with_rate(0.9), cost(b=2e-4)
    g = StepGate(K, cm, explore_every=4)
    assert g.decide(st, 2, 2).draft
    for _ in range(3):
        g.observe_cut(0.0)
    d = g.decide(st, 2, 2)
    assert not d.draft and "cut recent drafts to 0.00" in d.reason
    while not (d := g.decide(st, 2, 2)).explore:
        assert not d.draft
    for _ in range(6):
        g.observe_cut(3.0)  # the head verifies again
    assert g.decide(st, 2, 2).draft


def test_gate_picks_the_draft_length_that_pays_best():
    """Only the first draft token is worth its verification: the gate asks vLLM for k = 1 (not
    all K, not none), and the best k equals a brute force over k with each k's drafter time."""
    s = AcceptanceStats(K)
    for i in range(200):  # first token accepted half the time, later ones almost never
        s.observe([K], [1 if i % 2 else 0])
    cm = cost(a=0.05, b=0.01)  # a verify token costs a fifth of a step
    g = StepGate(K, cm, explore_every=10**6)
    for k, t in ((0, 0.002), (K, 0.012)):
        g.timer.observe(k, t)
    d = g.decide(s, batch_size=1, base_tokens=1)
    p = np.cumprod(s._rates()[:K])
    rates = [1 / (cm.predict(1) + g.timer.get(0, K))] + [
        (1 + p[:k].sum()) / (cm.predict(1 + k) + g.timer.get(k, K)) for k in range(1, K + 1)]
    assert d.k == int(np.argmax(rates)) == 1, (d.reason, rates)
    assert g.short_steps == 1 and g.shut_steps == 0
    assert "open at k=1" in d.reason


def test_draft_timer_prices_unmeasured_lengths_by_the_query_block():
    from vllm_onlinespec.policy.step_gate import DraftTimer

    t = DraftTimer()
    assert t.get(2, K) == 0.0  # nothing measured
    t.observe(K, 0.010)
    assert t.get(0, K) == pytest.approx(0.010 / (K + 1))  # one query token instead of K + 1
    t.observe(0, 0.004)
    assert t.get(2, K) == pytest.approx(0.004 + 2 * (0.010 - 0.004) / K)  # linear in k
    t.observe(2, 0.005)
    assert t.get(2, K) == 0.005  # measured wins


def test_short_drafts_are_allocated_within_their_length():
    """A step the gate drafted at k < K: the budget plans over those k positions only, and its
    population statistics stay those of the K-token block (not reset)."""
    cfg = LengthHeadConfig(policy="budget", k_min=0, gate=False)
    c = DraftCutter(cfg, K, head=None)
    c.policy.cost_model = cost(a=0.05, b=1e-5)  # verifying is nearly free: take every token
    c.cut([[1, 2, 3, 4]], ["x"])  # the first cut creates the statistics
    for _ in range(40):
        c.policy.observe([K], [K])
    stats = c.policy.stats
    out = c.cut([[5, 6], [7, 8]], ["a", "b"])
    assert out == [[5, 6], [7, 8]] and c.policy.stats is stats and stats.K == K


def _drive(gate, st, B, t_target, t_draft, extra_drafted, steps):
    """Run the gate for `steps` engine cycles on synthetic timings: the target and drafter
    spans are what the gate measures; drafted cycles also cost `extra_drafted` seconds that no
    span sees (the sampler, bookkeeping). Returns the k the gate chose at each step."""
    ks, prev_k = [], 0
    for _ in range(steps):
        d = gate.decide(st, batch_size=B, base_tokens=B)
        verified = prev_k > 0
        tokens = B + B * prev_k
        t = t_target(tokens)
        gate.cost_model.observe(tokens, t)
        gate.timer.observe(d.k, t_draft if d.k else 0.0005)
        drafted = d.k > 0 or verified
        gate.observe_cycle(d.k, B, tokens, t + (t_draft if d.k else 0.0005)
                           + (extra_drafted if drafted else 0.0), drafter_verified=verified)
        prev_k = d.k
        ks.append(d.k)
    return ks


def test_measured_cycle_overhead_shuts_the_gate_when_drafted_steps_are_slower_and_follows_a_change():
    """The model alone says speculating pays (acceptance ~0.6, cheap verify tokens); drafted
    engine cycles are measured 30 ms slower than their spans. The gate shuts on the measured
    price, then reopens within a few explore steps once that overhead goes away."""
    st = stats_with_rate(0.6)
    lin = lambda n: 0.02 + 2e-4 * n  # noqa: E731 - the true target span
    gate = StepGate(K, StepCostModel(a=0.02, b=2e-4, half_life=None, prior_weight=1e6),
                    explore_every=8)
    assert gate.decide(st, 4, 4).k > 0  # the model alone: speculate
    ks = _drive(gate, st, 4, lin, 0.004, extra_drafted=0.030, steps=200)
    assert ks[-40:].count(0) >= 30, ks[-40:]  # shut, bar exploration
    assert "measured step overhead" in gate.last.reason
    assert gate.overhead.get(True, 4) > 0.02 > abs(gate.overhead.get(False, 4))
    ks = _drive(gate, st, 4, lin, 0.004, extra_drafted=0.0, steps=200)
    assert sum(k > 0 for k in ks[-40:]) >= 35, ks[-40:]  # the explore steps saw the change


def test_measured_cycle_overhead_keeps_the_gate_open_when_drafted_steps_are_faster():
    """The reverse: the model prices drafting as not paying (slow verify tokens), but plain
    cycles carry 40 ms the spans miss, so measured drafted steps win and the gate opens."""
    st = stats_with_rate(0.6)
    lin = lambda n: 0.02 + 6e-3 * n  # noqa: E731
    gate = StepGate(K, StepCostModel(a=0.02, b=6e-3, half_life=None, prior_weight=1e6),
                    explore_every=8)
    gate.timer.observe(0, 0.0005)
    ks = _drive(gate, st, 4, lin, 0.004, extra_drafted=0.0, steps=100)
    assert ks[-40:].count(0) >= 30  # without the plain overhead: shut
    for _ in range(100):  # plain cycles now cost 40 ms more than their spans
        gate.observe_cycle(0, 4, 4, lin(4) + 0.0005 + 0.040, drafter_verified=False)
    assert gate.decide(st, 4, 4).k > 0, gate.last.reason


def test_cycle_overhead_clips_idle_gaps_and_buckets_batch_sizes():
    from vllm_onlinespec.policy.cycle_overhead import CycleOverhead, batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    o = CycleOverhead(half_life_steps=1e9)
    o.observe(True, 8, measured_s=100.0, modelled_s=0.05)  # an idle gap before a burst
    assert o.get(True, 8) == pytest.approx(0.05)  # clipped at the modelled step
    o.observe(False, 1, 0.012, 0.010)
    assert o.get(False, 1) == pytest.approx(0.002)
    assert o.get(False, 32) == pytest.approx(0.002)  # nearest measured bucket of its kind
    assert o.get(True, 1) == pytest.approx(0.05)
    assert CycleOverhead().get(True, 4) == 0.0  # nothing measured: the model alone


@pytest.mark.parametrize("seed", range(6))
def test_plans_by_length_is_the_budgets_plan_at_every_length(seed):
    """The gate's one-pass plans equal budget.plan over the first k positions of B equal rows,
    for every k (tokens, rate and the no-draft step), on random acceptance, costs and extras."""
    from vllm_onlinespec.policy.budget import plan
    from vllm_onlinespec.policy.step_gate import plans_by_length

    rng = np.random.default_rng(seed)
    Kx, B = int(rng.integers(1, 17)), int(rng.integers(1, 33))
    rates = rng.uniform(0, 1, Kx) ** rng.uniform(0.2, 3)
    if seed == 0:
        rates[:] = 0.0  # nothing pays: every length verifies nothing
    cm = StepCostModel(a=rng.uniform(0.005, 0.1), b=rng.uniform(1e-5, 5e-3), half_life=None,
                       prior_weight=1e6)
    base = B + int(rng.integers(0, 64))
    extras = rng.uniform(0, 0.05, Kx)
    scale = float(rng.uniform(0.5, 2))
    got = plans_by_length(rates, B, base, cm, extras, cost_scale=scale)
    p = np.broadcast_to(rates[None, :], (B, Kx))
    for k in range(1, Kx + 1):
        a = plan(p[:, :k], base, cm, k_min=0, K=k, cost_scale=scale, extra_s=extras[k - 1])
        want_rate = a.expected_tokens / a.step_s if a.tokens else 0.0
        assert got[k - 1].tokens == a.tokens
        assert got[k - 1].rate == pytest.approx(want_rate, rel=1e-12, abs=1e-12)
        assert got[k - 1].floor_s == pytest.approx(a.min_step_s - extras[k - 1], rel=1e-12)
