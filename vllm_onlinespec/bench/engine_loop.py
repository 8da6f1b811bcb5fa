"""One vLLM engine served request by request while clients arrive: the harness's continuous
protocols (closed loop of C clients, Poisson open loop; bench/arrivals.py sends the requests).

    clients (asyncio, arrivals.py) --submit(token ids)--> queue --> EngineLoop thread
        add_request / step() / resolve the finished requests' futures
        every window_s: a Probe (vLLM's spec counters, tokens generated so far, drafter
        version and learner updates from the worker)

A server's request loop does the same: requests join the running batch between engine steps,
the learner trains beside it, and nothing pauses for it. The thread is the engine's only user
(vLLM's LLMEngine is not thread-safe); clients only touch the queue and their futures. Windows
of the stream (tok/s, acceptance, TPOT, drafter version per window) follow from consecutive
probes (`windows`, pure), so nothing here needs a clock a test cannot control.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_onlinespec.bench.results import RequestResult, WaveResult


@dataclass(frozen=True)
class Probe:
    """Cumulative counters of the engine at t_s (seconds since the loop started)."""

    t_s: float
    output_tokens: int  # generated so far, every request, finished or not
    drafts: int
    draft_tokens: int
    accepted: int
    version: int = 0  # drafter version published by the learner (0: frozen / no learner)
    learner_updates: int = 0


@dataclass
class Finished:
    """What a request's future resolves to."""

    output: Any  # vLLM's final RequestOutput
    submit_s: float  # on the loop's clock (the probes' too)
    finish_s: float


# (drafts, draft_tokens, accepted, version, learner_updates): read between engine steps
ProbeFn = Callable[[], tuple[int, int, int, int, int]]


