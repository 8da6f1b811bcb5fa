"""lab/dominance_report.py: per point, ratios over orders and what each option cost."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dominance_report as D  # noqa: E402


def write_order(folder: Path, seed: int, tok_s: dict, prices: dict) -> None:
    arms = []
    for name, t in tok_s.items():
        cutter = {"option_steps": {"plain": 2, "tree": 6, "drafter": 2},
                  "option_ms_per_token": prices} if name == "frozen" else {}
        prof = {"steps": 100 + seed, "per_step_ms": {"target": 50.0 + seed, "sample": 2.0,
                                                     "draft": 1.0, "ours": 0.5, "other": 0.3}}
        arms.append({"spec": {"name": name}, "totals": {"tok_s": t, "acceptance_length": 2.0},
                     "learner": {"cutter": cutter},
                     "step_profile": prof if name == "frozen" else {}})
    d = folder / f"seed-{seed}"
    d.mkdir(parents=True)
    (d / "report.json").write_text(json.dumps({"meta": {"run_order": list(tok_s)}, "arms": arms}))


def test_the_page_gives_each_points_ratios_and_the_option_prices_of_its_bucket(tmp_path):
    write_order(tmp_path, 0, {"nospec": 10.0, "vllm-suffix": 15.0, "frozen": 12.0},
                {"plain@B8": 20.0, "tree@B8": 14.5, "drafter@B8": 30.0, "tree@B4": 9.0})
    write_order(tmp_path, 1, {"nospec": 10.0, "vllm-suffix": 12.0, "frozen": 12.0},
                {"plain@B8": 21.0, "tree@B8": 15.5})
    rows = D.point_rows(6, 0.0, D.load_point(tmp_path))
    frozen = next(r for r in rows if r["arm"] == "frozen")
    assert frozen["vs_best_other"] == {"median": 0.9, "min": 0.8, "max": 1.0}
    assert frozen["option_shares"] == {"plain": 0.2, "tree": 0.6, "drafter": 0.2}
    text = D.page(rows, argparse.Namespace(title="t", box="box", command="c"))
    # batch 6 falls in the B8 bucket; a price missing in an order is shown as missing
    assert ("frozen, batch 6, T 0: plain / tree / drafter 20.0 / 14.5 / 30.0 ms (B8); "
            "plain / tree / drafter 21.0 / 15.5 / - ms (B8)") in text
    assert "frozen batch 6 T 0: vs_best_other 0.90x -> MISSED" in text
    assert frozen["step_ms"]["target"] == 50.5 and frozen["steps"] == 100  # medians over orders
    assert "| frozen | 6 | 0 | 100 | 50.5 | 2.0 | 1.0 | 0.5 | 0.3 |" in text
