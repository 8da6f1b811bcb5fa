"""lab/shift_streams.py and domain_shift_report.py on bench reports written by the real
report code: streams split without overlap, the lr chosen on the tuning stream only, ratios
per seed, the return to A after A -> B -> A."""

import json
import os
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(LAB))

import domain_shift_report as D  # noqa: E402
import shift_streams as S  # noqa: E402

SPEC_BENCH = Path(os.environ.get("SPEC_BENCH", "/nonexistent"))  # Spec-Bench question.jsonl
from vllm_onlinespec.bench.arm_catalog import make_arm  # noqa: E402
from vllm_onlinespec.bench.report import write_report  # noqa: E402
from vllm_onlinespec.bench.results import ArmResult, RequestResult, WaveResult  # noqa: E402


def _arm(tmp, name, accs, tok_s, cats=None):
    spec = make_arm("nospec", target="t", prompts="p", out_dir=tmp)
    spec.name, spec.method = name, "none" if name == "nospec" else "dflash"
    r = ArmResult(spec=spec)
    spec_arm = name != "nospec"
    for i, a in enumerate(accs):
        r.waves.append(WaveResult(index=i, prompts=1, output_tokens=int(tok_s * 10), wall_s=10.0,
                                  drafts=50 if spec_arm else 0, draft_tokens=200 if spec_arm else 0,
                                  accepted=round((a - 1) * 50) if spec_arm else 0, tpot_ms=20.0,
                                  t_start_s=10.0 * i))
        r.requests.append(RequestResult(index=i, prompt_id=str(i),
                                        category=(cats or ["c"] * len(accs))[i], wave=i,
                                        output_tokens=10, tpot_ms=20.0,
                                        acceptance_length=a if spec_arm else None))
    return r


def _report(folder, arms):
    write_report(arms, folder, title="t", meta={"seed": 0})


def test_scenario_ratios_per_seed_and_the_return_to_a(tmp_path):
    cats = ["A1:x"] * 2 + ["B:math"] * 4 + ["A2:x"] * 2
    for s, scale in (("0", 1.0), ("1", 1.1)):
        _report(tmp_path / "aba" / f"seed-{s}", [
            _arm(tmp_path, "nospec", [1] * 8, 20 * scale),
            _arm(tmp_path, "frozen", [1.5, 1.5, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5], 15 * scale, cats),
            _arm(tmp_path, "online-ogd", [1.5, 1.5, 1.0, 1.2, 1.4, 1.6, 1.4, 1.3], 16 * scale, cats)])
    summ = D.scenario_summary(D.seed_reports(tmp_path / "aba"))
    ogd = summ["online-ogd"]
    assert ogd["accept_len_return_to_a"]["median"] == pytest.approx(1.35)
    assert ogd["accept_len_return_to_a_vs_frozen"]["median"] == pytest.approx(1.35 / 1.5)
    assert ogd["tok_s_vs_nospec"]["median"] == pytest.approx(0.8)
    assert ogd["tok_s"]["min"] == pytest.approx(16) and ogd["tok_s"]["max"] == pytest.approx(17.6)
    assert ogd["tok_s"]["n"] == 2 and len(ogd["per_seed"]["1"]["windows"]) == 8
    assert summ["nospec"]["accept_len_return_to_a"] is None
    md = D.markdown({"aba": summ}, [], {"lr": None})
    assert "| online-ogd | 16.8 (16.0-17.6) | 0.80x (0.80-0.80)" in md


def test_lr_is_chosen_on_the_tuning_stream(tmp_path):
    for lr, a in (("3e-4", 1.2), ("1e-3", 1.4), ("3e-3", 1.3)):
        _report(tmp_path / "tune" / f"lr-{lr}", [_arm(tmp_path, "online-ogd", [a] * 4, 15)])
    _report(tmp_path / "tune" / "frozen", [_arm(tmp_path, "frozen", [1.5] * 4, 15)])
    assert D.best_lr(tmp_path) == "1e-3"  # frozen is a reference row, never a choice
    assert [r["kind"] for r in D.tune_table(tmp_path)][-1] == "frozen"
    with pytest.raises(SystemExit, match="no tuning runs"):
        D.best_lr(tmp_path / "nothing")


def test_learn_variant_is_chosen_on_the_tuning_stream_and_never_from_lr_rows(tmp_path):
    _report(tmp_path / "tune" / "lr-3e-4", [_arm(tmp_path, "online-ogd", [1.9] * 4, 15)])
    for v, a in (("base", 1.2), ("dense+replay", 1.4), ("replay", 1.3)):
        _report(tmp_path / "tune" / f"learn-{v}", [_arm(tmp_path, "online-ogd", [a] * 4, 15)])
    assert D.best_learn(tmp_path) == "dense+replay" and D.best_lr(tmp_path) == "3e-4"
    rows = {(r["kind"], r["setting"]) for r in D.tune_table(tmp_path)}
    assert ("learn", "replay") in rows and ("lr", "3e-4") in rows
    assert D.learn_variant("dense+replay") == {"anchor_stride": 1, "replay": True}
    with pytest.raises(SystemExit, match="unknown learn variant 'denser'"):
        D.learn_variant("denser")
    with pytest.raises(SystemExit, match="no tuning runs"):
        D.best_learn(tmp_path / "nothing")


def test_shift_streams_split_without_overlap(tmp_path):
    if not SPEC_BENCH.is_file():
        pytest.skip("set SPEC_BENCH to Spec-Bench question.jsonl")
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"id": str(i), "category": "writing", "messages": [
        {"role": "user", "content": f"held-out prompt {i}"}]}) + "\n" for i in range(6)))
    S.main(["--spec-bench", str(SPEC_BENCH), "--heldout", str(held), "--out", str(tmp_path / "s")])
    rd = lambda n: [json.loads(x) for x in (tmp_path / "s" / n).read_text().splitlines()]  # noqa: E731
    tune, shifted, aba = rd("tune.jsonl"), rd("shifted.jsonl"), rd("aba-seed-1.jsonl")
    assert len(tune) == len(shifted) == 40
    assert not {r["id"] for r in tune} & {r["id"] for r in shifted}
    parts = [r["category"].split(":")[0] for r in aba]
    assert parts == ["A1"] * 3 + ["B"] * 40 + ["A2"] * 3
    assert sorted(r["id"] for r in aba if r["category"].startswith("B:")) == sorted(r["id"] for r in shifted)


def test_arms_served_with_lookup_compare_with_the_frozen_arm_served_alike(tmp_path):
    assert D.base_arm("online-ogd+lookup", "frozen") == "frozen+lookup"
    assert D.base_arm("online-ogd", "frozen") == "frozen"
    assert D.base_arm("online-ogd+lookup", "nospec") == "nospec"
    seed = tmp_path / "shifted" / "seed-0"
    _report(seed, [_arm(tmp_path, "nospec", [1, 1], 10.0),
                   _arm(tmp_path, "frozen", [1.2, 1.2], 6.0),
                   _arm(tmp_path, "frozen+lookup", [2.0, 2.0], 8.0),
                   _arm(tmp_path, "online-ogd+lookup", [2.0, 3.0], 12.0)])
    d = D.scenario_summary(D.seed_reports(tmp_path / "shifted"))["online-ogd+lookup"]
    assert d["tok_s_vs_frozen"]["median"] == pytest.approx(1.5)  # against frozen+lookup's 8
    assert d["tok_s_vs_nospec"]["median"] == pytest.approx(1.2)
