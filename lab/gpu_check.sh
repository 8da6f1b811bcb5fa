#!/usr/bin/env bash
# The GPU checks of /work/shared/gpu/README.md: kernel tests on the device, fused
# loss vs reference, online updates of a Qwen3-8B-shaped drafter beside a stand-in KV cache,
# the feedback copy, CUDA-graph pool and publish probes. Needs torch + triton +
# safetensors; no vLLM, no pydantic, no install: run from anywhere, e.g.
#   timeout 480 lab/gpu_check.sh            # GPU machine: writes docs/results/gpu.{json,md}
#   lab/gpu_check.sh --smoke --out /tmp/x   # CPU, tiny shapes (tests/test_gpu_check.py)
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

# 0. The device image has no vLLM and no pydantic: import everything the checks use with those
#    refused, and name the module and the exception if that fails.
"$PY" "$REPO/lab/gpu_check.py" --imports-only \
  || { echo "gpu_check: FAILED at step [0]: the imports above fail without vllm/pydantic" >&2; exit 3; }

"$PY" "$REPO/lab/gpu_check.py" "$@" || { rc=$?; echo "gpu_check: FAILED (exit $rc)" >&2; exit $rc; }
