"""lab/results_tables.py: markdown results tables -> JSON rows, and every results page
in docs/results has its data beside it."""

import json
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]
ROOT = LAB.parent
sys.path.insert(0, str(LAB))

import results_tables as R  # noqa: E402


def test_tables_become_rows_with_numbers():
    md = "# T\n\n| arm | tok/s |\n|---|---|\n| nospec | 23.1 |\n| oracle | **53.1** |\n\ntext\n"
    (t,) = R.tables(md)
    assert t["header"] == ["arm", "tok/s"]
    assert t["rows"] == [{"arm": "nospec", "tok/s": 23.1}, {"arm": "oracle", "tok/s": 53.1}]


def test_every_results_page_has_its_json():
    for md in (ROOT / "docs" / "results").glob("*.md"):
        data = md.with_suffix(".json")
        assert data.is_file(), f"{md.name} has no {data.name}"
        json.loads(data.read_text())


def test_index_lists_every_result():
    """docs/results/README.md has a row (or a superseded entry) for every result page."""
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    for md in (ROOT / "docs" / "results").glob("*.md"):
        if md.name == "README.md":
            continue
        assert f"]({md.name})" in index, f"docs/results/README.md does not list {md.name}"


def test_index_json_holds_the_index_table():
    """README.json is the index's table as data: one row per linked result, same headlines."""
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    rows = json.loads((ROOT / "docs" / "results" / "README.json").read_text())["rows"]
    linked = [line for line in index.splitlines() if line.startswith("| [")]
    assert [r["page"] for r in rows] == [line.split("](")[1].split(")")[0] for line in linked]
    for r, line in zip(rows, linked):
        assert r["headline"] in line and r["command"] in line
