#!/usr/bin/env bash
# The GPU checks of /work/shared/gpu/README.md: kernel tests on the device, fused
# loss vs reference, one online update of a Qwen3-8B-shaped drafter. Needs torch + triton, no
# vLLM, no install: run from anywhere, e.g.
#   timeout 480 benchmarks/gpu_check.sh            # GPU machine: writes docs/results/gpu.{json,md}
#   benchmarks/gpu_check.sh --smoke --out /tmp/x   # CPU, tiny shapes (tests/test_gpu_check.py)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
smoke=0
for a in "$@"; do [[ "$a" == "--smoke" ]] && smoke=1; done
if [[ $smoke == 0 ]]; then
  unset TRITON_INTERPRET                 # Triton must compile for the GPU, not interpret
  export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
fi

# 0. Nothing on the check's path may import vLLM: import it all with a poisoned `vllm` first.
poison="$(mktemp -d)"
trap 'rm -rf "$poison"' EXIT
mkdir -p "$poison/vllm"
echo 'raise ImportError("poisoned vllm: the core must not import vllm")' > "$poison/vllm/__init__.py"
PYTHONPATH="$poison:$PYTHONPATH" "$PY" -c '
import vllm_onlinespec.kernels, vllm_onlinespec.learner, vllm_onlinespec.learner.factory
import vllm_onlinespec.training.blocks, vllm_onlinespec.drafter
import sys
sys.argv = ["gpu_check"]
import runpy; runpy.run_path("'"$REPO"'/benchmarks/gpu_check.py", run_name="gpu_check_imports")
assert "vllm" not in sys.modules or sys.modules["vllm"] is None
print("[0] imports without vllm: ok")
' || { echo "gpu_check: FAILED: something on the path imports vllm" >&2; exit 3; }

"$PY" "$REPO/benchmarks/gpu_check.py" "$@" || { rc=$?; echo "gpu_check: FAILED (exit $rc)" >&2; exit $rc; }
