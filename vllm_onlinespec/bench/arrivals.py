"""Arrival processes for serving benchmarks: when each request of a stream is sent.

Two processes, both over a prompt list in a given order and bounded by a number of requests
and/or a duration:

    closed loop  C clients, each sending its next request when its previous one finished: the
                 load adapts to the server (what `vllm bench serve --max-concurrency C` does).
    open loop    Poisson arrivals at rate λ requests/s (exponential gaps from a seeded
                 Generator), whatever the server does: the load a public endpoint sees, where a
                 slow server builds a queue instead of slowing its clients down.

The schedule math is pure functions (lists of floats / Arrivals, same seed -> same schedule);
the driver is asyncio because the engines' request interfaces are (vLLM's AsyncLLM.generate, an
OpenAI HTTP client): `submit(prompt)` returns an awaitable (a coroutine, an asyncio or a
concurrent.futures Future, so a thread pool works too) and the driver records when each request
was sent, when it finished and what it returned. Time is the running loop's clock
(`loop.time()`), so a test can run the driver on a virtual-time loop without sleeping.

A prompt is sent at most once (a stream is never recycled): online learning from a prompt that
comes back would measure memory, not learning. Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Submit = Callable[[Any], Any]  # prompt -> awaitable (or a plain value: finished at once)


@dataclass(frozen=True)
class Arrival:
    index: int  # position in the sequence of requests sent, 0, 1, ...
    prompt_index: int  # into the prompt list
    t_s: float  # scheduled send time, seconds after the start (closed loop: 0, sent when free)


@dataclass
class RequestRecord:
    index: int
    prompt_index: int
    scheduled_s: float  # Arrival.t_s; an open loop sends late only when a concurrency cap waits
    submit_s: float  # seconds after the start, when submit() was called
    finish_s: float  # when its awaitable completed (or failed)
    result: Any = None  # what the awaitable returned
    error: str | None = None  # "Type: message" when submit or its awaitable raised

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.submit_s

    @property
    def lag_s(self) -> float:
        """How late it was sent: > 0 means the client could not keep the schedule."""
        return self.submit_s - self.scheduled_s


@dataclass(frozen=True)
class ArrivalProcess:
    """What a benchmark asks for: `closed:C` or `poisson:RATE` (see parse_arrivals)."""

    kind: str  # "closed" | "poisson"
    concurrency: int | None = None  # closed: clients; poisson: optional cap on requests in flight
    rate: float | None = None  # poisson: requests/s (inf = all at t = 0)
    max_requests: int | None = None
    max_duration_s: float | None = None
    seed: int = 0  # the Poisson gaps
    order_seed: int | None = None  # None = the prompt list's own order, else a seeded shuffle


# -- schedule math (pure) -------------------------------------------------------------------------

def stream_order(n_prompts: int, seed: int | None = None) -> list[int]:
    """Prompt indices in sending order: the list's own order, or a seeded permutation (so arms
    or repeats of a benchmark can serve the same prompts in different, reproducible orders)."""
    if seed is None:
        return list(range(n_prompts))
    return [int(i) for i in np.random.default_rng(seed).permutation(n_prompts)]


def poisson_gaps(rate: float, n: int, seed: int) -> list[float]:
    """n inter-arrival gaps of a Poisson process at `rate` per second: Exp(mean 1 / rate)."""
    if not rate > 0:
        raise ValueError(f"a Poisson rate must be > 0 requests/s, got {rate}")
    if n < 0:
        raise ValueError(f"the number of arrivals must be >= 0, got {n}")
    if math.isinf(rate):
        return [0.0] * n  # every request at once: the burst that measures peak throughput
    return [float(g) for g in np.random.default_rng(seed).exponential(1.0 / rate, n)]


def poisson_schedule(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s after the start) of the first n arrivals: cumulative gaps, non-decreasing;
    the first comes after one gap, as in a Poisson process started at t = 0."""
    return [float(t) for t in np.cumsum(poisson_gaps(rate, n, seed))]


def bound_schedule(times: Sequence[float], max_requests: int | None = None,
                   max_duration_s: float | None = None) -> list[float]:
    """The prefix of a non-decreasing schedule within both bounds (None = unbounded): at most
    max_requests times, none after max_duration_s (a request due at exactly the end is sent)."""
    out = list(times[:max_requests] if max_requests is not None else times)
    if max_duration_s is not None:
        out = [t for t in out if t <= max_duration_s]
    return out


def _check_bounds(max_requests: int | None, max_duration_s: float | None) -> None:
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if max_duration_s is not None and not max_duration_s >= 0:
        raise ValueError(f"max_duration_s must be >= 0, got {max_duration_s}")


def open_loop_arrivals(n_prompts: int, rate: float, *, max_requests: int | None = None,
                       max_duration_s: float | None = None, seed: int = 0,
                       order_seed: int | None = None) -> list[Arrival]:
    """A Poisson stream over the prompts: at most one request per prompt, at most max_requests,
    none after max_duration_s."""
    _check_bounds(max_requests, max_duration_s)
    order = stream_order(n_prompts, order_seed)
    times = bound_schedule(poisson_schedule(rate, n_prompts, seed), max_requests, max_duration_s)
    return [Arrival(i, order[i], t) for i, t in enumerate(times)]


def closed_loop_order(n_prompts: int, *, max_requests: int | None = None,
                      order_seed: int | None = None) -> list[Arrival]:
    """The requests a closed loop sends, in order (t_s = 0: each goes when a client is free;
    a duration bound is applied by the driver, since finish times are not known in advance)."""
    _check_bounds(max_requests, None)
    order = stream_order(n_prompts, order_seed)[:max_requests]
    return [Arrival(i, p, 0.0) for i, p in enumerate(order)]


