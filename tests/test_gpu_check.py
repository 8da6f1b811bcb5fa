"""lab/gpu_check.sh cannot rot: its CPU smoke mode runs the same four checks on tiny
shapes (kernel tests, loss benchmark, one learner update + publish, the feedback copy), and
nothing it imports may import vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_runs_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", str(REPO / "lab" / "gpu_check.sh"), "--smoke", "--out",
                        str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] imports without vllm, pydantic, pydantic_core, annotated_types: ok" in r.stdout
    rep = json.loads((tmp_path / "gpu.json").read_text())
    assert rep["smoke"] and not rep["failures"]
    assert rep["kernel_tests"]["rc"] == 0
    assert {row["impl"] for row in rep["loss"]} == {"naive", "chunked"}
    assert all(row["ms"] > 0 for row in rep["loss"])
    (row,) = rep["learner"]
    assert "error" not in row and row["update_ms"] > 0 and row["publish_ms"] >= 0
    assert 0 < row["stated_steady_mib"] <= row["stated_peak_mib"]  # the footprint the learner states
    assert rep["graphs"] == {"skipped": "CUDA graphs need a CUDA device"}
    assert "| float32 |" in (tmp_path / "gpu.md").read_text()
    (fb,) = rep["feedback"]
    assert fb["equal"] and fb["rows"] == 6 and fb["sync_ms"] > 0


def test_gpu_check_refuses_vllm_imports():
    code = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='x')\n"
            "try:\n    import vllm\nexcept ImportError as e:\n    print('blocked', e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(REPO / "lab" / "gpu_check.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "blocked" in r.stdout, r.stderr


def test_gpu_check_smoke_writes_outside_the_results_folder(tmp_path):
    """A smoke run's figures are not measurements: without --out they go to a new temporary
    folder, never over docs/results/gpu.{json,md} where a device run's results belong."""
    before = {p: p.stat().st_mtime for p in (REPO / "docs" / "results").glob("gpu.*")}
    r = subprocess.run([sys.executable, str(REPO / "lab" / "gpu_check.py"), "--smoke",
                        "--skip", "kernels,loss,learner,feedback"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wrote = [ln for ln in r.stdout.splitlines() if ln.startswith("gpu_check: wrote ")]
    assert wrote and "gpu_check-smoke-" in wrote[0]
    assert {p: p.stat().st_mtime for p in (REPO / "docs" / "results").glob("gpu.*")} == before
