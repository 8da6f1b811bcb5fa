"""lab/target_shift_report.py on a synthetic run: rows per scenario and arm, the goals'
figures from the medians and the windows."""

import importlib.util
import json
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).resolve().parents[1] / "target_shift_report.py"
    spec = importlib.util.spec_from_file_location("target_shift_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scenario(folder: Path, arms: dict[str, tuple[float, float, float, list[float]]]):
    """arms: name -> (tok_s, first_20, last_quarter, window tok/s)."""
    folder.mkdir(parents=True)
    summary = [{"arm": a, "seeds": 2, "failed_requests": 0,
                "median": {"tok_s": t, "speedup": t / arms["nospec"][0],
                           "acceptance_length": lq, "first_20": f, "last_quarter": lq},
                "spread": {"tok_s": [t - 1, t + 1], "speedup": [0.9, 1.1]}}
               for a, (t, f, lq, _) in arms.items()]
    (folder / "report.json").write_text(json.dumps({"seeds": [0, 1], "summary": summary}))
    for seed in (0, 1):
        (folder / f"seed-{seed}").mkdir()
        run = {"arms": [{"spec": {"name": a}, "waves": [
            {"t_start_s": 20.0 * i, "tok_s": w, "acceptance_length": lq, "version_end": i}
            for i, w in enumerate(ws)]} for a, (_, _, lq, ws) in arms.items()]}
        (folder / f"seed-{seed}" / "report.json").write_text(json.dumps(run))


def test_rows_goals_and_page(tmp_path):
    mod = _load()
    run = tmp_path / "run"
    _scenario(run / "finetuned", {"nospec": (100.0, 1, 1, [100, 100]),
                                  "vllm-suffix": (120.0, 1.5, 1.5, [120, 120]),
                                  "frozen": (110.0, 1.4, 1.4, [110, 110]),
                                  "online-ogd": (121.0, 1.4, 1.75, [105, 130])})
    _scenario(run / "cold_start", {"nospec": (100.0, 1, 1, [100, 100, 100]),
                                   "frozen": (99.0, 1.0, 1.0, [60, 96, 99]),
                                   "online-ogd": (98.0, 1.0, 1.1, [60, 90, 99])})
    rows = [r for s in ("finetuned", "cold_start") for r in mod.scenario_rows(run / s, s)]
    assert [(r["scenario"], r["arm"]) for r in rows][:4] == [
        ("finetuned", "nospec"), ("finetuned", "suffix"), ("finetuned", "frozen"),
        ("finetuned", "online")]
    assert len(rows[3]["windows"]) == 2 and rows[3]["windows"][0][1]["tok_s"] == 130
    g = mod.goals(rows)
    assert g[0].startswith("finetuned: online acceptance over the last quarter 1.250x frozen")
    assert "whole-stream tok/s 1.100x frozen" in g[0]
    # the first window is warm-up; the lowest later one is 0.90x nospec's median window
    assert g[1].startswith("cold_start: frozen lowest window after the first 0.960x")
    assert g[2].startswith("cold_start: online lowest window after the first 0.900x")
    md = mod.markdown(rows, {"when": "2026-12-05", "box": "box"})
    assert "| finetuned | online | 121.0 (120.0-122.0) | 1.21x (0.90-1.10) | 1.75 | 1.40 | 1.75 | 0 |" in md
    with pytest.raises(FileNotFoundError):
        mod.scenario_rows(tmp_path / "missing", "finetuned")


def test_swap_scenario_splits_the_windows_at_the_swap(tmp_path):
    mod = _load()
    folder = tmp_path / "swap"
    folder.mkdir()
    arms = {"nospec": [(1, 0)] * 4, "frozen": [(10, 10), (10, 4), (10, 4), (10, 4)],
            "online-ogd": [(10, 10), (10, 4), (10, 6), (10, 9)]}  # (drafts, accepted) per window
    summary = [{"arm": a, "seeds": 2, "failed_requests": 0,
                "median": {"tok_s": 1.0, "acceptance_length": 1.5}, "spread": {"tok_s": [1, 1]}}
               for a in arms]
    (folder / "report.json").write_text(json.dumps({"seeds": [0, 1], "summary": summary}))
    for seed in (0, 1):
        (folder / f"seed-{seed}").mkdir()
        run = {"arms": [{"spec": {"name": a}, "swap": {"t_s": 20.0, "request": 33},
                         "waves": [{"t_start_s": 20.0 * i, "tok_s": 1.0, "drafts": d,
                                    "accepted": acc, "acceptance_length": (acc + d) / d}
                                   for i, (d, acc) in enumerate(ws)]} for a, ws in arms.items()]}
        (folder / f"seed-{seed}" / "report.json").write_text(json.dumps(run))
    rows = {r["arm"]: r for r in mod.scenario_rows(folder, "swap")}
    fr, on = rows["frozen"], rows["online"]
    assert fr["accept_len_before_swap"] == pytest.approx(2.0) and fr["swap_t_s"] == 20.0
    assert fr["accept_len_first_window_after_swap"] == pytest.approx(1.4)
    assert on["accept_len_last_quarter_after_swap"] == pytest.approx(1.9)
    (g,) = [x for x in mod.goals(list(rows.values())) if x.startswith("swap")]
    assert "recovered 83% of what the swap cost" in g  # (1.9 - 1.4) / (2.0 - 1.4)