class EngineLoop:
    """Drives `engine` (vLLM's LLMEngine: add_request, step, has_unfinished_requests) from its
    own thread. `submit(prompt_token_ids)` returns a concurrent.futures.Future of Finished."""

    def __init__(self, engine, params, probe: ProbeFn, *, window_s: float,
                 clock: Callable[[], float] = time.perf_counter, idle_wait_s: float = 0.005):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        self.engine, self.params, self.probe_fn = engine, params, probe
        self.window_s, self.clock, self.idle_wait_s = window_s, clock, idle_wait_s
        self.probes: list[Probe] = []
        self.error: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._calls: queue.Queue = queue.Queue()  # between_steps: run on the loop thread
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._sent: dict[str, float] = {}
        self._seen: dict[str, int] = {}  # tokens already counted per request (outputs are cumulative)
        self._tokens = 0
        self._next_id = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="onlinespec-engine-loop",
                                        daemon=True)
        self._t0 = 0.0

    def now(self) -> float:
        return self.clock() - self._t0

    def start(self) -> "EngineLoop":
        self._t0 = self.clock()
        self.probes.append(self._probe())
        self._thread.start()
        return self

    def submit(self, prompt_token_ids: Sequence[int]) -> concurrent.futures.Future:
        fut = self._future()
        if not fut.done():
            self._inbox.put((list(prompt_token_ids), fut, self.now()))
        return fut

    def between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the loop thread between two engine steps (the engine's only user), e.g.
        swapping the target's weights mid-stream; the future holds its result or exception.
        Requests in flight keep running after it; a probe is taken right after it."""
        fut = self._future()
        if not fut.done():
            self._calls.put((fn, fut))
        return fut

    def _future(self) -> concurrent.futures.Future:
        """A new future, already failed when the loop has stopped or its engine failed."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None or self._stop.is_set():
            fut.set_exception(RuntimeError(self.error or "the engine loop is closed"))
        return fut

    def close(self) -> list[Probe]:
        """Stop after the requests in flight finished; the final probe closes the last window."""
        self._stop.set()
        self._thread.join()
        return self.probes

    # -- the thread ---------------------------------------------------------------------------
    def _probe(self) -> Probe:
        drafts, dtok, acc, version, updates = self.probe_fn()
        return Probe(self.now(), self._tokens, drafts, dtok, acc, version, updates)

    def _add_waiting(self) -> None:
        while True:
            try:
                ids, fut, sent = self._inbox.get_nowait()
            except queue.Empty:
                return
            rid = f"req-{self._next_id}"
            self._next_id += 1
            try:
                self.engine.add_request(rid, {"prompt_token_ids": ids}, self.params)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                fut.set_exception(e)
                continue
            self._pending[rid] = fut
            self._sent[rid] = sent
            self._seen[rid] = 0

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the caller decides; serving goes on
                fut.set_exception(e)
            self.probes.append(self._probe())  # a window edge where the call happened

    def _collect(self, outputs) -> None:
        for o in outputs:
            rid = o.request_id if o.request_id in self._pending else o.request_id.rsplit("-", 1)[0]
            if rid not in self._pending:
                continue
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            self._tokens += n - self._seen[rid]
            self._seen[rid] = n
            if o.finished:
                del self._seen[rid]
                self._pending.pop(rid).set_result(Finished(o, self._sent.pop(rid), self.now()))

    def _run(self) -> None:
        next_probe = self.window_s
        try:
            while True:
                self._run_calls()
                self._add_waiting()
                if self._pending:
                    self._collect(self.engine.step())
                elif self._stop.is_set() and self._inbox.empty():
                    break
                else:
                    time.sleep(self.idle_wait_s)  # no request in flight: wait for a client
                if self.now() >= next_probe:
                    self.probes.append(self._probe())
                    next_probe += self.window_s
            self.probes.append(self._probe())
        except Exception as e:  # noqa: BLE001 - every waiting client hears of it
            self.error = f"{type(e).__name__}: {e}"
            for fut in self._pending.values():
                fut.set_exception(RuntimeError(self.error))
            self._pending.clear()
            for waiting in (self._inbox, self._calls):  # both hold (..., future, ...) tuples
                while not waiting.empty():
                    waiting.get_nowait()[1].set_exception(RuntimeError(self.error))


# -- windows (pure) ---------------------------------------------------------------------------------

def windows(probes: Sequence[Probe], requests: Sequence[RequestResult]) -> list[WaveResult]:
    """One WaveResult per pair of consecutive probes: the tokens generated, drafts and accepted
    tokens between them, the requests that finished in (t0, t1] (their count and mean TPOT), the
    drafter versions at both ends. Wall times add up to the whole stream: nothing is left out.
    Sets each request's `wave` to the window it finished in."""
    out: list[WaveResult] = []
    done = sorted((r for r in requests if r.finish_s is not None), key=lambda r: r.finish_s)
    j = 0
    for i, (a, b) in enumerate(zip(probes, probes[1:])):
        fin = []
        while j < len(done) and (done[j].finish_s <= b.t_s or i == len(probes) - 2):
            done[j].wave = i
            fin.append(done[j])
            j += 1
        tpots = [r.tpot_ms for r in fin if r.tpot_ms == r.tpot_ms]
        out.append(WaveResult(
            index=i, prompts=len(fin), output_tokens=b.output_tokens - a.output_tokens,
            wall_s=b.t_s - a.t_s, drafts=b.drafts - a.drafts,
            draft_tokens=b.draft_tokens - a.draft_tokens, accepted=b.accepted - a.accepted,
            tpot_ms=sum(tpots) / len(tpots) if tpots else float("nan"),
            version_start=a.version, version_end=b.version, learner_updates=b.learner_updates,
            t_start_s=a.t_s))
    return out


def version_at(probes: Sequence[Probe], t_s: float) -> int:
    """The drafter version of the last probe at or before t_s (the first probe's before it)."""
    v = probes[0].version if probes else 0
    for p in probes:
        if p.t_s > t_s:
            break
        v = p.version
    return v
