"""What the plugin changes in a vLLM process that does not run onlinespec: the CPU correctness
fixes (DFlash k-norm), not the Linear plain-weights patch, which only SpecDecodeWorker's runner
installs (serving/compat/patches.py). A fresh interpreter: patches are process-wide."""

import json
import subprocess
import sys

import pytest

# One fresh interpreter for both checks (a vLLM import costs ~15 s on a 2-vCPU box): what a
# vLLM process does at start (load_general_plugins runs plugin.register()), then what the
# plugin changed, as facts the tests below assert on.
PROBE = r"""
import json, sys, time
from types import SimpleNamespace
import vllm
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

facts = {"cpu": current_platform.is_cpu()}
t0 = time.perf_counter()
load_general_plugins()  # what every vLLM process does: the API server, engine core, workers
facts["register_s"] = time.perf_counter() - t0
facts["heavy"] = [m for m in ("vllm.model_executor.models.qwen3_dflash", "vllm.engine.arg_utils")
                  if m in sys.modules]
from vllm.engine.arg_utils import EngineArgs  # imported later: patched as it is imported
facts["engine_args_wrapped"] = bool(getattr(EngineArgs, "_onlinespec_wrapped", False))
from vllm.model_executor.models import qwen3_dflash
facts["knorm_module"] = qwen3_dflash.DFlashQwen3Model._normalize_context_k.__module__
from vllm.model_executor.layers import linear
from vllm_onlinespec.serving import compat
facts["linear_wrapped_after_register"] = bool(
    getattr(linear.UnquantizedLinearMethod, "_onlinespec_wrapped", False))
# Our runner's load_model path installs it, for the drafter's load only.
compat.wrap_drafter_load(SimpleNamespace(drafter=SimpleNamespace(load_model=lambda target: None)))
facts["linear_wrapped_by_runner"] = bool(
    getattr(linear.UnquantizedLinearMethod, "_onlinespec_wrapped", False))
print("FACTS " + json.dumps(facts))
"""


@pytest.fixture(scope="module")
def facts() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FACTS " in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.split("FACTS ")[-1])


def test_plugin_leaves_linear_alone_until_our_runner_loads_a_drafter(facts):
    assert not facts["linear_wrapped_after_register"], "Linear patched by the plugin alone"
    assert facts["linear_wrapped_by_runner"]
    if facts["cpu"]:  # the CPU correctness fix (DFlash k-norm) is in every process
        assert facts["knorm_module"] == "vllm_onlinespec.serving.compat.patches", facts


def test_the_plugin_imports_nothing_heavy_and_patches_on_import(facts):
    """vLLM runs the plugin in each of its processes: its fixes wait for the modules they fix
    (the DFlash model, EngineArgs) to be imported, instead of importing them in processes that
    never do (they cost ~7 s of imports per process on a 2-vCPU box)."""
    assert not facts["heavy"], f"the plugin imported {facts['heavy']}"
    assert facts["engine_args_wrapped"], "EngineArgs not wrapped"
    assert facts["register_s"] < 2.0, facts  # was 4-7 s here


def test_after_import_runs_once_the_module_is_executed(tmp_path, monkeypatch):
    from vllm_onlinespec.serving.compat.patches import after_import

    (tmp_path / "onlinespec_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("onlinespec_probe_mod", lambda m: seen.append(m.VALUE))
    assert seen == []  # not imported yet: nothing ran
    import onlinespec_probe_mod  # noqa: F401

    assert seen == [1]
    after_import("onlinespec_probe_mod", lambda m: seen.append(m.VALUE + 1))  # already there
    assert seen == [1, 2]
    sys.modules.pop("onlinespec_probe_mod")
