"""lab/gpu_check.sh cannot rot: its CPU smoke mode runs every step on tiny shapes (kernel
tests, loss check, start-up memory with the real build_learner, the serving loop beside the
learner thread; the CUDA-graph step says it needs CUDA), each in its own process, writes only
under its results folder, and nothing it imports may import vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_runs_every_step_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run(["bash", str(REPO / "lab" / "gpu_check.sh"), "--smoke", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md",
        "steps/A.json", "steps/B.json", "steps/C.json", "steps/D.json"]  # scratch removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing written beside it
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["smoke"] and not rep["failures"]
    a, b, c, d = (rep["steps"][k] for k in "ABCD")
    assert all(x["seconds"] > 0 for x in (a, b, c))
    assert a["kernel_tests"]["rc"] == 0
    assert {(x["v"], x["impl"]) for x in a["loss"]} == {(v, i) for v in (1000, 300)
                                                        for i in ("naive", "chunked")}
    assert all(x["ok"] for x in a["loss"] if x["impl"] != "naive")
    (row,) = b["learners"]
    assert row["check_fits"] == "fits" and row["updates"] == 2 and row["published_equal"]
    assert set(row["stated_gib"]) == {"held", "built", "later", "peak"}
    assert c["publishes"] > 0 and c["checked"] > 0 and c["check_max_err"] == 0.0
    assert c["updates"] > 0 and c["step_ms_off"] > 0 and c["step_ms_on"] > 0
    assert not c["learner_errors"] and not c["hook_errors"]
    assert c["buffer"]["records_in"] > 0  # the real feedback stage fed the learner's buffer
    assert d == {"step": "D", "name": "graphs", "seconds": d["seconds"], "failures": [],
                 "skipped": "CUDA graphs need a CUDA device"}
    md = (out / "gpu_check.md").read_text()
    assert "Smoke run" in md and "| float32 |" in md and "## C. Serving beside" in md


def test_report_names_a_step_that_left_no_result(tmp_path):
    """A step killed at its time limit (or whose process crashed) leaves no steps/X.json: the
    report says so, as a failure, and still shows the steps that finished."""
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "D.json").write_text(json.dumps(
        {"step": "D", "name": "graphs", "seconds": 1.0, "failures": [], "skipped": "x"}))
    r = subprocess.run([sys.executable, str(REPO / "lab" / "gpu_check.py"), "--report", "--smoke",
                        "--steps", "BD", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["failures"] == ["B memory: no result: the step was killed (time limit) or "
                               "crashed; see gpu_check.log"]
    assert "| D graphs | 1.0 | ok |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_refuses_vllm_imports():
    code = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='x')\n"
            "try:\n    import vllm\nexcept ImportError as e:\n    print('blocked', e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(REPO / "lab" / "gpu_check.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "blocked" in r.stdout, r.stderr


def test_device_wheels_target_carries_pydantic_and_its_dependencies():
    """The device image has no pydantic: `make device-wheels` downloads it and what it imports
    into .whl/ (git-ignored), which gpu_check.sh installs when pydantic is missing."""
    make = (REPO / "Makefile").read_text()
    target = make[make.index("DEVICE_WHEELS :="):make.index("clean:")]
    for name in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection",
                 "typing_extensions"):
        assert f" {name}" in target.splitlines()[0]
    assert "--python-version 3.12" in target and "-d .whl" in target
    assert "/.whl/" in (REPO / ".gitignore").read_text().splitlines()
    sh = (REPO / "lab" / "gpu_check.sh").read_text()
    assert "--no-index --no-deps --target" in sh and '.whl/*.whl' in sh
