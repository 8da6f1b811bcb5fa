"""What the plugin changes in a vLLM process that does not run onlinespec: the CPU correctness
fixes (DFlash k-norm), not the Linear plain-weights patch, which only SpecDecodeWorker's runner
installs (serving/compat/patches.py). A fresh interpreter: patches are process-wide."""

import subprocess
import sys

CHECK = r"""
from types import SimpleNamespace
from vllm.model_executor.layers import linear
from vllm.model_executor.models import qwen3_dflash
from vllm.platforms import current_platform

from vllm_onlinespec import plugin
from vllm_onlinespec.serving import compat

orig_knorm = qwen3_dflash.DFlashQwen3Model._normalize_context_k
plugin.register()
assert not getattr(linear.UnquantizedLinearMethod, "_onlinespec_wrapped", False), "Linear patched"
if current_platform.is_cpu():
    assert qwen3_dflash.DFlashQwen3Model._normalize_context_k is not orig_knorm, "k-norm not fixed"
# Our runner's load_model path installs it, for the drafter's load only.
drafter = SimpleNamespace(load_model=lambda target: None)
compat.wrap_drafter_load(SimpleNamespace(drafter=drafter))
assert getattr(linear.UnquantizedLinearMethod, "_onlinespec_wrapped", False)
print("OK")
"""


def test_plugin_leaves_linear_alone_until_our_runner_loads_a_drafter():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]


LAZY = r"""
import sys, time
import vllm
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

t0 = time.perf_counter()
load_general_plugins()  # what every vLLM process does: the API server, engine core, workers
took = time.perf_counter() - t0
heavy = [m for m in ("vllm.model_executor.models.qwen3_dflash", "vllm.engine.arg_utils")
         if m in sys.modules]
assert not heavy, f"the plugin imported {heavy}"
from vllm.engine.arg_utils import EngineArgs  # imported later: patched as it is imported
assert getattr(EngineArgs, "_onlinespec_wrapped", False), "EngineArgs not wrapped"
from vllm.model_executor.models import qwen3_dflash
fixed = qwen3_dflash.DFlashQwen3Model._normalize_context_k.__module__
if current_platform.is_cpu():
    assert fixed == "vllm_onlinespec.serving.compat.patches", fixed
print(f"OK {took:.2f}")
"""


def test_the_plugin_imports_nothing_heavy_and_patches_on_import():
    """vLLM runs the plugin in each of its processes: its fixes wait for the modules they fix
    (the DFlash model, EngineArgs) to be imported, instead of importing them in processes that
    never do (they cost ~7 s of imports per process on a 2-vCPU box)."""
    r = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert float(r.stdout.split("OK")[-1]) < 2.0, r.stdout  # was 4-7 s here


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
