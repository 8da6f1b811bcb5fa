"""lab/dominance_served.py: per-round ratios of a served sweep, the choice and its prices."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dominance_served as S  # noqa: E402


def _pt(arm, c, rnd, tok_s, steps=None, prices=None):
    return {"arm": arm, "concurrency": c, "repeat": rnd, "output_tok_s": tok_s,
            "p50_tpot_ms": 1000 / tok_s, "failed": 0, "acceptance_length": 2.0 if steps else None,
            "option_steps": steps, "option_ms_per_token": prices}


def test_ratios_pair_arms_within_a_round_and_prices_come_from_cs_bucket(tmp_path):
    pts = [_pt("nospec", 4, 0, 10.0), _pt("vllm-suffix", 4, 0, 15.0),
           _pt("frozen", 4, 0, 12.0, {"plain": 2, "tree": 6, "drafter": 2},
               {"tree@B4": 9.0, "plain@B4": 11.0, "tree@B1": 40.0}),
           _pt("nospec", 4, 1, 20.0), _pt("vllm-suffix", 4, 1, 18.0),
           _pt("frozen", 4, 1, 20.0, {"plain": 0, "tree": 10, "drafter": 0}, {"tree@B4": 8.0}),
           _pt("k0", 4, 0, 9.0, {"plain": 0, "tree": 0, "drafter": 0}), _pt("k0", 4, 1, 19.0)]
    rows = {r["arm"]: r for r in S.served_rows(pts)}
    f = rows["frozen"]
    assert f["vs_best_other"] == {"median": 0.9, "min": 0.8, "max": 1.0}  # 12/15, 20/20
    assert f["vs_nospec"] == {"median": 1.1, "min": 1.0, "max": 1.2}
    assert f["option_shares"] == {"plain": 0.1, "tree": 0.8, "drafter": 0.1}
    assert f["option_ms_per_token"] == [{"tree": 9.0, "plain": 11.0}, {"tree": 8.0}]
    assert "option_shares" not in rows["k0"]  # held the options, never chose
    assert rows["k0"]["vs_nospec"]["min"] == 0.9
    run = tmp_path / "run"
    run.mkdir()
    (run / "concurrency.json").write_text(json.dumps({"points": pts, "run_order": [["a"]]}))
    into = tmp_path / "dominance.json"
    into.write_text(json.dumps({"rows": [1]}))
    sys.argv = ["x", "--run", str(run), "--box", "box", "--out-dir", str(tmp_path),
                "--into", str(into)]
    assert S.main() == 0
    d = json.loads(into.read_text())
    assert d["rows"] == [1] and [r["arm"] for r in d["served_rows"]] == list(rows)
    text = (tmp_path / "dominance_served.md").read_text()
    assert "- frozen C 4: vs_best_other 0.90x -> MISSED" in text
    assert "- frozen, C 4: 11.0 / 9.0 / -; - / 8.0 / -" in text
