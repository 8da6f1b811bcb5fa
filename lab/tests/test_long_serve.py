"""lab/long_serve.py: bench --arrivals runs into one page of windows and summaries."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import long_serve  # noqa: E402


def arm(name, tpots, finish, prof=None, learner=None):
    reqs = [{"output_tokens": 64, "tpot_ms": t, "finish_s": f, "acceptance_length": 2.0}
            for t, f in zip(tpots, finish)]
    return {"spec": {"name": name, "arrivals": "poisson:0.5"}, "requests": reqs,
            "serve_s": max(finish), "totals": {"tok_s": 64 * len(reqs) / max(finish)},
            "step_profile": prof or {}, "learner": learner or {}, "error": None}


def test_windows_split_the_stream_by_finish_time_and_the_last_quarter_is_apart():
    a = arm("frozen", [100, 100, 100, 200, 300, 400, 500, 600], [1, 2, 3, 4, 5, 6, 7, 8])
    rows = long_serve.window_rows("poisson", a, windows=4)
    assert [r["requests"] for r in rows] == [1, 2, 2, 3]  # finish 1 | 2,3 | 4,5 | 6,7,8
    assert rows[-1]["tpot_p50_ms"] == 500 and rows[-1]["tok_s"] == pytest.approx(3 * 64 / 2)
    s = long_serve.summary("poisson", a)
    assert s["last_quarter_tpot_p50_ms"] == 500  # finish >= 6
    assert s["tpot_p90_ms"] == 500 and s["requests"] == 8


def test_the_page_carries_the_learners_cost_and_the_options(tmp_path):
    prof = {"steps": 10, "learner": {"busy@B4": [3, 0.3, 12], "idle@B4": [7, 0.6, 28]},
            "learner_cost": {"B4": 1.167, "all": 1.167},
            "options": {"plain@B4": [8, 0.8, 32], "tree@B4+prefill": [2, 0.5, 300]}}
    learner = {"learner": {"updates": 12, "busy_s": 3.0}, "publishes": 3}
    for proto in ("poisson", "saturation"):
        d = tmp_path / proto / "arms"
        d.mkdir(parents=True)
        (d / "online.json").write_text(json.dumps(arm("online-ogd", [100] * 4, [1, 2, 3, 4],
                                                      prof, learner)))
    out = tmp_path / "out"
    assert long_serve.main(["--run", f"poisson={tmp_path / 'poisson'}",
                            "--run", f"saturation={tmp_path / 'saturation'}",
                            "--out", str(out)]) == 0
    page = (out / "long_serve.md").read_text()
    assert "| 12 / 3 | 3 of 10 | 1.167x |" in page
    assert "| poisson | online-ogd | tree@B4+prefill | 2 | 250.0 | 150.0 |" in page
    assert (out / "long_serve.png").is_file()
    data = json.loads((out / "long_serve.json").read_text())
    assert {s["protocol"] for s in data["summary"]} == {"poisson", "saturation"}


def test_a_failed_arm_is_refused(tmp_path):
    d = tmp_path / "arms"
    d.mkdir()
    (d / "x.json").write_text(json.dumps({**arm("x", [1], [1]), "error": "boom"}))
    with pytest.raises(SystemExit, match="failed"):
        long_serve.main(["--run", f"p={tmp_path}", "--out", str(tmp_path / "o")])


def test_a_kept_page_carries_its_runs_and_each_run_has_its_own_ratio(tmp_path):
    """--keep: an earlier page's runs stay; online / frozen is taken within each run."""
    for proto, (t_on, t_fr) in {"first": (90, 100), "second": (120, 100)}.items():
        d = tmp_path / proto / "arms"
        d.mkdir(parents=True)
        (d / "frozen.json").write_text(json.dumps(arm("frozen", [t_fr] * 4, [1, 2, 3, 4])))
        (d / "online.json").write_text(json.dumps(arm("online-ogd", [t_on] * 4, [1, 2, 3, 4])))
    long_serve.main(["--run", f"poisson={tmp_path / 'first'}", "--out", str(tmp_path / "a")])
    kept = tmp_path / "a" / "long_serve.json"
    assert long_serve.main(["--keep", str(kept), "--run", f"poisson-reversed={tmp_path / 'second'}",
                            "--out", str(tmp_path / "b")]) == 0
    data = json.loads((tmp_path / "b" / "long_serve.json").read_text())
    assert [s["protocol"] for s in data["summary"]] == ["poisson"] * 2 + ["poisson-reversed"] * 2
    got = {r["protocol"]: r["last_quarter_tpot_p50"] for r in data["ratios"]}
    assert got == {"poisson": pytest.approx(0.9), "poisson-reversed": pytest.approx(1.2)}
    assert "| poisson-reversed | online-ogd / frozen |" in (tmp_path / "b" / "long_serve.md").read_text()
    with pytest.raises(SystemExit, match="already on the page"):
        long_serve.main(["--keep", str(kept), "--run", f"poisson={tmp_path / 'second'}",
                         "--out", str(tmp_path / "c")])
