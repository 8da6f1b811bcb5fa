"""lab/worker_price.py: the runs' order and the paired ratios of the page."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import worker_price as W  # noqa: E402


def test_runs_alternate_so_each_arm_leads_half_the_pairs():
    assert W.run_order(6) == ["vllm-dflash", "ours", "ours", "vllm-dflash", "vllm-dflash", "ours"]
    pairs = [W.run_order(8)[i:i + 2] for i in range(0, 8, 2)]
    assert all(sorted(p) == sorted(W.ARMS) for p in pairs)
    assert sum(p[0] == "ours" for p in pairs) == 2


def _row(arm, batch, tok_s, target=100.0):
    r = {"arm": arm, "batch": batch, "tok_s": tok_s, "accepted": 60, "drafts": 100}
    if arm == "ours":
        r["per_step_ms"] = {"target": target, "sample": 3.0, "draft": 20.0, "ours": 0.5, "other": 0.7}
    return r


def test_ratio_is_within_each_pair_and_the_profile_is_the_median():
    rows = []
    # The box slows down over the runs: a ratio of medians would blame the later arm, the
    # pairs see the same 0.95 throughout.
    for i, (a, b) in enumerate(zip(["vllm-dflash", "ours", "vllm-dflash"], ["ours", "vllm-dflash", "ours"])):
        base = 60.0 - 10 * i
        rows += [_row(a, 8, base if a == "vllm-dflash" else 0.95 * base, target=100 + i),
                 _row(b, 8, base if b == "vllm-dflash" else 0.95 * base, target=100 + i)]
    s = {r["arm"]: r for r in W.summarise(rows)}
    assert s["ours"]["vs_vllm_dflash"] == 0.95 and s["ours"]["spread"] == [0.95, 0.95]
    assert s["ours"]["per_step_ms"]["target"] == 101.0
    assert s["vllm-dflash"]["runs"] == 3 and s["vllm-dflash"]["accepted_per_draft"] == 0.6
    assert "vs_vllm_dflash" not in s["vllm-dflash"]
    md = W.markdown({"date": "d", "box": "b", "command": "c", "wall_s": 1, "max_tokens": 8,
                     "dtype": "float32", "rounds": 1, "summary": W.summarise(rows), "rows": rows})
    assert "0.950x (0.950-0.950)" in md
    assert "batch 8: the same accepted tokens and drafts" in md and "0.50 ms of a 125.2 ms step" in md
    assert "the worker slower in every pair" in md
    one = W.summarise(rows[:1])  # a single run: no pair, no ratio, and the page still renders
    assert W.markdown({"date": "d", "box": "b", "command": "c", "wall_s": 1, "max_tokens": 8,
                       "dtype": "float32", "rounds": 1, "summary": one, "rows": rows[:1]})
