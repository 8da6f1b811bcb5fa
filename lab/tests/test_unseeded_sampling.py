"""lab/unseeded_sampling.py: the rounds' order and the page's medians per batch."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import unseeded_sampling as U  # noqa: E402


def test_each_mode_meets_the_box_early_and_late():
    order = U.rounds_for("ours", 2)
    assert order == ["vllm", "lean", "all", "all", "lean", "vllm"] * 2
    assert U.rounds_for("nospec", 2) == ["nospec"] * 4


def test_summary_is_per_batch_against_that_batchs_nospec():
    rows = []
    for batch, base in ((8, 50.0), (32, 100.0)):
        rows += [{"arm": "nospec", "batch": batch, "tok_s": base + d, "accept_len": None}
                 for d in (-1, 1)]
        for arm, f, ms in (("vllm", 0.9, 15.0), ("lean", 1.0, 5.0), ("all", 1.2, 3.0)):
            rows += [{"arm": arm, "batch": batch, "tok_s": base * f + d, "accept_len": 1.5,
                      "sample_ms_per_step": ms} for d in (-2, 2)]
    s = {(r["batch"], r["arm"]): r for r in U.summarise(rows)}
    assert s[(8, "nospec")]["vs_nospec"] == 1.0 and s[(32, "all")]["vs_nospec"] == 1.2
    assert s[(8, "vllm")]["tok_s_min"] == 43.0 and s[(8, "vllm")]["tok_s_max"] == 47.0
    assert s[(32, "lean")]["sample_ms_per_step"] == 5.0 and s[(32, "lean")]["rounds"] == 2
