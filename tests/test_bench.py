"""Benchmark plumbing without an engine: arm names, streams, results JSON, the report."""

import json
import types

import pytest

from vllm_onlinespec.bench import prompts as P
from vllm_onlinespec.bench.arm_catalog import DEFAULT_ONLINE, clear_own_checkpoints, known_arm, make_arm
from vllm_onlinespec.bench.cli import train_flags
from vllm_onlinespec.bench.report import summarize, write_report
from vllm_onlinespec.bench.results import ArmResult, RequestResult, WaveResult
from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.training.data import Prompt


@pytest.fixture()
def drafter_dir(tmp_path):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "block_size": 8,
        "dflash_config": {"target_layer_ids": [1], "mask_token_id": 3}}))
    return str(d)


def test_arm_names_map_to_valid_configs(tmp_path, drafter_dir):
    for name in ["nospec", "ngram", "frozen", "online-ogd", "online-optimistic", "online-ensemble",
                 "fixed", "adaflash", "budget", "frozen-budget", "shadow"]:
        assert known_arm(name)
        spec = make_arm(name, target="t", prompts="p.jsonl", out_dir=tmp_path, drafter=drafter_dir)
        if spec.onlinespec is not None:
            OnlineSpecConfig.from_any(spec.onlinespec)  # every arm's settings validate
    assert not known_arm("online-sgd")
    assert make_arm("nospec", target="t", prompts="p", out_dir=tmp_path).speculative_config is None
    frozen = make_arm("frozen", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    assert frozen.num_speculative_tokens == 7 and not frozen.learning
    ens = make_arm("online-ensemble", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    assert ens.onlinespec["update"]["algorithm"] == "ensemble"
    assert ens.onlinespec["update"]["lr"] == DEFAULT_ONLINE["update"]["lr"]
    bud = make_arm("budget", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    assert bud.onlinespec["length_head"] == {"policy": "budget", "k_min": 0} and bud.learning


def test_vllm_dynamic_arm_carries_the_k_table(tmp_path, drafter_dir):
    table = [[1, 2, 2], [3, 64, 0]]
    dyn = make_arm("vllm-dynamic", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir,
                   k_per_batch_size=table)
    assert dyn.onlinespec is None  # vLLM's own worker
    assert dyn.speculative_config["num_speculative_tokens_per_batch_size"] == table
    assert dyn.speculative_config["num_speculative_tokens"] == 7
    stock = make_arm("vllm-dflash", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    assert stock.onlinespec is None and stock.speculative_config["method"] == "dflash"
    assert "num_speculative_tokens_per_batch_size" not in stock.speculative_config
    with pytest.raises(ValueError, match="goes with the vllm-dynamic arm"):
        make_arm("vllm-dynamic", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    with pytest.raises(ValueError, match="goes with the vllm-dynamic arm"):
        make_arm("budget", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir,
                 k_per_batch_size=table)
    for bad in ([[2, 8, 1]], [[1, 8, -1]], [[1, 8]], [], [[4, 1, 1]]):
        with pytest.raises(ValueError, match="k_per_batch_size must be"):
            make_arm("vllm-dynamic", target="t", prompts="p", out_dir=tmp_path,
                     drafter=drafter_dir, k_per_batch_size=bad)


def test_shadow_arm_and_own_checkpoints(tmp_path, drafter_dir):
    shadow = make_arm("shadow", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    cfg = OnlineSpecConfig.from_any(shadow.onlinespec)
    assert shadow.learning and cfg.update.algorithm == "ogd"
    assert cfg.publish.every_n_updates >= 10**9
    ogd = make_arm("online-ogd", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    ckpt = tmp_path / "checkpoints" / "online-ogd"
    assert ogd.onlinespec["checkpoint"]["dir"] == str(ckpt)
    assert "checkpoint" not in make_arm("frozen", target="t", prompts="p", out_dir=tmp_path,
                                        drafter=drafter_dir).onlinespec
    (ckpt / "v00000001").mkdir(parents=True)
    clear_own_checkpoints(ogd)
    assert not ckpt.exists()  # a rerun into the same folder never resumes
    mine = tmp_path / "mine"
    (mine / "v00000001").mkdir(parents=True)
    user = make_arm("online-ogd", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir,
                    online={"checkpoint": {"dir": str(mine)}})
    clear_own_checkpoints(user)
    assert (mine / "v00000001").is_dir()  # a folder the user chose is never deleted


def test_interleave_keeps_category_mix_in_every_stretch():
    ps = [Prompt(id=f"a{i}", source="x", text=f"a{i}", category="a") for i in range(80)]
    ps += [Prompt(id=f"b{i}", source="x", text=f"b{i}", category="b") for i in range(10)]
    s = P.interleave(ps, seed=0)
    assert sorted(p.id for p in s) == sorted(p.id for p in ps)
    first, second = s[:45], s[45:]
    assert 4 <= sum(p.category == "b" for p in first) <= 6
    assert 4 <= sum(p.category == "b" for p in second) <= 6


def test_categories_and_train_flags():
    assert P.parse_categories("all") is None
    assert "coding" not in P.parse_categories("-coding") and "rag" in P.parse_categories("-coding")
    f = train_flags(["humaneval"], None)
    assert "--humaneval" in f and "--spec-bench" not in f
    f = train_flags(["qa", "math"], "q.jsonl")
    assert f[f.index("--categories") + 1] == "qa,math" and "--humaneval" not in f
    with pytest.raises(ValueError):
        train_flags(["qa"], None)


def test_results_roundtrip_and_report(tmp_path):
    def arm(name, method, accs, onlinespec=None):
        spec = make_arm("nospec", target="t", prompts="p", out_dir=tmp_path)
        spec.name, spec.method, spec.onlinespec = name, method, onlinespec
        r = ArmResult(spec=spec, learner={"published_version": 9} if onlinespec else {})
        for i, a in enumerate(accs):
            r.waves.append(WaveResult(index=i, prompts=2, output_tokens=100, wall_s=2.0,
                                      drafts=50 if method != "none" else 0,
                                      draft_tokens=200 if method != "none" else 0,
                                      accepted=round((a - 1) * 50) if method != "none" else 0,
                                      tpot_ms=20.0))
            r.requests.append(RequestResult(index=i, prompt_id=str(i), category="c", wave=i,
                                            output_tokens=100, tpot_ms=20.0,
                                            acceptance_length=a if method != "none" else None))
        return r

    results = [arm("nospec", "none", [1, 1, 1, 1]), arm("frozen", "dflash", [1.2, 1.2, 1.2, 1.2]),
               arm("online-ogd", "dflash", [1.2, 1.3, 1.5, 1.6], {"update": {"lr": 1e-3}})]
    again = ArmResult.from_json(json.loads(json.dumps(results[2].to_json())))
    assert again.totals() == results[2].totals()
    rows = {r.arm: r for r in summarize(results)}
    assert rows["online-ogd"].early == pytest.approx(1.25) and rows["online-ogd"].late == pytest.approx(1.55)
    assert rows["online-ogd"].drafter_version == 9 and rows["nospec"].speedup == pytest.approx(1.0)
    paths = write_report(results, tmp_path / "rep", title="t", meta={"x": 1}, notes=["n"])
    assert "online-ogd" in paths["markdown"].read_text()
    assert json.loads(paths["json"].read_text())["summary"][2]["late"] == pytest.approx(1.55)
    for k in ("acceptance", "acceptance_requests", "throughput"):
        assert paths[k].stat().st_size > 1000


def test_halves_split_near_half_the_tokens_not_by_window_count(tmp_path):
    """A continuous protocol's windows: two full 20 s windows and a 4-step tail. The second
    half must hold the second full window, not the tail alone (the demo's verdict read it)."""
    spec = make_arm("nospec", target="t", prompts="p", out_dir=tmp_path)

    def window(i, tokens, drafts, accepted):
        return WaveResult(index=i, prompts=30, output_tokens=tokens, wall_s=20.0, drafts=drafts,
                          draft_tokens=4 * drafts, accepted=accepted, tpot_ms=25.0)

    tail = ArmResult(spec=spec, waves=[window(0, 3000, 1600, 1400), window(1, 3000, 1600, 1500),
                                       window(2, 5, 4, 2)])
    early, late = tail.halves()
    assert early["output_tokens"] == 3000 and late["output_tokens"] == 3005
    assert late["acceptance_length"] == pytest.approx((1502 + 1604) / 1604)
    # Equal waves split as before: the later split on a tie (3 waves: 2 + 1).
    even = ArmResult(spec=spec, waves=[window(i, 100, 50, 10) for i in range(3)])
    assert [h["output_tokens"] for h in even.halves()] == [200, 100]
    one = ArmResult(spec=spec, waves=[window(0, 100, 50, 10)])
    assert one.halves()[0]["output_tokens"] == 100 and one.halves()[1]["output_tokens"] == 0


def test_step_profile_roundtrips_and_reports_what_the_worker_did_not_see(tmp_path):
    """The per-arm step table: the worker's phases per step and the rest of the wall time."""
    from vllm_onlinespec.bench.report import step_markdown

    spec = make_arm("nospec", target="t", prompts="p", out_dir=tmp_path)
    spec.name, spec.method, spec.onlinespec = "frozen", "dflash", {"enabled": False}
    prof = {"steps": 100, "target_s": 2.0, "sample_s": 0.1, "draft_s": 0.5, "ours_s": 0.3,
            "ours_in_sample_tokens_s": 0.2, "sample_tokens_s": 1.0,
            "per_step_ms": {"target": 20.0, "sample": 1.0, "draft": 5.0, "ours": 3.0, "other": 2.0}}
    r = ArmResult(spec=spec, step_profile=prof, learner={"learner": {"busy_s": 1.5}},
                  waves=[WaveResult(index=0, prompts=4, output_tokens=400, wall_s=4.0, drafts=100,
                                    draft_tokens=400, accepted=100, tpot_ms=25.0)])
    again = ArmResult.from_json(json.loads(json.dumps(r.to_json())))
    assert again.step_profile == prof
    row = step_markdown([again, ArmResult(spec=make_arm("nospec", target="t", prompts="p",
                                                        out_dir=tmp_path))]).splitlines()[2:]
    # wall 40 ms/step; the worker 20 + 10 (sample_tokens) + 1 (ours outside it) = 31 ms
    assert row == ["| frozen | 100 | 40.0 | 20.00 | 1.00 | 5.00 | 3.00 | 2.00 | 9.00 | 1.5 | - | - |"]
    # With the learner split: steps begun inside an update and their target cost per token.
    again.step_profile = {**prof, "learner": {"busy@B8": [10, 0.22, 80], "idle@B8": [90, 1.8, 720]},
                          "learner_cost": {"B8": 1.1, "all": 1.1}}
    assert step_markdown([again]).splitlines()[2].endswith("| 1.5 | 10 | 1.100x |")


def test_demo_verdict_needs_the_gain_in_every_stream_order(tmp_path):
    """The demo runs two stream orders; LEARNED only when both show the gain, and the report
    over the orders carries the verdict, the medians and one plot with a curve per order."""
    from vllm_onlinespec.bench.demo import verdict
    from vllm_onlinespec.bench.report import summarize, summarize_seeds, write_seed_report

    def arm(name, late_accept, tok_s=100.0):
        spec = make_arm("nospec", target="t", prompts="p", out_dir=tmp_path)
        spec.name, spec.method = name, "none" if name == "nospec" else "dflash"
        waves = [WaveResult(index=i, prompts=10, output_tokens=1000, wall_s=1000 / tok_s,
                            drafts=500, draft_tokens=2000,
                            accepted=round(((1.8 if i == 0 else late_accept) - 1) * 500),
                            tpot_ms=25.0) for i in range(2)]
        reqs = [RequestResult(index=i, prompt_id=str(i), category="c", wave=0, output_tokens=50,
                              tpot_ms=25.0, acceptance_length=1.8) for i in range(4)]
        return ArmResult(spec=spec, waves=waves, requests=reqs)

    def order(online_late, tok_s=100.0):
        return [arm("nospec", 1.0, 120.0), arm("frozen", 1.8, tok_s), arm("online-ogd", online_late)]

    both = verdict([order(1.9), order(1.9)])
    assert "LEARNED" in both[-2] and "+0.100" in both[-2]
    one = verdict([order(1.9), order(1.81)])
    assert "NO measurable learning" in one[-2] and "+0.010" in one[-2]
    assert one[-1].startswith("throughput, median (min-max) over the orders: nospec 120.0")
    per_order = [order(1.9, 90.0), order(1.81, 110.0)]
    rows = summarize_seeds([summarize(r) for r in per_order])
    paths = write_seed_report(rows, tmp_path / "demo", seeds=(0, 1), meta={}, title="demo",
                              notes=verdict(per_order), results=per_order)
    md = paths["markdown"].read_text()
    assert md.startswith("# demo") and "| frozen | 2 | 100.0 (90.0-110.0) |" in md
    assert "NO measurable learning" in md and paths["acceptance_requests"].stat().st_size > 1000


def test_dtype_defaults_to_what_the_hardware_computes_natively(monkeypatch):
    """bench, bench-serve and the arms default to `auto`: bfloat16 with native bf16 (a GPU, an
    AVX512-BF16/AMX CPU), float32 on a CPU that would emulate it; reports get the resolved
    name; a bad one is a one-line error naming the choices."""
    import torch

    from vllm_onlinespec import serving_dtype as SD
    from vllm_onlinespec.bench.results import ArmSpec
    from vllm_onlinespec.cli import build_parser

    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda n=native: n,
                            raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
        assert SD.resolve_dtype("auto") == want and SD.resolve_dtype("float32") == "float32"
        p = build_parser()
        for verb in ("bench", "bench-serve"):
            sub = p._subparsers._group_actions[0].choices[verb]
            dtype = next(a for a in sub._actions if a.dest == "dtype")
            assert dtype.default == "auto" and dtype.type("auto") == want, verb
            assert "auto (default" in sub.format_help().replace("\n", " ").replace("  ", " "), verb
        assert ArmSpec(name="a", target="t", prompts="p", out="o").dtype == want
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float32"):
        SD.resolve_dtype("fp8")


def test_counterbalanced_arm_order_reverses_on_odd_repeats():
    from vllm_onlinespec.bench.launch import counterbalanced

    assert counterbalanced(3, 0) == [0, 1, 2]
    assert counterbalanced(3, 1) == [2, 1, 0]
    assert counterbalanced(3, 2) == [0, 1, 2]
    # Over an ABBA pair every arm's mean slot is the same: a linear drift favours none.
    slots = [sorted(range(4), key=counterbalanced(4, r).index) for r in (0, 1)]
    assert len({a + b for a, b in zip(*slots)}) == 1


def test_run_arms_runs_in_counterbalanced_order_and_reports_in_arm_order(tmp_path, monkeypatch):
    from vllm_onlinespec.bench import launch

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    ran = []
    monkeypatch.setattr(launch, "run_arm", lambda spec, logs, n: ran.append(spec) or spec)
    specs = [types.SimpleNamespace(prompts=str(prompts), name=n) for n in "abc"]
    assert launch.run_arms(specs, tmp_path, repeat=1) == specs
    assert [s.name for s in ran] == ["c", "b", "a"]


def test_demo_starts_from_an_empty_output_folder(tmp_path):
    from vllm_onlinespec.bench.demo import fresh_output

    out = tmp_path / "demo"
    assert fresh_output(out, force=False).is_dir()  # absent: created
    (out / "seed-0").mkdir()
    (out / "seed-0" / "old.json").write_text("{}")
    with pytest.raises(ValueError, match="not empty .* --force"):
        fresh_output(out, force=False)
    assert (out / "seed-0" / "old.json").exists()  # refused: nothing deleted
    assert list(fresh_output(out, force=True).iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        fresh_output(tmp_path / "file", force=True)


def test_tree_arms_serve_the_suffix_tree_at_vllms_k_16(tmp_path, drafter_dir):
    tree = make_arm("frozen+tree", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    assert tree.num_speculative_tokens == 16 and not tree.learning
    assert tree.onlinespec["prompt_lookup"] == {"enabled": True, "source": "suffix_tree"}
    OnlineSpecConfig.from_any(tree.onlinespec)
    bud = make_arm("budget+tree", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir,
                   num_speculative_tokens=8)
    assert bud.num_speculative_tokens == 8 and bud.onlinespec["length_head"]["policy"] == "budget"
    with pytest.raises(ValueError, match=r"\+tree goes with this project's DFlash arms"):
        make_arm("ngram+tree", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)


def test_k0_arm_drafts_nothing(tmp_path, drafter_dir):
    k0 = make_arm("k0", target="t", prompts="p", out_dir=tmp_path, drafter=drafter_dir)
    cfg = OnlineSpecConfig.from_any(k0.onlinespec)
    assert cfg.features.plain and not cfg.enabled and k0.num_speculative_tokens == 7


def test_vllm_suffix_arms_serve_vllms_suffix_decoding_without_a_drafter(tmp_path, monkeypatch):
    from vllm_onlinespec.drafter import suffix_tree

    monkeypatch.setattr(suffix_tree, "suffix_cache_class", lambda: object)
    own = make_arm("vllm-suffix", target="t", prompts="p", out_dir=tmp_path)
    assert own.speculative_config == {"method": "suffix", "num_speculative_tokens": 24}
    assert own.drafter is None and own.onlinespec is None
    k4 = make_arm("vllm-suffix4", target="t", prompts="p", out_dir=tmp_path)
    assert k4.speculative_config["num_speculative_tokens"] == 4
    for bad in ("vllm-suffix0", "vllm-suffixx", "vllm-suffix+tree"):
        assert not known_arm(bad)

    def missing():
        raise ImportError("no arctic")

    monkeypatch.setattr(suffix_tree, "suffix_cache_class", missing)
    with pytest.raises(ValueError, match=r"^arm 'vllm-suffix': vLLM's suffix decoding needs "
                                         r"arctic_inference.*suffix_install"):
        make_arm("vllm-suffix", target="t", prompts="p", out_dir=tmp_path)


def test_demo_scenarios_serve_known_targets_with_the_base_drafter():
    from vllm_onlinespec.bench.demo import DEFAULT_SCENARIO, SCENARIOS
    from vllm_onlinespec.models import KNOWN_MODELS, shipped_drafter

    assert DEFAULT_SCENARIO in SCENARIOS
    for sc in SCENARIOS.values():
        assert sc.target in KNOWN_MODELS and (shipped_drafter(sc.drafter_of) / "config.json").is_file()
    # the fine-tuned scenario serves another model than the one its drafter was trained for
    ft = SCENARIOS["finetuned"]
    assert ft.target != ft.drafter_of and KNOWN_MODELS[ft.target].adapter


def _rl_rows(online_late: dict[int, float], frozen_late: float = 0.30, tree_accepted: int = 60,
             online_tree_accepted: int | None = None) -> list[dict]:
    """Rows as bench-rl writes them: 4 rounds per order, 200 request-steps with drafts a round,
    100 of them the suffix tree's (`tree_accepted` tokens accepted), 100 the drafter's at the
    given accepted tokens per drafted step (0.30 in the first half)."""
    rows = []
    for order, late in online_late.items():
        for label, arm, d in (("frozen", "frozen", frozen_late), ("online gap 12s", "online", late)):
            tree = tree_accepted if arm == "frozen" or online_tree_accepted is None \
                else online_tree_accepted
            for rnd in range(4):
                da = 0.30 if rnd < 2 else d
                accepted = tree + round(da * 100)
                rows.append({"label": label, "arm": arm, "order": order, "round": rnd,
                             "version": min(rnd, 1), "gap_s": 12.0 if arm == "online" else 0.0,
                             "output_tokens": 400, "wall_s": 4.0, "tok_s": 100.0,
                             "drafts": 200, "accepted": accepted, "accept_len": (accepted + 200) / 200,
                             "lookup_rows": 100, "lookup_accepted": tree, "drafter_accept": da,
                             "gate_shut_share": 0.5, "learner_updates_round": 0,
                             "learner_updates_gap": 0, "gap_s_used": 0.0, "push_s": 1.0})
    return rows


def test_rl_demo_verdict_needs_the_drafters_gain_in_every_order_over_the_last_half():
    from vllm_onlinespec.bench.demo import MIN_GAIN, rl_verdict

    both = rl_verdict(_rl_rows({0: 0.40, 1: 0.45}))
    assert both[-1].startswith("verdict: LEARNED") and "+0.100" in both[-1]
    assert both[0].startswith("last half of the rounds, order 0: the drafter's accepted tokens "
                              "per drafted step online 0.400 vs frozen 0.300 (+0.100); tokens "
                              "per verify step 1.500 vs 1.450")
    one = rl_verdict(_rl_rows({0: 0.40, 1: 0.30 + MIN_GAIN / 3}))
    assert one[-1].startswith("verdict: NOT LEARNED") and "+0.010" in one[-1]
    # the first half (rounds 0-1) does not count: online ahead there only is not learning
    early = _rl_rows({0: 0.30, 1: 0.30})
    for r in early:
        if r["arm"] == "online" and r["round"] < 2:
            r["accepted"] += 50
            r["drafter_accept"] += 0.5
    assert rl_verdict(early)[-1].startswith("verdict: NOT LEARNED")
    # More tokens per verify step from the tree's drafts (the budget's mix), the same drafter:
    # not learning.
    mix = rl_verdict(_rl_rows({0: 0.30, 1: 0.30}, online_tree_accepted=90))
    assert mix[-1].startswith("verdict: NOT LEARNED") and "+0.000" in mix[-1]
    assert "tokens per verify step 1.600 vs 1.450" in mix[0]
    # A drafter that drafted nothing over the last half: nothing to judge it by.
    idle = _rl_rows({0: 0.40, 1: 0.40})
    for r in idle:
        if r["arm"] == "frozen" and r["order"] == 1 and r["round"] >= 2:
            r.update(drafter_accept=None, lookup_rows=200, accepted=r["lookup_accepted"])
    out = rl_verdict(idle)
    assert out[-1].startswith("verdict: NOT MEASURED: in order(s) 1 ") and "+0.100" in out[0]
    assert out[1].startswith("last half of the rounds, order 1: the drafter drafted 200 "
                             "request-steps online and 0 frozen (too few for a rate)")
    # Too few drafter steps for a rate (one token would move it by more than MIN_GAIN).
    from vllm_onlinespec.bench.demo import MIN_DRAFTER_STEPS

    few = _rl_rows({0: 0.40, 1: 0.40})
    for r in few:
        r["lookup_rows"] = 200 - (MIN_DRAFTER_STEPS - 1) // 2  # 2 last-half rounds: one short
    assert rl_verdict(few)[-1].startswith("verdict: NOT MEASURED") and \
        f"fewer than {MIN_DRAFTER_STEPS} request-steps" in rl_verdict(few)[-1]
    assert "failed" in rl_verdict([r for r in _rl_rows({0: 0.4}) if r["arm"] != "online"])[0]
    # The learner's own paired estimate, when the rows carry it: its last round's, per order.
    own = _rl_rows({0: 0.4})
    for r in own:
        r["learner_gain"] = 0.05 * r["round"] if r["arm"] == "online" else None
    assert "own paired estimate after the last round: +0.150 accepted draft tokens" in \
        rl_verdict(own)[0]
    assert "paired estimate" not in both[0]


def test_rl_demo_verdict_reads_the_learners_paired_estimate_where_the_drafter_barely_served():
    """Too few served drafter steps for a rate: the order is judged by the learner's paired
    estimate on fresh verified text, which must clear MIN_GAIN at t >= MIN_GAIN_T."""
    from vllm_onlinespec.bench.demo import MIN_DRAFTER_STEPS, MIN_GAIN, MIN_GAIN_T, rl_verdict

    def rows(gain, t, few_orders=(1,), frozen_late=0.30):
        out = _rl_rows({0: 0.45, 1: 0.45}, frozen_late=frozen_late)
        for r in out:
            if r["order"] in few_orders:
                r["lookup_rows"] = 200 - (MIN_DRAFTER_STEPS - 1) // 2
            if r["arm"] == "online":
                r.update(learner_gain=gain, learner_gain_t=t)
        return out

    ok = rl_verdict(rows(0.11, 3.5))
    assert ok[-1].startswith("verdict: LEARNED: the drafter kept up with the new policy, at least "
                             "+0.110") and "order(s) 1 by the learner's paired estimate" in ok[-1]
    assert "(t 3.5)" in ok[1] and "too few for a rate" in ok[1]
    weak = rl_verdict(rows(0.11, MIN_GAIN_T - 0.1))
    assert weak[-1].startswith("verdict: NOT LEARNED: in order(s) 1 the learner's paired "
                               "estimate is below t")
    small = rl_verdict(rows(MIN_GAIN / 2, 9.0, few_orders=(0, 1)))
    assert small[-1].startswith("verdict: NOT LEARNED: the smallest gain over the start weights "
                                "is +0.015") and "order(s) 0, 1" in small[-1]
    # the served rate, where there is one, still decides: a served loss is not outvoted
    lost = rows(0.2, 9.0, frozen_late=0.60)
    assert rl_verdict(lost)[-1].startswith("verdict: NOT LEARNED: the smallest gain over the "
                                           "start weights is -0.150")
    none = rows(None, None)
    assert rl_verdict(none)[-1].startswith("verdict: NOT MEASURED: in order(s) 1 ")


def test_rl_demo_plan_fits_the_built_in_prompts_and_pushes_a_new_policy():
    from vllm_onlinespec.bench import prompts as P
    from vllm_onlinespec.bench.demo import RL_PLANS, RL_VERSIONS
    from vllm_onlinespec.models import KNOWN_MODELS

    for plan in RL_PLANS.values():
        assert plan.rounds * plan.prompts_per_round <= len(P.builtin_chat())
        assert plan.rounds >= 2 and plan.gap_s > 0
    assert len(RL_VERSIONS) == 2 and all(v in KNOWN_MODELS for v in RL_VERSIONS)


def test_rl_demo_runs_bench_rl_with_its_plan_and_writes_the_verdict(tmp_path, monkeypatch):
    """`demo --scenario rl` hands bench-rl its plan (versions, arms, rounds, gap, built-in
    prompts) and adds the verdict to bench-rl's report (a stand-in for the engines' run)."""
    import argparse
    import json

    import vllm_onlinespec.bench.rl as rl
    from vllm_onlinespec.bench.demo import RL_PLANS, RL_VERSIONS, run_rl_demo

    seen = {}

    def fake_run(ns, msgs):
        seen["ns"], seen["msgs"] = ns, msgs
        rows = _rl_rows({0: 1.9, 1: 1.95})
        meta = {"rounds": ns.rounds, "prompts_per_round": ns.prompts_per_round, "n": ns.n,
                "max_tokens": ns.max_tokens, "command": ns.command, "versions": RL_VERSIONS,
                "push": ns.push, "gaps": [float(ns.gap_s)], "wall_s": 1.0}
        rl.write_report(rows, tmp_path, meta)
        return 0

    monkeypatch.setattr(rl, "run_bench_rl", fake_run)
    args = argparse.Namespace(quick=False, spec_bench=None)
    assert run_rl_demo(args, tmp_path) == 0
    plan, ns = RL_PLANS["full"], seen["ns"]
    assert ns.versions == ",".join(RL_VERSIONS) and ns.arms == "frozen,online" and ns.orders == 2
    assert (ns.rounds, ns.prompts_per_round, ns.n) == (plan.rounds, plan.prompts_per_round, plan.n)
    assert float(ns.gap_s) == plan.gap_s and len(seen["msgs"]) == plan.rounds * plan.prompts_per_round
    assert ns.learn_while_rolling is False  # the learner trains in idle time only
    md = (tmp_path / "demo.md").read_text()
    assert "## Verdict" in md and "verdict: LEARNED" in md and "](demo.png)" in md
    assert json.loads((tmp_path / "demo.json").read_text())["meta"]["verdict"][-1] \
        .startswith("verdict: LEARNED")
    assert (tmp_path / "demo.png").stat().st_size > 1000


def test_step_profile_splits_the_target_span_by_the_learners_state():
    """A step begun inside a learner update is counted apart, per batch bucket; the cost ratio
    compares target ms per scheduled token like for like and weighs buckets by idle steps."""
    from vllm_onlinespec.serving.step_profile import StepProfile

    p = StepProfile()
    p.observe_target(0.1)  # no learner: counted, not split
    assert p.steps == 1 and p.learner == {}
    for _ in range(3):
        p.observe_target(0.100, learner_busy=False, batch_size=8, tokens=8)
        p.observe_target(0.050, learner_busy=False, batch_size=1, tokens=1)
    p.observe_target(0.110, learner_busy=True, batch_size=7, tokens=8)  # bucket 8, +10 %
    p.observe_target(0.060, learner_busy=True, batch_size=2, tokens=2)  # bucket 2: no idle twin
    assert p.steps == 9 and p.learner["busy@B8"] == [1, pytest.approx(0.110), 8]
    cost = p.learner_cost()
    assert cost == {"B8": pytest.approx(1.1), "all": pytest.approx(1.1)}
    assert p.as_dict()["learner_cost"] == cost
    assert StepProfile().learner_cost() == {}
    # By the budget's option the step verified, prefill steps apart.
    p.observe_target(0.2, option="tree@B16", tokens=40)
    p.observe_target(0.5, option="tree@B16+prefill", tokens=300)
    p.observe_target(0.3, option="tree@B16", tokens=44)
    assert p.options == {"tree@B16": [2, pytest.approx(0.5), 84],
                         "tree@B16+prefill": [1, pytest.approx(0.5), 300]}
    assert p.steps == 12


def test_resume_keeps_the_finished_stream_orders_and_serves_the_rest_whole(tmp_path, monkeypatch,
                                                                         smollm2_path):
    """`bench --seeds 0,1 --resume`: an order whose report is in --out with the same settings is
    kept; the order a cut-off run did not finish is served again, all its arms, in its own arm
    order (reversed on the second order); other settings serve everything again."""
    from vllm_onlinespec.bench import launch
    from vllm_onlinespec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(3)))
    ran: list[tuple[str, str]] = []

    def fake_run_arm(spec, logs, n, cut_at=None):
        ran.append((spec.out.split("/")[-3], spec.name))
        if cut_at == len(ran):
            raise KeyboardInterrupt  # the session stops mid-order
        r = ArmResult(spec=spec)
        r.waves.append(WaveResult(index=0, prompts=n, output_tokens=10 * n, wall_s=1.0, drafts=0,
                                  draft_tokens=0, accepted=0, tpot_ms=10.0))
        r.save()
        return r

    argv = ["bench", "--prompts", str(prompts), "--target", smollm2_path, "--arms", "nospec,ngram",
            "--seeds", "0,1", "--wave", "1", "--max-tokens", "8", "--dtype", "float32",
            "--out", str(tmp_path / "out")]
    monkeypatch.setattr(launch, "run_arm", lambda s, lg, n: fake_run_arm(s, lg, n, cut_at=3))
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert ran == [("seed-0", "nospec"), ("seed-0", "ngram"), ("seed-1", "ngram")]
    ran.clear()
    monkeypatch.setattr(launch, "run_arm", fake_run_arm)
    assert main(argv + ["--resume"]) == 0
    assert ran == [("seed-1", "ngram"), ("seed-1", "nospec")]  # order 0 kept; order 1 whole
    assert (tmp_path / "out" / "report.json").is_file()
    ran.clear()
    assert main([*argv[:-4], "--max-tokens", "16", *argv[-4:], "--resume"]) == 0
    assert len(ran) == 4  # another setting: nothing kept
