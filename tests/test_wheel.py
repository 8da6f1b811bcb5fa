"""The package as a user installs it: a wheel built from this tree, installed non-editable into a
folder of its own beside the environment's vLLM. Every module imports from that folder, vLLM's
general-plugin loader runs `register()` from it (vLLM does so in every process it starts, so a
module missing from the wheel would stop every vLLM process), and `vllm serve` serves with the
shipped drafter and the `cpu` preset from it, through a short soak with faults (bench-soak).

The editable install of the test environment is switched off in every process these tests start
(a `sitecustomize` drops setuptools' editable finder), so nothing can fall back on the source tree.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = """\
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", type(f).__module__).startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks
                     if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the install folder, an environment whose processes see only it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
                    str(REPO)], check=True, cwd=tmp)
    wheels = list((tmp / "dist").glob("vllm_onlinespec-*.whl"))
    assert len(wheels) == 1, wheels
    target = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target),
                    str(wheels[0])], check=True, cwd=tmp)
    (tmp / "boot").mkdir()
    (tmp / "boot" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{tmp / 'boot'}{os.pathsep}{target}"}
    return target, env


def run_python(code: str, env: dict, cwd: Path) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_wheel_ships_every_module_and_vllm_loads_the_plugin(installed, tmp_path):
    target, env = installed
    source_modules = sorted(
        "vllm_onlinespec." + ".".join(p.relative_to(REPO / "vllm_onlinespec").with_suffix("").parts)
        for p in (REPO / "vllm_onlinespec").rglob("*.py"))
    source_modules += sorted(f"vllm_onlinespec.kernels.{p.stem}" for p in (REPO / "kernels").glob("*.py"))
    out = run_python(f"""
        import importlib, json, sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()   # what every vLLM process does: runs plugin.register()
        import vllm_onlinespec.plugin
        files = {{}}
        for name in {source_modules!r}:
            name = name.removesuffix(".__init__")
            files[name] = importlib.import_module(name).__file__
        print(json.dumps(files))
        """, env, tmp_path)
    files = json.loads(out.strip().splitlines()[-1])
    outside = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(target.resolve())}
    assert not outside, f"imported from outside the wheel's install: {outside}"
    assert "vllm_onlinespec.sampling.invariant" in files
    # The shipped drafter and adapter travel as package data.
    drafter = target / "vllm_onlinespec" / "drafters" / "smollm2-135m"
    for name in ("config.json", "model.safetensors", "length_head.safetensors", "train_meta.json"):
        assert (drafter / name).is_file(), name
    assert list((target / "vllm_onlinespec" / "adapters").glob("*/adapter_model.safetensors"))


@pytest.mark.vllm
def test_a_short_soak_served_from_the_wheel(installed, smollm2_path, tmp_path):
    """`vllm-onlinespec bench-soak` from the wheel: `vllm serve` with the shipped drafter and the
    cpu preset learning, under the soak's whole mix (greedy, sampled, seeded, n = 2, a prompt
    near max_model_len, streamed, dropped mid-stream, and malformed requests), a target swap at
    half time, then SIGKILL while a checkpoint is being written and a restart with the same
    command. Nothing well-formed fails, every malformed request gets a 4xx, every greedy answer
    equals the target's own greedy continuation (float32), the learner publishes (read from the
    plugin's /metrics), the restarted server resumes the newest complete checkpoint and serves
    exactly its drafter, and SIGINT exits cleanly. (The kill during an update runs in
    `bench-soak`'s default set, outside CI's time.)"""
    from vllm_onlinespec.models import pull

    target, env = installed
    pull("smollm2-135m-terse")
    out = tmp_path / "run"
    # Every update publishes and checkpoints: a short run writes checkpoints to kill during.
    cmd = [sys.executable, "-m", "vllm_onlinespec.cli", "bench-soak", "--duration", "24",
           "--concurrency", "3", "--max-tokens", "24", "--max-model-len", "1024",
           "--malformed-every", "4", "--kills", "checkpoint",
           "--online", json.dumps({"publish": {"every_n_updates": 1},
                                   "min_new_tokens_per_update": 8}), "--out", str(out)]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert (out / "soak.json").is_file(), r.stdout[-3000:] + r.stderr[-6000:]
    result = json.loads((out / "soak.json").read_text())
    assert result["server_command"][:3] == ["vllm", "serve", "TARGET"], result["server_command"]
    s = result["summary"]
    assert s["failed_wellformed"] == 0, result["failures"]
    assert s["malformed_total"] >= 4 and s["malformed_4xx"] == s["malformed_total"], \
        s["malformed_statuses"]
    assert s["wellformed"] >= 10
    assert s["swap"]["ok"], s["swap"]
    g = s["greedy"]
    assert g["compared"] >= 2 and g["mismatches"] == 0, g  # some straddle the swap: not compared
    assert s["learner_errors"] == 0 and s["hook_errors"] == 0
    assert s["publishes"] >= 1 and s["drafter_version"] >= 1, s
    # A checkpoint write may end between seeing it and the kill: the soak tries again (3 times).
    caught = [k for k in s["kills"] if k["caught"]]
    assert [k["moment"] for k in caught] == ["checkpoint"] and caught[0]["tmp_left"], s["kills"]
    for k in s["kills"]:  # every restart, caught there or not, resumed the newest checkpoint
        assert k["answered"] and k["digest_equal"], k
        assert k["resumed_version"] == k["newest_complete"] is not None, k
        assert any("resumed drafter version" in line for line in k["said"]), k
    assert result["stop_exit_code"] == 0
    assert r.returncode == 0, r.stdout[-3000:]
    assert (out / "soak.md").is_file() and (out / "soak.png").is_file()
    # The server ran the plugin from the wheel, not from the source tree.
    log = (out / "serve.log").read_text()
    assert "onlinespec: worker ready" in log and str(REPO / "vllm_onlinespec") not in log
