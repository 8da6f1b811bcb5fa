"""The continuous protocol's engine loop (bench/engine_loop.py) against a fake engine, its
windows, and the bench CLI's protocol checks. The real engine: tests/test_engine_loop_vllm.py."""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field

import pytest

from vllm_onlinespec.bench import arrivals as A
from vllm_onlinespec.bench.engine_loop import EngineLoop, Probe, version_at, windows
from vllm_onlinespec.bench.report import Row, summarize_seeds
from vllm_onlinespec.bench.results import RequestResult


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool
    metrics: object = None


@dataclass
class FakeEngine:
    """Each step() adds one token to every running request; a request of prompt length n
    finishes after n tokens. Optionally fails at step `fail_at`. Counts the largest batch."""

    fail_at: int | None = None
    running: dict[str, list] = field(default_factory=dict)
    steps: int = 0
    max_batch: int = 0
    thread: set = field(default_factory=set)

    def add_request(self, rid, prompt, params):
        self.thread.add(threading.get_ident())
        if not prompt["prompt_token_ids"]:
            raise ValueError("empty prompt")
        self.running[f"{rid}-abcd1234"] = [len(prompt["prompt_token_ids"]), []]

    def step(self):
        self.thread.add(threading.get_ident())
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("engine died")
        self.max_batch = max(self.max_batch, len(self.running))
        out = []
        for rid, (n, toks) in list(self.running.items()):
            toks.append(len(toks))
            done = len(toks) >= n
            out.append(_Output(rid, [_Completion(list(toks))], done))
            if done:
                del self.running[rid]
        time.sleep(0.001)
        return out


