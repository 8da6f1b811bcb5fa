"""bench-serve's summary over repeats: medians, spread, ratios against nospec and the best
other arm at the same concurrency, failures summed."""

import pytest

from vllm_onlinespec.bench.concurrency import Point, markdown, summarize


def _pt(arm, c, rep, tok_s, failed=0, p50=10.0, accept=None):
    return Point(arm=arm, concurrency=c, repeat=rep, num_prompts=8, completed=8 - failed,
                 failed=failed, duration_s=1.0, output_tok_s=tok_s, mean_tpot_ms=p50,
                 p50_tpot_ms=p50, p99_tpot_ms=2 * p50, acceptance_length=accept)


def test_summary_medians_ratios_and_failures():
    pts = [_pt("nospec", 1, r, v) for r, v in enumerate([10.0, 12.0, 11.0])]
    pts += [_pt("budget", 1, r, v, failed=r == 2, accept=a)
            for r, (v, a) in enumerate([(9.0, 1.2), (14.0, 1.4), (11.0, 1.3)])]
    pts += [_pt("fixed", 1, r, v) for r, v in enumerate([5.0, 6.0, 7.0])]
    pts += [_pt("nospec", 4, r, v) for r, v in enumerate([30.0, 40.0])]  # even count: mean of 2
    rows = {(r.arm, r.concurrency): r for r in summarize(pts)}
    b = rows[("budget", 1)]
    assert (b.tok_s, b.tok_s_min, b.tok_s_max, b.repeats, b.failed) == (11.0, 9.0, 14.0, 3, 1)
    assert b.acceptance_length == pytest.approx(1.3)
    assert b.vs_nospec == pytest.approx(11.0 / 11.0)
    assert b.vs_best_other == pytest.approx(1.0)  # nospec's median 11 is the best other arm
    assert rows[("fixed", 1)].vs_best_other == pytest.approx(6.0 / 11.0)
    assert rows[("nospec", 1)].vs_nospec is None
    assert rows[("nospec", 1)].vs_best_other == pytest.approx(11.0 / 11.0)
    n4 = rows[("nospec", 4)]
    assert n4.tok_s == pytest.approx(35.0) and n4.vs_best_other is None  # alone at C = 4
    md = markdown(pts)
    assert "| budget | 1 | 3 | 1 | 11.0 (9.0-14.0) | 1.00 |" in md
    assert md.count("| budget | 1 |") == 4  # the summary row and its three repeats


def test_skip_prompts_leaves_out_what_a_report_run_serves(tmp_path, smollm2_path):
    """A tuning file written with --skip-prompts N shares no prompt with the first N that vLLM's
    own spec_bench loader serves from the whole file (its fixed shuffle, reproduced here)."""
    import json
    from pathlib import Path

    from vllm.benchmarks.datasets.datasets import SpecBench

    from vllm_onlinespec.bench.concurrency import write_dataset

    src = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"
    if not src.is_file():
        pytest.skip("no Spec-Bench file beside the checkout")
    full = write_dataset(str(src), tmp_path / "full", smollm2_path, 512)
    tune = write_dataset(str(src), tmp_path / "tune", smollm2_path, 512, skip_prompts=64)
    served = [d["prompt"] for d in SpecBench(dataset_path=str(full)).data[:64]]
    left = [json.loads(ln)["turns"][0] for ln in tune.read_text().splitlines()]
    n_full = len(full.read_text().splitlines())
    assert len(left) == n_full - 64 and not set(served) & set(left)
    with pytest.raises(ValueError, match="leaves no prompt"):
        write_dataset(str(src), tmp_path / "none", smollm2_path, 512, skip_prompts=n_full)


def test_rounds_start_every_arm_once_per_round_in_reversed_order(tmp_path, monkeypatch,
                                                                 smollm2_path):
    """--rounds 2: each arm's server starts once per round, the second round in reverse order,
    its repeats numbered after the first round's; the summary counts every repeat."""
    import argparse
    import json

    from vllm_onlinespec.bench import concurrency as C

    calls = []

    def fake_run_arm(spec, dataset, concurrencies, prompts_for, output_len, out, repeats,
                     first_repeat=0, fresh=False):
        calls.append((spec.name, first_repeat))
        return [_pt(spec.name, c, r, 10.0 + r) for r in range(first_repeat, first_repeat + repeats)
                for c in concurrencies]

    monkeypatch.setattr(C, "run_arm", fake_run_arm)
    def fake_dataset(spec_bench, out, *a, **k):
        out.mkdir(parents=True, exist_ok=True)
        return out / "data.jsonl"

    monkeypatch.setattr(C, "write_dataset", fake_dataset)
    p = argparse.ArgumentParser()
    C.add_bench_serve_parser(p.add_subparsers(dest="verb"))
    args = p.parse_args(["bench-serve", "--spec-bench", "q.jsonl", "--arms", "nospec,ngram",
                         "--concurrency", "1,4", "--repeats", "2", "--rounds", "2",
                         "--target", smollm2_path, "--out", str(tmp_path / "out")])
    assert C.run_bench_serve(args) == 0
    assert calls == [("nospec", 0), ("ngram", 0), ("ngram", 2), ("nospec", 2)]
    saved = json.loads((tmp_path / "out" / "concurrency.json").read_text())
    assert saved["run_order"] == [["nospec", "ngram"], ["ngram", "nospec"]]
    assert {(r["arm"], r["concurrency"], r["repeats"]) for r in saved["rows"]} == {
        (a, c, 4) for a in ("nospec", "ngram") for c in (1, 4)}
    args.rounds = 0
    with pytest.raises(ValueError, match="--repeats and --rounds must be >= 1"):
        C.run_bench_serve(args)


