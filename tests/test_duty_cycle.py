"""The learner's duty-cycle controller (learner/duty_cycle.py) on synthetic gain sequences:
it idles when learning buys nothing, runs full while the gain rises, ramps on a drift."""

import math
import random

import pytest

from vllm_onlinespec.learner.duty_cycle import DutyCycle, GainScore, drop_t, mean_t, slope_t


def feed(dc, currents, references, start=0, every=4):
    shares = []
    for i, (c, r) in enumerate(zip(currents, references)):
        shares.append(dc.observe(GainScore(update=(start + i) * every, current=c, reference=r)))
    return shares


def noisy(level, n, sd=0.05, seed=0):
    rng = random.Random(seed)
    return [level + rng.gauss(0, sd) for _ in range(n)]


def test_no_gain_idles_the_learner():
    """In-domain: training buys nothing over the start weights (paired noise only)."""
    dc = DutyCycle(0.05, 0.5)
    ref = noisy(0.40, 80, seed=1)
    cur = [r + d for r, d in zip(ref, noisy(0.0, 80, sd=0.05, seed=2))]
    shares = feed(dc, cur, ref)
    assert shares[0] == 0.5  # warming up: full share
    assert sum(s == 0.05 for s in shares[-30:]) >= 25, shares[-30:]
    assert "share 0.05" in dc.reason


def test_a_steady_gain_keeps_the_full_share():
    """A changed target: training has bought +0.15 tokens per block and holds it; the start
    weights do not match what is served, so more fresh text may buy more."""
    dc = DutyCycle(0.05, 0.5)
    ref = noisy(0.30, 60, seed=7)
    cur = [r + 0.15 + d for r, d in zip(ref, noisy(0.0, 60, sd=0.1, seed=8))]
    shares = feed(dc, cur, ref)
    assert min(shares[-30:]) >= 0.45, shares[-30:]


def test_rising_gain_keeps_the_full_share():
    dc = DutyCycle(0.05, 0.5)
    ref = noisy(0.40, 80, seed=3)
    cur = [r + 0.004 * i + d for i, (r, d) in enumerate(zip(ref, noisy(0.0, 80, sd=0.02, seed=4)))]
    shares = feed(dc, cur, ref)
    assert min(shares[-40:]) >= 0.45, shares[-40:]


def test_a_drift_ramps_the_learner_back_up():
    dc = DutyCycle(0.05, 0.5)
    ref = noisy(0.40, 60, seed=5)
    cur = [r + d for r, d in zip(ref, noisy(0.0, 60, sd=0.03, seed=9))]
    shares = feed(dc, cur, ref)
    assert sum(shares[-20:]) / 20 < 0.15, shares[-20:]  # idle before the change
    # the target changes: both weights accept less
    ref2 = noisy(0.20, 12, seed=6)
    shares2 = feed(dc, [r + d for r, d in zip(ref2, noisy(0.0, 12, sd=0.03, seed=10))], ref2,
                   start=60)
    assert max(shares2[:8]) >= 0.45, shares2
    assert "drop t" in dc.reason


def test_statistics_and_settings():
    assert slope_t([0, 1, 2, 3], [0, 1, 2, 3.1]) > 10
    assert abs(slope_t([0, 1, 2, 3, 4], [1, 1.1, 0.9, 1, 1.05])) < 2
    assert drop_t([1, 1.1, 0.9, 1, 0.5, 0.45, 0.55, 0.5]) > 5
    assert drop_t([1, 1]) == 0.0
    assert mean_t([0.2, 0.25, 0.15, 0.2]) > 5 and abs(mean_t([0.1, -0.1, 0.05, -0.05])) < 1
    with pytest.raises(ValueError, match="min_share"):
        DutyCycle(0.6, 0.5)
    dc = DutyCycle(0.1, 0.5)
    assert dc.observe(GainScore(0, float("nan"), 0.3)) == 0.5 and dc.n == 0  # ignored


def test_a_cold_start_keeps_the_full_share():
    """Random start weights accept ~nothing: current and reference both sit at the floor, no
    gain shows yet, and there is no drafting to lose; the learner trains at its full share."""
    dc = DutyCycle(0.05, 0.8)
    ref = [abs(x) for x in noisy(0.0, 60, sd=0.01, seed=11)]
    cur = [abs(x) for x in noisy(0.0, 60, sd=0.01, seed=12)]
    shares = feed(dc, cur, ref)
    assert min(shares) == 0.8, shares
    assert "cold start" in dc.reason
    # Once the start weights draft something and learning buys nothing, it idles again.
    ref2 = noisy(0.40, 80, seed=13)
    shares2 = feed(dc, [r + d for r, d in zip(ref2, noisy(0.0, 80, sd=0.05, seed=14))], ref2,
                   start=60)
    assert sum(shares2[-40:]) / 40 < 0.2 and "cold start" not in dc.reason, shares2[-40:]


def test_mean_gain_is_the_windows_paired_difference():
    from vllm_onlinespec.learner.duty_cycle import DutyCycle, GainScore

    d = DutyCycle(0.05, 0.5, window=6)
    assert math.isnan(d.mean_gain)
    for u, (cur, ref) in enumerate([(1.0, 0.5)] * 3 + [(2.0, 1.0)] * 6):
        d.observe(GainScore(update=u, current=cur, reference=ref))
    assert d.mean_gain == pytest.approx(1.0)  # only the last 6 (window) scores count


def test_gain_t_is_the_windows_mean_over_its_standard_error():
    from vllm_onlinespec.learner.duty_cycle import DutyCycle, GainScore

    d = DutyCycle(0.05, 0.5, window=6)
    gains = [0.1, 0.3, 0.2, 0.0, 0.4, 0.2]
    for u, g in enumerate(gains[:2]):
        d.observe(GainScore(update=u, current=1.0 + g, reference=1.0))
    assert math.isnan(d.gain_t)  # fewer than 3 scores
    for u, g in enumerate(gains[2:], start=2):
        d.observe(GainScore(update=u, current=1.0 + g, reference=1.0))
    m = sum(gains) / 6
    se = math.sqrt(sum((g - m) ** 2 for g in gains) / 5) / math.sqrt(6)
    assert d.gain_t == pytest.approx(m / se)