def _probe_counts(engine):
    def probe():
        return (engine.steps, 2 * engine.steps, engine.steps, engine.steps // 10, engine.steps)
    return probe


def test_closed_loop_serves_every_request_counts_every_token():
    eng = FakeEngine()
    loop = EngineLoop(eng, None, _probe_counts(eng), window_s=0.01).start()
    prompts = [[1] * n for n in (3, 5, 2, 7, 4, 6)]
    records = A.run(A.parse_arrivals("closed:2"), prompts, loop.submit)
    probes = loop.close()
    assert [r.error for r in records] == [None] * 6
    assert [len(r.result.output.outputs[0].token_ids) for r in records] == [3, 5, 2, 7, 4, 6]
    assert eng.max_batch == 2  # two clients: never more than two requests in the engine
    assert len(eng.thread) == 1  # the engine is touched by the loop's thread only
    assert probes[-1].output_tokens == 27 and probes[0].output_tokens == 0
    assert all(a.t_s <= b.t_s for a, b in zip(probes, probes[1:]))
    for r in records:
        assert 0 <= r.result.submit_s <= r.result.finish_s <= probes[-1].t_s


def test_engine_failure_fails_every_waiting_request_and_later_submits():
    eng = FakeEngine(fail_at=4)
    loop = EngineLoop(eng, None, _probe_counts(eng), window_s=1.0).start()
    records = A.run(A.parse_arrivals("closed:3"), [[1] * 9] * 5, loop.submit)
    loop.close()
    assert loop.error == "RuntimeError: engine died"
    assert all(r.error and "engine died" in r.error for r in records)
    with pytest.raises(RuntimeError, match="engine died"):
        loop.submit([1]).result()


def test_between_steps_runs_on_the_loop_thread_between_steps():
    """A mid-stream call (the target swap) runs on the engine's own thread while requests are
    in flight, its result or exception reaches the caller, serving goes on, and a probe marks
    the moment; after an engine failure a call is refused."""
    eng = FakeEngine()
    loop = EngineLoop(eng, None, _probe_counts(eng), window_s=10.0).start()
    first = [loop.submit([1] * 30) for _ in range(2)]
    while eng.steps < 3:
        time.sleep(0.001)
    seen = {}

    def swap():
        seen.update(thread=threading.get_ident(), running=len(eng.running), steps=eng.steps)
        return {"seconds": 0.0}

    assert loop.between_steps(swap).result(timeout=5) == {"seconds": 0.0}
    with pytest.raises(ValueError, match="bad folder"):
        loop.between_steps(lambda: (_ for _ in ()).throw(ValueError("bad folder"))).result(5)
    later = loop.submit([1] * 3)
    probes = loop.close()
    assert {seen["thread"]} | eng.thread == eng.thread and len(eng.thread) == 1
    assert seen["running"] == 2 and 3 <= seen["steps"] < 30  # mid-stream, requests in flight
    assert [len(f.result().output.outputs[0].token_ids) for f in first + [later]] == [30, 30, 3]
    assert any(0 < p.t_s < probes[-1].t_s and p.drafts == seen["steps"] for p in probes)
    dead = EngineLoop(FakeEngine(fail_at=1), None, _probe_counts(FakeEngine()), window_s=1.0).start()
    dead.submit([1, 2]).exception(timeout=5)
    dead.close()
    with pytest.raises(RuntimeError, match="engine died"):
        dead.between_steps(lambda: None).result(timeout=5)


def test_a_bad_request_fails_alone():
    eng = FakeEngine()
    loop = EngineLoop(eng, None, _probe_counts(eng), window_s=1.0).start()
    records = A.run(A.parse_arrivals("poisson:inf"), [[1, 1], [], [1, 1, 1]], loop.submit)
    loop.close()
    assert [r.error is None for r in records] == [True, False, True]
    assert "empty prompt" in records[1].error and loop.error is None


def _req(i, finish, tokens=10, tpot=50.0):
    return RequestResult(index=i, prompt_id=str(i), category="c", wave=-1, output_tokens=tokens,
                         tpot_ms=tpot, acceptance_length=1.5, submit_s=finish - 1,
                         finish_s=finish)


def test_windows_add_up_to_the_stream():
    probes = [Probe(0.0, 0, 0, 0, 0, 0, 0), Probe(10.0, 40, 20, 80, 30, 1, 5),
              Probe(20.0, 100, 50, 200, 90, 3, 12), Probe(23.0, 110, 55, 220, 95, 3, 13)]
    reqs = [_req(0, 4.0), _req(1, 10.0, tpot=70.0), _req(2, 15.0), _req(3, 22.5)]
    ws = windows(probes, reqs)
    assert [w.prompts for w in ws] == [2, 1, 1]
    assert [r.wave for r in reqs] == [0, 0, 1, 2]  # a request finishing at a boundary: earlier
    assert [w.output_tokens for w in ws] == [40, 60, 10]
    assert sum(w.wall_s for w in ws) == pytest.approx(23.0)
    assert ws[0].acceptance_length == pytest.approx((30 + 20) / 20)
    assert ws[1].tok_s == pytest.approx(6.0) and ws[0].tpot_ms == pytest.approx(60.0)
    assert (ws[1].version_start, ws[1].version_end, ws[1].learner_updates) == (1, 3, 12)
    assert [w.t_start_s for w in ws] == [0.0, 10.0, 20.0]
    assert version_at(probes, 15.0) == 1 and version_at(probes, 25.0) == 3
    assert version_at(probes, -1.0) == 0


def _row(arm, tok_s, acc, err=None):
    nan = float("nan")
    return Row(arm=arm, tok_s=tok_s, speedup=tok_s / 10, tpot_ms=nan, acceptance_length=acc,
               early=nan, late=nan, first_20=acc, last_quarter=acc, drafter_version=0,
               learner_updates=0, output_tokens=1, startup_s=0, serve_s=1, catch_up_s=0,
               error=err)


def test_seed_summary_median_and_spread():
    rows = summarize_seeds([[_row("nospec", 10, 1.0), _row("ogd", 12, 1.4)],
                            [_row("nospec", 11, 1.0), _row("ogd", 9, 1.2, "boom")],
                            [_row("nospec", 13, 1.0), _row("ogd", 15, 1.6)]],
                           failed=[{"ogd": 1}, {}, {"ogd": 2}])
    ogd = rows[1]
    assert (ogd.arm, ogd.seeds) == ("ogd", 3)
    assert ogd.median["tok_s"] == 12 and ogd.spread["tok_s"] == (9, 15)
    assert ogd.median["acceptance_length"] == pytest.approx(1.4)
    assert ogd.failed_requests == 3 and ogd.errors == ["boom"]
    assert "tpot_ms" not in rows[0].median  # NaN everywhere: no figure rather than a NaN


def _args(**kw):
    base = dict(arrivals="", catch_up_s=0.0, window_s=20.0, seeds=None, seed=0, swap_to=None,
                swap_at=0, temperature=0.0)
    return argparse.Namespace(**{**base, **kw})


def test_bench_protocol_flags_fail_in_one_line():
    from vllm_onlinespec.bench.cli import check_protocol, parse_seeds

    check_protocol(_args(arrivals="closed:4"))
    with pytest.raises(ValueError, match="expected closed:C"):
        check_protocol(_args(arrivals="closed:zero"))
    with pytest.raises(ValueError, match="nothing is left out"):
        check_protocol(_args(arrivals="poisson:0.5", catch_up_s=8))
    with pytest.raises(ValueError, match="--window-s"):
        check_protocol(_args(arrivals="closed:1", window_s=0))
    check_protocol(_args(arrivals="closed:4", swap_to="m", swap_at=3))
    for bad in (dict(swap_to="m"), dict(swap_at=3)):
        with pytest.raises(ValueError, match="--swap-to MODEL and --swap-at N"):
            check_protocol(_args(arrivals="closed:4", **bad))
    with pytest.raises(ValueError, match=r"--swap-at must be >= 1 \(got -1\)"):
        check_protocol(_args(arrivals="closed:4", swap_to="m", swap_at=-1))
    with pytest.raises(ValueError, match="give --arrivals"):
        check_protocol(_args(swap_to="m", swap_at=3))
    check_protocol(_args(temperature=1.0))
    with pytest.raises(ValueError, match=r"--temperature must be >= 0 \(got -1.0\)"):
        check_protocol(_args(temperature=-1.0))
    with pytest.raises(ValueError, match="drop --arrivals or --temperature"):
        check_protocol(_args(arrivals="closed:4", temperature=1.0))
    assert parse_seeds(_args(seeds="0, 1,2")) == [0, 1, 2]
    assert parse_seeds(_args(seed=5)) == [5]
    for bad in ("0,0", "a,b", ","):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(_args(seeds=bad))
