"""Arrival processes (bench/arrivals.py): the schedule math and the asyncio driver.

The driver runs on a virtual-time event loop: `loop.time()` only moves when every task waits
on a timer, and then jumps straight to the next one, so a 100 s schedule takes milliseconds
and the timings are exact.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import selectors

import pytest

from vllm_onlinespec.bench import arrivals as A


class _VirtualSelector:
    """Polls real I/O without waiting; a wait the loop asked for becomes a clock jump."""

    def __init__(self, loop: VirtualTimeLoop, inner: selectors.BaseSelector):
        self._loop, self._inner = loop, inner

    def select(self, timeout=None):
        events = self._inner.select(0)
        if not events:
            if timeout is None:
                raise RuntimeError("deadlock: nothing ready and no timer pending")
            self._loop.now += timeout
        return events

    def __getattr__(self, name):
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        super().__init__()
        self.now = 1000.0
        self._selector = _VirtualSelector(self, self._selector)

    def time(self) -> float:
        return self.now


def run_virtual(coro):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def fake_submit(delays, log=None):
    """submit(prompt) that takes delays[prompt] virtual seconds and returns the prompt; `log`
    collects (event, prompt, in_flight) so tests can watch the concurrency."""
    state = {"in_flight": 0}

    async def submit(prompt):
        state["in_flight"] += 1
        if log is not None:
            log.append(("send", prompt, state["in_flight"]))
        await asyncio.sleep(delays[prompt] if not callable(delays) else delays(prompt))
        state["in_flight"] -= 1
        if log is not None:
            log.append(("done", prompt, state["in_flight"]))
        return f"out:{prompt}"

    return submit


# -- schedule math --------------------------------------------------------------------------------

def test_poisson_mean_rate_within_3_percent():
    rate = 4.0
    gaps = A.poisson_gaps(rate, 20_000, seed=1)
    assert len(gaps) == 20_000 and min(gaps) >= 0
    assert 1.0 / (sum(gaps) / len(gaps)) == pytest.approx(rate, rel=0.03)
    times = A.poisson_schedule(rate, 20_000, seed=1)
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert len(times) / times[-1] == pytest.approx(rate, rel=0.03)
    # Exponential gaps: standard deviation = mean (a regular clock would have none).
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd == pytest.approx(mean, rel=0.05)


def test_poisson_seeds():
    assert A.poisson_schedule(2.0, 50, seed=7) == A.poisson_schedule(2.0, 50, seed=7)
    assert A.poisson_schedule(2.0, 50, seed=7) != A.poisson_schedule(2.0, 50, seed=8)
    assert A.poisson_schedule(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rate must be > 0"):
            A.poisson_gaps(bad, 3, seed=0)


def test_bounds_count_and_time():
    times = A.poisson_schedule(10.0, 1000, seed=3)
    assert len(A.bound_schedule(times, max_requests=17)) == 17
    within = A.bound_schedule(times, max_duration_s=5.0)
    assert within and max(within) <= 5.0 and len(within) < len(times)
    assert times[len(within)] > 5.0  # the prefix: nothing within the bound is dropped
    both = A.bound_schedule(times, max_requests=10, max_duration_s=5.0)
    assert both == times[:10]
    assert A.bound_schedule([0.0, 1.0, 2.0], max_duration_s=1.0) == [0.0, 1.0]
    assert A.bound_schedule(times, max_requests=0) == []


def test_open_loop_arrivals_never_reuse_a_prompt():
    arr = A.open_loop_arrivals(20, rate=1000.0, max_requests=50, seed=0)
    assert len(arr) == 20 and sorted(a.prompt_index for a in arr) == list(range(20))
    assert [a.prompt_index for a in arr] == list(range(20))  # the list's own order by default
    shuffled = A.open_loop_arrivals(20, rate=1000.0, order_seed=5)
    assert sorted(a.prompt_index for a in shuffled) == list(range(20))
    assert [a.prompt_index for a in shuffled] != list(range(20))
    assert shuffled == A.open_loop_arrivals(20, rate=1000.0, order_seed=5)
    assert A.stream_order(20, 5) != A.stream_order(20, 6)
    few = A.open_loop_arrivals(1000, rate=2.0, max_duration_s=10.0, seed=0)
    assert all(a.t_s <= 10.0 for a in few) and 5 < len(few) < 40
    with pytest.raises(ValueError, match="max_requests"):
        A.open_loop_arrivals(5, 1.0, max_requests=-1)


def test_parse_arrivals():
    assert A.parse_arrivals("closed:4") == A.ArrivalProcess("closed", concurrency=4)
    p = A.parse_arrivals("poisson:2.5", max_requests=10, seed=3)
    assert (p.kind, p.rate, p.max_requests, p.seed) == ("poisson", 2.5, 10, 3)
    assert A.parse_arrivals("poisson:inf").rate == math.inf
    for bad in ("closed:0", "closed:x", "poisson:-1", "poisson:", "waves", "gamma:2"):
        with pytest.raises(ValueError, match="expected closed:C"):
            A.parse_arrivals(bad)


def test_max_in_flight():
    r = lambda s, f: A.RequestRecord(0, 0, s, s, f)  # noqa: E731
    assert A.max_in_flight([r(0, 2), r(1, 3), r(2, 4)]) == 2  # 0..2 ends as 2..4 starts
    assert A.max_in_flight([]) == 0


# -- driver ---------------------------------------------------------------------------------------

def test_open_loop_sends_on_schedule_whatever_the_server_does():
    prompts = list(range(30))
    arr = A.open_loop_arrivals(len(prompts), rate=5.0, seed=2)
    recs = run_virtual(A.drive_open_loop(prompts, arr, fake_submit(lambda p: 3.0)))
    assert [r.index for r in recs] == list(range(30))
    for a, r in zip(arr, recs):
        assert r.submit_s == pytest.approx(a.t_s, abs=1e-9)
        assert r.lag_s == pytest.approx(0, abs=1e-9)
        assert r.latency_s == pytest.approx(3.0) and r.result == f"out:{a.prompt_index}"
    assert A.max_in_flight(recs) > 4  # slow server, steady arrivals: a queue builds up


def test_open_loop_concurrency_cap_delays_sends():
    arr = A.open_loop_arrivals(10, rate=math.inf)  # all due at t = 0
    log = []
    recs = run_virtual(A.drive_open_loop(list(range(10)), arr, fake_submit(lambda p: 1.0, log),
                                         max_concurrency=3))
    assert max(n for ev, _, n in log if ev == "send") == 3 == A.max_in_flight(recs)
    assert recs[-1].lag_s == pytest.approx(3.0)  # the 10th waits for three rounds


def test_closed_loop_keeps_c_in_flight_in_stream_order():
    delays = [0.5, 3.0, 0.1, 2.0, 0.7, 0.2, 1.5, 0.3, 0.9, 0.4, 2.5, 0.6]
    order = A.closed_loop_order(len(delays), order_seed=11)
    log = []
    recs = run_virtual(A.drive_closed_loop(list(range(len(delays))), order,
                                           fake_submit(delays, log), concurrency=3))
    sends = [p for ev, p, _ in log if ev == "send"]
    assert sends == [a.prompt_index for a in order]  # issued in stream order
    assert max(n for _, _, n in log) == 3 == A.max_in_flight(recs)  # never more than C
    assert len(recs) == len(delays) and all(r.error is None for r in recs)
    # A client sends its next request the moment its previous one finished: no idle gaps.
    assert all(r.lag_s == 0 for r in recs)
    ends = sorted(r.finish_s for r in recs)
    assert sorted(r.submit_s for r in recs)[3:] == pytest.approx(ends[:len(recs) - 3])


def test_closed_loop_duration_and_count_bounds():
    order = A.closed_loop_order(100, max_requests=40)
    assert len(order) == 40
    recs = run_virtual(A.drive_closed_loop(list(range(100)), order, fake_submit(lambda p: 1.0),
                                           concurrency=2, max_duration_s=4.5))
    assert max(r.submit_s for r in recs) <= 4.5 and len(recs) == 10  # sends at 0, 1, .., 4
    recs = run_virtual(A.drive_closed_loop(list(range(100)), order, fake_submit(lambda p: 0.01),
                                           concurrency=4))
    assert [r.prompt_index for r in recs] == list(range(40))


def test_open_loop_duration_bound_through_drive():
    proc = A.parse_arrivals("poisson:10", max_duration_s=2.0, seed=4)
    recs = run_virtual(A.drive(proc, list(range(1000)), fake_submit(lambda p: 0.05)))
    expected = A.open_loop_arrivals(1000, 10.0, max_duration_s=2.0, seed=4)
    assert len(recs) == len(expected) and max(r.submit_s for r in recs) <= 2.0


def test_failures_threads_and_plain_values_are_recorded():
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def submit(p):
        if p == 1:
            raise RuntimeError("refused")
        if p == 2:
            return pool.submit(lambda: "from a thread")
        if p == 3:
            return "at once"

        async def fail():
            raise ValueError("bad request")
        return fail()

    recs = asyncio.run(A.drive(A.parse_arrivals("closed:2"), [1, 2, 3, 4], submit))
    pool.shutdown()
    assert [r.error for r in recs] == ["RuntimeError: refused", None, None,
                                       "ValueError: bad request"]
    assert [r.result for r in recs] == [None, "from a thread", "at once", None]
    s = A.summary(recs)
    assert s["requests"] == 4 and s["failed"] == 2 and s["max_in_flight"] <= 2
