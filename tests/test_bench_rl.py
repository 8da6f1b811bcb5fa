"""`vllm-onlinespec bench-rl` (bench/rl.py): the schedule, the summary and report math on
synthetic rows, the learner's unthrottled gap, and one small end-to-end run on real engines."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from vllm_onlinespec.bench import rl


def _msgs(k: int) -> list[dict]:
    return [{"role": "user", "content": f"question {k}"}]


def test_schedule_gives_fresh_prompts_distinct_seeds_and_versions():
    rounds = rl.schedule([_msgs(k) for k in range(12)], rounds=3, versions=2, per_round=4, n=4,
                         seed=100)
    assert [r.version for r in rounds] == [0, 1, 1]  # past the last version: the last one
    assert [m[0]["content"] for m in rounds[1].prompts] == [f"question {k}" for k in range(4, 8)]
    # vLLM seeds sample j of a prompt with seed + j: no two samples of the run share a seed
    samples = [s + j for r in rounds for s in r.seeds for j in range(4)]
    assert len(set(samples)) == len(samples) == 48 and min(samples) == 100
    with pytest.raises(ValueError, match="need 16 prompts"):
        rl.schedule([_msgs(0)] * 12, rounds=4, versions=2, per_round=4, n=1)


def test_every_arm_gets_the_same_rounds_and_the_orders_reverse():
    plan = rl.units(["nospec", "frozen", "online"], [0.0, 20.0], lambda a: a == "online")
    assert [u.label for u in plan] == ["nospec", "frozen", "online", "online gap 20s"]
    assert rl.run_order(len(plan), 0) == [0, 1, 2, 3]
    assert rl.run_order(len(plan), 1) == [3, 2, 1, 0]
    a = rl.schedule([_msgs(k) for k in range(8)], rounds=2, versions=2, per_round=4, n=2)
    b = rl.schedule([_msgs(k) for k in range(8)], rounds=2, versions=2, per_round=4, n=2)
    assert a == b  # a pure function of the prompts and settings: the same for every arm


def test_versions_expand_a_series_to_its_base_and_every_checkpoint():
    from vllm_onlinespec.bench.rl import version_names
    from vllm_onlinespec.models import DRIFT, DRIFT_VERSIONS

    assert version_names("smollm2-135m, smollm2-135m-terse") == ["smollm2-135m", "smollm2-135m-terse"]
    names = version_names(DRIFT)
    assert names == ["smollm2-135m"] + [f"{DRIFT}-v{k}" for k in range(1, DRIFT_VERSIONS + 1)]
    assert version_names(f"{DRIFT},/some/folder")[-1] == "/some/folder"


def test_read_prompts_takes_question_prompt_or_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"question": "q0"}, {"prompt": "p1"}, {"messages": [{"role": "user", "content": "m2"}]},
        {"question": "q3", "answer": "x"}]) + "\n")
    got = rl.read_prompts(f, 2, skip=1)
    assert [m[-1]["content"] for m in got] == ["p1", "m2"]
    assert [m[-1]["content"] for m in rl.read_prompts(f, 1, skip=1, tail=2)] == ["q3"]
    with pytest.raises(ValueError, match="needs 9"):
        rl.read_prompts(f, 9)


def _row(label, order, rnd, *, tok, wall, drafts, acc, arm=None, gap=0.0, lk_rows=0, lk_acc=0,
         gate=None, upd=(0, 0), used=0.0):
    return {"arm": arm or label, "label": label, "order": order, "gap_s": gap, "round": rnd,
            "version": rnd, "output_tokens": tok, "wall_s": wall, "tok_s": tok / wall,
            "drafts": drafts, "accepted": acc, "draft_tokens": 4 * drafts,
            "accept_len": (acc + drafts) / drafts if drafts else None,
            "drafter_accept": None if (arm or label) == "vllm-suffix" else (acc - lk_acc) / (drafts - lk_rows),
            "lookup_rows": lk_rows, "lookup_accepted": lk_acc, "gate_shut_share": gate,
            "learner_updates_round": upd[0], "learner_updates_gap": upd[1], "gap_s_used": used}


def test_summary_medians_last_half_and_ratios():
    rows = []
    for o in (0, 1):
        for r in range(4):
            # first half differs wildly: it must not count
            bad = r < 2
            rows.append(_row("frozen", o, r, tok=100, wall=50 if bad else 1.0 + o, drafts=10,
                             acc=0 if bad else 10, gate=0.5))
            rows.append(_row("vllm-suffix", o, r, tok=100, wall=2.0, drafts=10, acc=5))
            rows.append(_row("online", o, r, tok=100, wall=1.0, drafts=10, acc=20 + 10 * o,
                             lk_rows=2, lk_acc=4, upd=(3, 5), used=4.0, gap=20.0))
    s = rl.summarize(rows)
    fr, on = s["arms"]["frozen"], s["arms"]["online"]
    assert fr["accept_len"] == pytest.approx(2.0)  # rounds 2, 3 only
    assert fr["tok_s"] == pytest.approx(statistics_median([100.0, 50.0]))  # per order, then median
    assert fr["gate_shut_share"] == pytest.approx(0.5)
    assert on["accept_len"] == pytest.approx(3.5)  # orders 3.0 and 4.0
    assert on["drafter_accept"] == pytest.approx(((20 - 4) / 8 + (30 - 4) / 8) / 2)
    assert on["learner_updates"] == 16 and on["gap_s_used"] == pytest.approx(4.0)
    assert s["arms"]["vllm-suffix"]["drafter_accept"] is None
    assert s["ratios"]["online / frozen accept_len"] == pytest.approx(3.5 / 2.0)
    assert s["ratios"]["online / frozen tok_s"] == pytest.approx(100 / 75)
    assert s["ratios"]["online / vllm-suffix accept_len"] == pytest.approx(3.5 / 1.5)
    assert s["ratios"]["online / vllm-suffix tok_s"] == pytest.approx(2.0)


def statistics_median(xs):
    import statistics

    return statistics.median(xs)


def test_last_half_keeps_the_later_rounds():
    rows = [{"round": r} for r in range(5)]
    assert [r["round"] for r in rl.last_half(rows)] == [2, 3, 4]
    assert [r["round"] for r in rl.last_half([{"round": 0}])] == [0]


def test_report_writes_json_md_png(tmp_path):
    rows = [_row(a, o, r, tok=64, wall=2.0, drafts=8, acc=4, arm=a)
            for a in ("nospec", "online") for o in (0, 1) for r in range(2)]
    meta = {"date": "2026-12-05", "command": "vllm-onlinespec bench-rl ...", "versions": ["a", "b"],
            "rounds": 2, "prompts_per_round": 2, "n": 2, "max_tokens": 16, "gaps": [0.0],
            "push": "state_dict", "wall_s": 12.0, "box": "CPU(s): 2"}
    pub = tmp_path / "pub"
    pub.mkdir()
    paths, summary = rl.write_report(rows, tmp_path / "out", meta, pub)
    data = json.loads((pub / "rl_rollouts.json").read_text())
    assert len(data["rows"]) == 8 and set(data["summary"]["arms"]) == {"nospec", "online"}
    assert {"arm", "order", "round", "tok_s", "accept_len", "drafter_accept", "wall_s"} <= set(
        data["rows"][0])
    md = (pub / "rl_rollouts.md").read_text()
    assert "2026-12-05" in md and "| online |" in md and "CPU(s): 2" in md
    assert (pub / "rl_rollouts.png").stat().st_size > 1000


def _learner(feed: dict, **cfg):
    import torch

    from vllm_onlinespec.learner.learner import OnlineLearner

    def make_batch(_buf):
        if feed["left"] <= 0:
            return None
        feed["left"] -= 1
        return torch.ones(2, 4)

    return OnlineLearner(torch.nn.Linear(4, 1),
                         {"pacing": {"learner_cpu_share": 0.25, "share_control": "fixed"}, **cfg},
                         make_batch=make_batch, loss_fn=lambda m, b: (m(b).pow(2).mean(), {}),
                         ready=lambda _b: feed["left"] > 0, idle_poll_s=0.01)


def test_unthrottled_gives_full_share_for_the_gap_then_restores_it():
    """The gap RPC's core (learner.unthrottled): share 1 for the gap while there is feedback,
    the configured share afterwards."""
    ln = _learner({"left": 10**9})
    assert ln.share == 0.25
    assert ln.unthrottled(1.0) == {"seconds": pytest.approx(0.0, abs=0.05), "updates": 0}  # not running
    seen = []
    ln.start()
    try:
        t = threading.Thread(target=lambda: seen.append(ln.unthrottled(0.6)))
        t.start()
        time.sleep(0.2)
        assert ln.share == 1.0
        t.join(5)
    finally:
        ln.stop()
    assert seen[0]["seconds"] == pytest.approx(0.6, abs=0.2) and seen[0]["updates"] > 0
    assert ln.share == 0.25


def _starved_learner():
    """A learner whose first update takes 1 s: beside serving at share 0.25 it then earns a
    3 s pacing pause."""
    ln = _learner({"left": 10**9})
    slow = {"first": True}
    make = ln.make_batch

    def starved_first(buf):
        if slow.pop("first", False):
            time.sleep(1.0)
        return make(buf)

    ln.make_batch = starved_first
    return ln


def test_a_gap_cuts_the_pacing_pause_short():
    """An update starved beside serving earns a long pause at the old share (busy x 3 at 0.25);
    a gap must not wait for it to run out."""
    ln = _starved_learner()
    ln.start()
    try:
        time.sleep(1.3)  # the first update is done, the learner sleeps in its pause
        assert ln.updates == 1
        out = ln.unthrottled(1.0)
    finally:
        ln.stop()
    assert out["updates"] > 1


def test_unthrottled_returns_once_caught_up():
    """Back early once no batch is ready; what the gap trained is published at its end even
    between two publishes of the cadence (every 4th update here)."""
    feed = {"left": 3}
    ln = _learner(feed, publish={"every_n_updates": 4})
    ln.start()
    try:
        out = ln.unthrottled(5.0)
    finally:
        ln.stop()
    # All three batches trained (the thread may take the first before the call begins), back
    # long before the 5 s, the share restored.
    assert ln.updates == 3 and 1 <= out["updates"] <= 3, out
    assert out["seconds"] < 4.0 and ln.share == 0.25
    assert ln.published_version == 1


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """The verb on a real engine, once: 2 versions, 2 rounds, 2 prompts x n=2 x 16 tokens, the
    learning arm, one order (the orders' reversal and the other arms' rows are tested above on
    synthetic rows; vLLM's own arms are plain engines; seeded tokens whatever the drafter's
    weights: test_invariant_sampling_vllm)."""
    from vllm_onlinespec.cli import main

    out = tmp_path_factory.mktemp("rl")
    # The arm's process runs vLLM's in-process engine core (~20 s less per start on 2 cores; the
    # multiprocess layout is served by the shell examples and the wheel's soak).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        rc = main(["bench-rl", "--quick", "--arms", "online", "--orders", "1", "--gap-s", "2",
                   "--dtype", "float32", "--out", str(out)])
    data = json.loads((out / "rl_rollouts.json").read_text())
    return rc, out, data


@pytest.mark.vllm
def test_bench_rl_end_to_end(e2e):
    rc, out, data = e2e
    assert rc == 0, data["meta"]["errors"]
    got = {(r["arm"], r["order"], r["round"]) for r in data["rows"]}
    assert got == {("online", 0, r) for r in (0, 1)}
    assert all(r["accept_len"] is not None for r in data["rows"])
    # The drafter's own accept rate exists exactly where it drafted (the budget may give a round
    # to the tree or to plain steps alone: a quick run may never draft with it; the rate's
    # arithmetic is tested on synthetic rows above).
    for r in data["rows"]:
        assert (r["drafter_accept"] is None) == (r["drafts"] == r["lookup_rows"]), r
    assert all(r["push_s"] > 0 for r in data["rows"] if r["round"] == 1)
    # The learner trained in idle time only (pacing.idle_only): while sampling, at most the one
    # update already running when the round began (it may start in the push's idle seconds).
    assert data["meta"]["learn_while_rolling"] is False
    assert all(r["learner_updates_round"] <= 1 for r in data["rows"]), data["rows"]
    assert sum(r["learner_updates_gap"] for r in data["rows"]) > 0, data["rows"]
    assert (out / "rl_rollouts.png").is_file()


def test_a_server_between_requests_gives_the_learner_full_share():
    """No engine step for pacing.idle_after_s (the session's probe): the learner's share is 1
    and a pacing pause it sleeps in ends; a step starting brings the configured share back."""
    from vllm_onlinespec.serving.session import OnlineSession

    session = OnlineSession.__new__(OnlineSession)  # only the probe's state and config
    session.cfg = SimpleNamespace(pacing=SimpleNamespace(idle_after_s=0.3))
    session.step_began()
    ln = _starved_learner()
    ln.idle_probe = session.serving_idle
    assert ln.share == 0.25  # a step is running
    session._in_step, session._last_step = False, time.monotonic()  # what after_step records
    ln.start()
    try:
        time.sleep(1.3)  # first update done; idle for 1.3 s > 0.3 s: the pause is cut short
        assert ln.share == 1.0
        assert ln.updates > 1
        session.step_began()
        assert ln.share == 0.25 and not session.serving_idle()
    finally:
        ln.stop()


def test_idle_only_learner_trains_in_idle_time_and_yields_within_one_step():
    """pacing.idle_only: no update while serving steps; the idle probe (a server between
    requests) or a gap (`unthrottled`) starts training; a step arriving stops it at the next
    update boundary."""
    ln = _learner({"left": 10**9}, pacing={"learner_cpu_share": 0.25, "share_control": "fixed",
                                           "idle_only": True})
    idle = {"now": False}
    ln.idle_probe = lambda: idle["now"]
    ln.start()
    try:
        time.sleep(0.4)
        assert ln.updates == 0  # serving steps: the cores are serving's
        idle["now"] = True
        time.sleep(0.3)
        assert ln.updates > 0 and ln.share == 1.0
        idle["now"] = False  # work arrives
        time.sleep(0.1)  # an update in flight finishes (each takes well under 0.1 s here)
        frozen_at = ln.updates
        time.sleep(0.4)
        assert ln.updates == frozen_at
        out = ln.unthrottled(0.3)  # an RL gap
        assert out["updates"] > 0
        after = ln.updates
        time.sleep(0.3)
        assert ln.updates == after  # the gap is over: idle again only when serving idles
    finally:
        ln.stop()


def test_round_rows_carry_the_budgets_options_and_the_step_profile():
    """Per round: the share of steps the budget ran each option on (a delta of the worker's
    counters) and the worker's ms per step per phase, `engine` the rest of the wall time."""
    from vllm_onlinespec.bench.rl import option_shares, step_ms
    from vllm_onlinespec.serving.stats import CutterStats

    st = lambda steps: SimpleNamespace(cutter=CutterStats(option_steps=steps))  # noqa: E731
    assert option_shares(st({"plain": 10, "tree": 0, "drafter": 2}),
                         st({"plain": 40, "tree": 10, "drafter": 2})) == {
        "plain": 0.75, "tree": 0.25, "drafter": 0.0}
    assert option_shares(st({}), st({})) is None
    p0 = {"steps": 10, "target_s": 1.0, "sample_s": 0.1, "draft_s": 0.2, "ours_s": 0.05,
          "ours_in_sample_tokens_s": 0.02, "sample_tokens_s": 0.4, "per_step_ms": {}}
    p1 = {**{k: 2 * v for k, v in p0.items() if k != "per_step_ms"}, "per_step_ms": {}}
    got = step_ms(p0, p1, wall=3.0)
    assert got["steps"] == 10 and got["target"] == pytest.approx(100.0)
    assert got["draft"] == pytest.approx(20.0) and got["other"] == pytest.approx(8.0)
    assert got["engine"] == pytest.approx(300.0 - 100 - 10 - 20 - 5 - 8)
    assert step_ms({}, {}, 3.0) is None


def test_the_report_says_where_the_engine_steps_went():
    """Per arm and order: steps per round, step-weighted ms per phase, the budget's option
    shares; arms without a step profile (vLLM's own) are left out."""
    from vllm_onlinespec.bench.rl import steps_lines

    def row(label, order, steps, target, shares):
        ms = {"steps": steps, "target": target, "sample": 2.0, "draft": 1.0, "ours": 0.5,
              "other": 0.3, "engine": 2.0}
        return {"label": label, "order": order, "step_ms": ms, "option_shares": shares}

    rows = [row("frozen", 0, 100, 100.0, {"plain": 1.0, "tree": 0.0, "drafter": 0.0}),
            row("frozen", 0, 300, 120.0, {"plain": 0.5, "tree": 0.5, "drafter": 0.0}),
            {"label": "nospec", "order": 0, "step_ms": None}]
    lines = steps_lines(rows)
    assert lines[-1] == ("| frozen | 0 | 200 | 115.00 | 2.00 | 1.00 | 0.50 | 0.30 | 2.00 | "
                         "0.62 / 0.38 / 0.00 |")
    assert not any("nospec" in ln for ln in lines)
    assert steps_lines([{"label": "nospec", "order": 0}]) == []


def test_plot_adds_the_learners_gain_panel_where_a_learning_arm_reports_it(tmp_path):
    import struct

    def width(png: Path) -> int:  # the IHDR chunk: 8-byte signature, length, type, width
        return struct.unpack(">I", png.read_bytes()[16:20])[0]

    rows = [_row(a, o, r, tok=64, wall=2.0, drafts=8, acc=4, arm=a)
            for a in ("frozen", "online") for o in (0, 1) for r in range(3)]
    two = width(rl.plot(rows, tmp_path / "two.png", "t"))
    for r in rows:
        r["learner_gain"] = 0.05 * r["round"] if r["arm"] == "online" else None
    three = width(rl.plot(rows, tmp_path / "three.png", "t"))
    assert three == round(two * 3 / 2), (two, three)  # one 5.5-inch panel more
