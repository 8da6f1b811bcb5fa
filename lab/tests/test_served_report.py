"""lab/served_report.py: passes of drafter_served.py into one page of ratios."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from served_report import rows_from_passes  # noqa: E402


def arm(name, b1, b8, acc=None):
    return {"arm": {"name": name}, "phases": [
        {"batch": 1, "tok_s": b1, "acceptance_length": acc},
        {"batch": 8, "tok_s": b8, "acceptance_length": acc}]}


def test_ratios_are_against_each_passs_own_nospec():
    passes = [[arm("nospec", 30, 150), arm("tree", 45, 150, 2.0)],
              [arm("tree", 40, 120, 3.0), arm("nospec", 20, 100)],  # a slower pass, reversed
              [arm("nospec", 30, 150), arm("tree", 60, 165, 2.5)]]
    rows = {(r.arm, r.batch): r for r in rows_from_passes(passes)}
    t1 = rows[("tree", 1)]
    assert t1.vs_nospec == 2.0 and t1.spread == (1.5, 2.0) and t1.repeats == 3
    assert t1.tok_s == 45 and t1.accept_len == 2.5
    assert rows[("tree", 8)].vs_nospec == 1.1 and rows[("tree", 8)].spread == (1.0, 1.2)
    assert rows[("nospec", 1)].vs_nospec == 1.0 and rows[("nospec", 1)].accept_len is None
    assert [r.arm for r in rows_from_passes(passes)][:2] == ["nospec", "nospec"]


def test_a_pass_without_nospec_is_refused():
    with pytest.raises(SystemExit, match="pass 1: no nospec"):
        rows_from_passes([[arm("tree", 1, 1)]])


def test_paired_ratio_is_within_each_pass():
    from served_report import paired

    passes = [[arm("a", 30, 150), arm("b", 20, 100)], [arm("b", 10, 50), arm("a", 20, 100)],
              [arm("a", 1, 1)]]  # b missing: skipped
    assert paired(passes, "a", "b") == {1: [1.5, 2.0], 8: [1.5, 2.0]}
