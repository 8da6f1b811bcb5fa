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


QUIET = r"""
import os, sys
import zmq
from vllm.distributed.device_communicators import shm_broadcast as sb
from vllm_onlinespec import plugin
from vllm_onlinespec.serving.compat import patches

plugin.register()
reader = sb.SpinCondition(True, zmq.Context(), "ipc:///tmp/onlinespec-quiet-test")
want = sys.argv[1] == "1"
assert (reader.busy_loop_s == 0.0) == want, reader.busy_loop_s
# The building process sets the variable for a learning CPU engine and clears it for others.
patches._set_quiet_readers(True)
assert os.environ.get(patches.QUIET_READERS_ENV) == "1"
patches._set_quiet_readers(False)
assert patches.QUIET_READERS_ENV not in os.environ
print("OK")
"""


def test_shm_readers_stop_spinning_only_in_a_learning_engines_processes():
    import os

    for flag in ("1", "0"):
        env = {k: v for k, v in os.environ.items() if k != "ONLINESPEC_QUIET_READERS"}
        if flag == "1":
            env["ONLINESPEC_QUIET_READERS"] = "1"
        r = subprocess.run([sys.executable, "-c", QUIET, flag], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]
