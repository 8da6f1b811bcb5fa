"""The package as a user installs it: a wheel built from this tree, installed non-editable into a
folder of its own beside the environment's vLLM. Every module imports from that folder, vLLM's
general-plugin loader runs `register()` from it (vLLM does so in every process it starts, so a
module missing from the wheel would stop every vLLM process), and `vllm serve` serves with the
shipped drafter and the `cpu` preset from it.

The editable install of the test environment is switched off in every process these tests start
(a `sitecustomize` drops setuptools' editable finder), so nothing can fall back on the source tree.
"""

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port

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
def test_vllm_serve_from_the_wheel(installed, smollm2_path, tmp_path):
    """`vllm serve` with the `onlinespec` key (the cpu preset, learning on) and the drafter shipped
    in the wheel: start, answer one chat completion, exit on SIGINT."""
    from vllm_onlinespec.bench.concurrency import stop, wait_healthy
    from vllm_onlinespec.engine import serve_args

    target, env = installed
    drafter = target / "vllm_onlinespec" / "drafters" / "smollm2-135m"
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", smollm2_path, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--served-model-name", "smollm2",
           "--speculative-config", json.dumps({"method": "dflash", "model": str(drafter),
                                               "num_speculative_tokens": 16}),
           "--additional-config", json.dumps({"onlinespec": {"preset": "cpu"}}),
           *serve_args(max_model_len=512)]
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        body = json.dumps({"model": "smollm2", "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "Count to five."}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["message"]["content"].strip()
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert "onlinespec:" in metrics  # the plugin's collector, registered from the wheel
    except Exception:
        print(log.read_text()[-6000:])
        raise
    finally:
        stop(proc)
    assert proc.returncode is not None
