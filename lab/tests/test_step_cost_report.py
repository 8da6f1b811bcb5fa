"""lab/step_cost.py's report: every arm is compared with the plain arm of its own dtype
(float32 arms with nospec-fp32 where it ran), never with itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import step_cost as S  # noqa: E402


def row(arm: str, batch: int, tok_s: float, step_ms: float) -> S.Row:
    return S.Row(arm=arm, batch=batch, K=0 if arm.startswith("nospec") else 4, tok_s=tok_s,
                 tok_s_min=tok_s, tok_s_max=tok_s, step_ms=step_ms, step_ms_min=step_ms,
                 step_ms_max=step_ms, accept_len=None, verify_tokens_per_step=0.0,
                 tokens_per_step=1.0, repeats=1)


def test_float32_arms_against_the_float32_plain_arm():
    rows = [row("nospec", 1, 30.0, 33.0), row("nospec-fp32", 1, 10.0, 100.0),
            row("k0", 1, 27.0, 37.0), row("k0-fp32", 1, 9.0, 111.0)]
    S.add_speedups(rows)
    sp = {r.arm: r.speedup for r in rows}
    assert sp["k0"] == 27.0 / 30.0 and sp["k0-fp32"] == 9.0 / 10.0
    assert sp["nospec"] is None and sp["nospec-fp32"] is None
    md = S.markdown(rows, {"command": "c", "wall_s": 1.0, "box": "b", "target": "t", "drafter": "d",
                           "dtype": "x", "max_tokens": 1, "batches": [1], "repeats": 1,
                           "date": "today"})
    assert "| k0-fp32 | 4 | 1.11x |" in md and "| k0 | 4 | 1.12x |" in md


def test_float32_arms_fall_back_to_nospec_without_a_float32_plain_arm():
    rows = [row("nospec", 8, 100.0, 50.0), row("frozen-fp32", 8, 50.0, 100.0)]
    S.add_speedups(rows)
    assert rows[1].speedup == 0.5 and S.baseline_arm("frozen-fp32", {"nospec"}) == "nospec"