def test_unseen_by_keeps_only_what_the_drafter_never_trained_on(tmp_path, smollm2_path):
    import json

    from vllm_onlinespec.bench.concurrency import write_dataset

    rows = [{"question_id": 1, "category": "writing", "turns": ["trained prompt"]},
            {"question_id": 2, "category": "writing", "turns": ["held-out prompt"]},
            {"question_id": 3, "category": "math_reasoning", "turns": ["a math word problem"]}]
    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "heldout_prompts.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "held-out prompt"}]}) + "\n")
    (drafter / "train_meta.json").write_text(json.dumps({"excluded_categories": "math_reasoning"}))
    out = write_dataset(str(src), tmp_path / "out", smollm2_path, 512, unseen_by=str(drafter))
    assert [json.loads(ln)["question_id"] for ln in out.read_text().splitlines()] == [2, 3]
    (drafter / "train_meta.json").write_text(json.dumps({"excluded_categories": ""}))
    (drafter / "heldout_prompts.jsonl").write_text("")
    with pytest.raises(ValueError, match="no Spec-Bench prompt .* never trained on"):
        write_dataset(str(src), tmp_path / "out2", smollm2_path, 512, unseen_by=str(drafter))
    with pytest.raises(FileNotFoundError, match="--unseen-by .* needs heldout_prompts.jsonl"):
        write_dataset(str(src), tmp_path / "out3", smollm2_path, 512, unseen_by=str(tmp_path))


def test_fresh_prompts_serve_each_prompt_once_per_server(tmp_path):
    """Point after point, vLLM's own loader on the chained files never serves a prompt twice;
    a file that runs dry says so in one line."""
    import json

    from vllm.benchmarks.datasets.datasets import SpecBench

    from vllm_onlinespec.bench.concurrency import fresh_dataset

    rows = [{"question_id": i, "category": "c", "turns": [f"prompt {i}"]} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    served: list[str] = []
    for k, n in enumerate((8, 8, 16)):
        got = [d["prompt"] for d in SpecBench(dataset_path=str(data)).data[:n]]
        assert len(got) == n and not set(got) & set(served)
        served += got
        data = fresh_dataset(data, n, tmp_path / f"p{k}.jsonl")
    assert len(data.read_text().splitlines()) == 40 - 32
    with pytest.raises(ValueError, match="--fresh-prompts: .* no prompt left"):
        fresh_dataset(data, 8, tmp_path / "dry.jsonl")


def test_the_budgets_choice_per_point_from_the_servers_metrics(tmp_path, monkeypatch):
    """bench-serve reads the budget's option steps and prices out of /metrics as the server
    exposes them (the real collector, prometheus' text format): the steps each option ran
    between the point's two scrapes, its price in C's batch bucket, and per-repeat ratios to the
    same repeat's nospec."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_onlinespec.bench.concurrency import parse_metrics, spec_figures
    from vllm_onlinespec.serving.metrics import ENV, MetricsWriter, OnlineSpecCollector
    from vllm_onlinespec.serving.stats import CutterStats, OnlineSpecStats

    monkeypatch.setenv(ENV, str(tmp_path))
    reg = CollectorRegistry()
    reg.register(OnlineSpecCollector())

    def exposed(steps, prices):
        MetricsWriter().write(OnlineSpecStats(cutter=CutterStats(
            option_steps=steps, option_ms_per_token=prices)), {}, force=True)
        return parse_metrics(generate_latest(reg).decode())

    before = exposed({"plain": 5, "tree": 20}, {"tree@B4": 9.0})
    after = exposed({"plain": 15, "tree": 50, "drafter": 10},
                    {"plain@B4": 12.0, "tree@B4": 8.0, "drafter@B4": 20.0, "tree@B1": 30.0})
    figs = spec_figures(before, after)
    assert figs["option_steps"] == {"plain": 10.0, "tree": 30.0, "drafter": 10.0}
    assert figs["option_ms_per_token"]["tree@B4"] == 8.0 and figs["option_ms_per_token"]["tree@B1"] == 30.0
    assert spec_figures(before, before)["option_steps"] == {"plain": 0.0, "tree": 0.0}
    assert spec_figures({}, {})["option_steps"] is None  # vLLM's own arms have no budget
    two_ranks = parse_metrics(
        'onlinespec:option_ms_per_token{batch="8",option="tree",worker="1"} 4.0\n'
        'onlinespec:option_ms_per_token{batch="8",option="tree",worker="2"} 6.0\n'
        'onlinespec:option_steps_total{option="tree",worker="1"} 3.0\n'
        'onlinespec:option_steps_total{option="tree",worker="2"} 3.0\n')
    assert spec_figures({}, two_ranks)["option_ms_per_token"] == {"tree@B8": 5.0}  # averaged

    pts = [_pt("nospec", 4, r, v) for r, v in enumerate([10.0, 20.0])]
    pts += [_pt("frozen", 4, r, v) for r, v in enumerate([12.0, 18.0])]
    for p, steps, price in zip(pts[2:], ({"plain": 10, "tree": 30}, {"tree": 50, "drafter": 10}),
                               (8.0, 10.0)):
        p.option_steps = steps
        p.option_ms_per_token = {"tree@B4": price, "tree@B1": 99.0}
    row = {(r.arm, r.concurrency): r for r in summarize(pts)}[("frozen", 4)]
    assert row.vs_nospec_spread == (0.9, 1.2)  # 18/20 and 12/10, each against its own repeat
    assert row.choice == {"drafter": 0.1, "plain": 0.1, "tree": 0.8}
    assert row.option_ms_per_token == {"tree": 9.0}  # C = 4's bucket only, median of 8 and 10
    assert "tree 0.80 (9.0 ms)" in markdown(pts)