def parse_arrivals(spec: str, **kw) -> ArrivalProcess:
    """'closed:C' or 'poisson:RATE' ('poisson:inf' = all at once) -> ArrivalProcess; keyword
    arguments fill the other fields (bounds, seeds, a Poisson concurrency cap)."""
    kind, _, value = spec.partition(":")
    try:
        if kind == "closed":
            c = int(value)
            if c < 1:
                raise ValueError
            return ArrivalProcess("closed", concurrency=c, **kw)
        if kind == "poisson":
            rate = float(value)
            if not rate > 0:
                raise ValueError
            return ArrivalProcess("poisson", rate=rate, **kw)
    except ValueError:
        pass
    raise ValueError(f"arrival process {spec!r}: expected closed:C (C >= 1 clients) or "
                     f"poisson:RATE (requests/s > 0, or inf)")


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once (a request finishing at t is out before one sent at t)."""
    events = sorted([(r.submit_s, 1) for r in records] + [(r.finish_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


# -- driver (asyncio) -----------------------------------------------------------------------------

async def _one(prompts: Sequence[Any], a: Arrival, submit: Submit, t0: float,
               on_schedule: bool = True) -> RequestRecord:
    """Send one request and await it. on_schedule=False (closed loop): it was due the moment
    its client became free, i.e. now, so its lag is 0."""
    loop = asyncio.get_running_loop()
    now = loop.time() - t0
    rec = RequestRecord(a.index, a.prompt_index, a.t_s if on_schedule else now, now, float("nan"))
    try:
        r = submit(prompts[a.prompt_index])
        if isinstance(r, concurrent.futures.Future):
            r = asyncio.wrap_future(r)
        rec.result = (await r) if inspect.isawaitable(r) else r
    except Exception as e:  # noqa: BLE001 - a failed request is a measurement, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    rec.finish_s = loop.time() - t0
    return rec


async def drive_open_loop(prompts: Sequence[Any], arrivals: Sequence[Arrival], submit: Submit,
                          max_concurrency: int | None = None) -> list[RequestRecord]:
    """Send each arrival at its time, whether or not earlier ones finished (with
    max_concurrency, a request due while that many are in flight waits for a slot: lag_s shows
    it). Records in arrival order."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(a: Arrival) -> RequestRecord:
        if slots is None:
            return await _one(prompts, a, submit, t0)
        async with slots:
            return await _one(prompts, a, submit, t0)

    tasks = []
    for a in sorted(arrivals, key=lambda a: (a.t_s, a.index)):
        delay = t0 + a.t_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(a)))
        await asyncio.sleep(0)  # let it call submit now, not after the next sleep
    return sorted(await asyncio.gather(*tasks), key=lambda r: r.index)


async def drive_closed_loop(prompts: Sequence[Any], arrivals: Sequence[Arrival], submit: Submit,
                            concurrency: int, max_duration_s: float | None = None
                            ) -> list[RequestRecord]:
    """C clients over the arrivals in order: each sends the next one as soon as its previous
    request finished; none is sent after max_duration_s (those in flight are awaited)."""
    if concurrency < 1:
        raise ValueError(f"a closed loop needs >= 1 client, got {concurrency}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    queue = iter(arrivals)  # one event loop thread: clients take arrivals strictly in order
    records: list[RequestRecord] = []

    async def client() -> None:
        for a in queue:
            if max_duration_s is not None and loop.time() - t0 > max_duration_s:
                return
            records.append(await _one(prompts, a, submit, t0, on_schedule=False))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


async def drive(process: ArrivalProcess, prompts: Sequence[Any], submit: Submit
                ) -> list[RequestRecord]:
    """Serve `prompts` with `submit` under `process`."""
    if process.kind == "closed":
        arrivals = closed_loop_order(len(prompts), max_requests=process.max_requests,
                                     order_seed=process.order_seed)
        return await drive_closed_loop(prompts, arrivals, submit, process.concurrency or 1,
                                       process.max_duration_s)
    if process.kind == "poisson":
        arrivals = open_loop_arrivals(len(prompts), process.rate or math.inf,
                                      max_requests=process.max_requests,
                                      max_duration_s=process.max_duration_s, seed=process.seed,
                                      order_seed=process.order_seed)
        return await drive_open_loop(prompts, arrivals, submit, process.concurrency)
    raise ValueError(f"unknown arrival process kind {process.kind!r} (closed or poisson)")


def run(process: ArrivalProcess, prompts: Sequence[Any], submit: Submit) -> list[RequestRecord]:
    """drive() from synchronous code (a new event loop)."""
    return asyncio.run(drive(process, prompts, submit))


def summary(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Requests, failures, achieved send rate, mean latency and lag, peak in flight."""
    ok = [r for r in records if r.error is None]
    span = max((r.finish_s for r in records), default=0.0)
    sends = [r.submit_s for r in records]
    return {"requests": len(records), "failed": len(records) - len(ok),
            "duration_s": span,
            "send_rate": (len(sends) - 1) / (max(sends) - min(sends))
            if len(sends) > 1 and max(sends) > min(sends) else float("nan"),
            "mean_latency_s": sum(r.latency_s for r in ok) / len(ok) if ok else float("nan"),
            "mean_lag_s": sum(r.lag_s for r in records) / len(records) if records else float("nan"),
            "max_in_flight": max_in_flight(records)}

