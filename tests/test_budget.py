"""Step cost model and the verify-token allocator (core: no vLLM)."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from vllm_onlinespec.policy.budget import StepCostModel, allocate, plan


# -- cost model -----------------------------------------------------------------------------------


def _samples(rng, a, b, n, *, c=0.0, knee=None, noise=2e-4, outliers=0.0, lo=1, hi=512):
    ns = rng.integers(lo, hi, n)
    t = a + b * ns + c * np.maximum(ns - (knee or 0), 0) + rng.normal(0, noise, n)
    spikes = rng.random(n) < outliers
    t[spikes] += 0.05  # GC pauses / preemption: 50 ms on a ~100 ms step
    return list(zip(ns.tolist(), t.tolist()))


def test_fit_recovers_a_b_despite_noise_and_outliers():
    rng = np.random.default_rng(0)
    m = StepCostModel(a=0.1, b=0.0).fit(_samples(rng, 3.1e-3, 4.2e-4, 2000, outliers=0.05))
    assert m.a == pytest.approx(3.1e-3, rel=0.05)
    assert m.b == pytest.approx(4.2e-4, rel=0.02)
    assert m.marginal_cost(100) == pytest.approx(m.b)
    assert m.describe().startswith("3.1 ms + 0.42 ms/token")


def test_online_observe_tracks_a_change():
    rng = np.random.default_rng(1)
    m = StepCostModel(half_life=200)
    for n, t in _samples(rng, 3e-3, 4e-4, 1500):
        m.observe(n, t)
    assert (m.a, m.b) == (pytest.approx(3e-3, rel=0.1), pytest.approx(4e-4, rel=0.03))
    for n, t in _samples(rng, 10e-3, 1e-4, 1500):  # e.g. the box got a faster kernel
        m.observe(n, t)
    assert (m.a, m.b) == (pytest.approx(10e-3, rel=0.1), pytest.approx(1e-4, rel=0.1))


def test_online_observe_shrugs_off_isolated_outliers():
    rng = np.random.default_rng(2)
    m = StepCostModel(half_life=100)
    for n, t in _samples(rng, 3e-3, 4e-4, 400):
        m.observe(n, t)
    before = m.predict(256)
    m.observe(256, 2.0)  # a 2 s stall
    assert m.predict(256) == pytest.approx(before, rel=0.02)
    m.observe(256, float("nan"))  # broken timer: ignored
    assert np.isfinite(m.predict(256))


def test_slope_never_negative():
    rng = np.random.default_rng(3)
    ns = rng.integers(1, 100, 300)
    data = list(zip(ns.tolist(), (0.02 - 3e-5 * ns + rng.normal(0, 1e-4, 300)).tolist()))
    m = StepCostModel().fit(data)
    assert m.b == 0.0 and m.a == pytest.approx(np.mean([t for _, t in data]), rel=0.05)
    o = StepCostModel(half_life=50)
    for n, t in data:
        o.observe(n, t)
    assert o.b == 0.0 and o.a > 0


def test_equal_sized_steps_keep_the_prior_slope():
    # All steps with 64 tokens say nothing about b: it must stay near the prior, not wind up.
    m = StepCostModel(a=2e-3, b=3e-4, half_life=50)
    for _ in range(2000):
        m.observe(64, 0.05)
    assert m.predict(64) == pytest.approx(0.05, rel=0.01)
    assert 0 <= m.b <= 1e-3


def test_knee_is_recovered():
    rng = np.random.default_rng(4)
    data = _samples(rng, 2e-3, 5e-5, 3000, c=5e-4, knee=128, noise=1e-4)
    m = StepCostModel(knee=128).fit(data)
    assert (m.a, m.b, m.c) == (pytest.approx(2e-3, rel=0.1), pytest.approx(5e-5, rel=0.1),
                               pytest.approx(5e-4, rel=0.02))
    assert m.marginal_cost(50) == pytest.approx(m.b)
    assert m.marginal_cost(300) == pytest.approx(m.b + m.c)


def test_round_trip_through_json():
    rng = np.random.default_rng(5)
    m = StepCostModel(knee=96, half_life=300)
    for n, t in _samples(rng, 3e-3, 4e-4, 200, c=1e-4, knee=96):
        m.observe(n, t)
    m2 = StepCostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    ns = np.arange(0, 600, 37)
    np.testing.assert_allclose(m2.predict(ns), m.predict(ns), rtol=1e-12)
    m.observe(100, 0.05), m2.observe(100, 0.05)  # and it keeps learning the same way
    np.testing.assert_allclose(m2.predict(ns), m.predict(ns), rtol=1e-12)
    prior = StepCostModel.from_dict({"a": 0.004, "b": 0.0002})
    assert prior.predict(10) == pytest.approx(0.006) and prior.n_samples == 0


# -- allocator ------------------------------------------------------------------------------------


def _value(p, lengths, base_tokens, cost, base_yield, cost_scale=1.0, value=None):
    g = np.cumprod(p, axis=1)
    S = sum(g[i, :n].sum() for i, n in enumerate(lengths))
    t0 = cost.predict(base_tokens)
    added = cost.predict(base_tokens + sum(lengths)) - t0
    if value is not None:
        return value * S - cost_scale * added
    return (base_yield + S) / (t0 + cost_scale * added)


def _brute(p, k_min, K, base_tokens, cost, **kw):
    B = p.shape[0]
    best = max(_value(p, L, base_tokens, cost, B, **kw)
               for L in itertools.product(range(min(k_min, K), K + 1), repeat=B))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_allocator_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    B, K = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    k_min = int(rng.integers(0, 3))
    p = rng.uniform(0, 1, (B, K)) ** rng.uniform(0.2, 2)
    knee = int(rng.integers(1, 8)) if seed % 3 == 0 else None
    cost = StepCostModel(a=float(rng.uniform(1e-4, 5e-3)), b=float(rng.uniform(1e-5, 2e-3)),
                         c=float(rng.uniform(0, 3e-3)) if knee else 0.0, knee=knee)
    base = B + int(rng.integers(0, 5))
    kw = {"cost_scale": float(rng.uniform(0.5, 2))} if seed % 2 else {}
    a = plan(p, base, cost, k_min=k_min, K=K, **kw)
    got = _value(p, a.lengths, base, cost, B, **kw)
    assert got == pytest.approx(_brute(p, k_min, K, base, cost, **kw), rel=1e-9)
    assert got == pytest.approx(a.rate, rel=1e-9)
    assert all(min(k_min, K) <= n <= K for n in a.lengths)

    v = float(rng.uniform(1e-4, 5e-3))  # the fixed exchange-rate objective is exact too
    L = allocate(p, base, cost, value_per_token_s=v, k_min=k_min, K=K)
    assert _value(p, L, base, cost, B, value=v) == pytest.approx(
        _brute(p, k_min, K, base, cost, value=v), rel=1e-9, abs=1e-15)


def _greedy(p, k_min, base_tokens, a, b):
    """Textbook greedy: add the best next token while (E + g) / (T + b) > E / T."""
    B, K = p.shape
    g = np.cumprod(p, axis=1)
    L = [k_min] * B
    E = B + sum(g[i, :k_min].sum() for i in range(B))
    T = a + b * (base_tokens + k_min * B)
    while True:
        nxt = [(g[i, L[i]], i) for i in range(B) if L[i] < K]
        if not nxt:
            return L
        gain, i = max(nxt)
        if not (E + gain) / (T + b) > E / T:
            return L
        L[i] += 1
        E, T = E + gain, T + b


@pytest.mark.parametrize("seed", range(20))
def test_linear_cost_greedy_stop_is_the_same_plan(seed):
    rng = np.random.default_rng(100 + seed)
    B, K = int(rng.integers(1, 40)), int(rng.integers(1, 12))
    p = rng.uniform(0.2, 1, (B, K))
    cost = StepCostModel(a=float(rng.uniform(1e-3, 2e-2)), b=float(rng.uniform(1e-5, 1e-3)))
    assert allocate(p, B, cost, k_min=1) == _greedy(p, 1, B, cost.a, cost.b)


def test_extremes_and_bounds():
    p = np.full((5, 6), 0.8)
    free = StepCostModel(a=0.01, b=0.0)
    assert allocate(p, 5, free, k_min=1) == [6] * 5  # tokens cost nothing: verify everything
    dear = StepCostModel(a=0.0, b=1.0)
    assert allocate(p, 5, dear, k_min=2) == [2] * 5  # tokens cost a full step each: floor only
    low = np.full((5, 6), 0.3)  # per-request floors (a full-draft fallback row uses k_min = K)
    assert allocate(low, 5, dear, k_min=[0, 1, 2, 3, 9]) == [0, 1, 2, 3, 6]
    assert allocate(np.zeros((3, 4)), 3, free, k_min=1) == [1, 1, 1]  # zero gain never wins
    assert allocate(np.zeros((0, 4)), 0, free, k_min=1) == []
    assert allocate(p, 5, free, k_min=1, K=3) == [3] * 5
    with pytest.raises(ValueError):
        allocate(p, 5, free, K=7)


def test_more_concurrency_means_shorter_drafts():
    cost = StepCostModel(a=3e-3, b=4e-4)
    rng = np.random.default_rng(7)
    per_req = [np.mean(allocate(rng.uniform(0.5, 0.95, (B, 8)), B, cost, k_min=1))
               for B in (2, 16, 128)]
    assert per_req[0] > per_req[1] > per_req[2]


def test_allocator_is_fast():
    rng = np.random.default_rng(8)
    p = rng.uniform(0.3, 0.98, (256, 16))
    cost = StepCostModel(a=3e-3, b=1e-5)
    plan(p, 256, cost)
    best = min(_timed(lambda: plan(p, 256, cost)) for _ in range(30))
    assert best < 1e-3, f"plan took {best * 1e3:.2f} ms for B=256, K=16"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_startup_probe_times_target_steps_and_feeds_the_cost_model():
    """The probe times the runner's dummy steps (sizes clipped to its capacity) with the
    drafter's own dummy pass off, then restores it; the fitted slope follows the timings."""
    from types import SimpleNamespace

    from vllm_onlinespec.serving import compat
    from vllm_onlinespec.serving.session import OnlineSession

    calls: list[tuple[str, int]] = []

    class Drafter:
        def dummy_run(self, n, **kw):
            calls.append(("drafter", n))

    class Runner:
        max_num_tokens = 100
        drafter = Drafter()

        def _dummy_run(self, n):
            calls.append(("target", n))
            self.drafter.dummy_run(n)  # what vLLM's _dummy_run does with a drafter
            time.sleep(0.002 + 2e-5 * n)

    runner = Runner()
    samples = compat.time_target_steps(runner, [1, 64, 512], reps=2)
    assert sorted({n for n, _ in samples}) == [1, 64, 100]
    assert not any(who == "drafter" for who, _ in calls)
    runner.drafter.dummy_run(3)
    assert calls[-1] == ("drafter", 3)  # the method is back
    assert all(t > 0.0019 for _, t in samples)

    cm = StepCostModel(a=0.5, b=0.1)  # a prior far off the timings
    session = SimpleNamespace(cutter=SimpleNamespace(cost_model=cm))
    OnlineSession.probe_step_cost(session, runner)
    assert cm.n_samples > 0 and cm.a < 0.1 and cm.b < 0.01
    broken = SimpleNamespace(drafter=None, _dummy_run=lambda n: 1 / 0)
    cm2 = StepCostModel(a=0.5, b=0.1)
    OnlineSession.probe_step_cost(SimpleNamespace(cutter=SimpleNamespace(cost_model=cm2)), broken)
    assert cm2.n_samples == 0  # a failed probe leaves the prior, and serving starts anyway
