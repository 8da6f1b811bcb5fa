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
