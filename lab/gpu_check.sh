#!/usr/bin/env bash
# The GPU checks of lab/gpu_check.py, each step in its own process with its own time limit (one
# that fails or hangs hides nothing of the others), then one report. Writes only under the
# results folder: $OUT/gpu_check.json, gpu_check.md, gpu_check.log, steps/*.json.
#
#   make device-wheels                        # once, where a package registry is reachable
#   OUT=/some/dir lab/gpu_check.sh            # on the GPU machine (at most 7 minutes)
#   lab/gpu_check.sh --smoke --out /tmp/x     # CPU, tiny shapes (tests/test_gpu_check.py)
#   lab/gpu_check.sh --steps BC               # a subset
#
# The GPU machine has python3 with torch, Triton and pytest, but no vLLM and no pydantic: the
# pydantic wheels `make device-wheels` put in .whl/ travel with the working tree and are
# installed here (into /tmp/site, on PYTHONPATH) when pydantic is missing.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
smoke=""
steps="ABCD"
out="${OUT:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) smoke="--smoke" ;;
    --out) out="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$out" ]] || { echo "gpu_check.sh: set OUT or pass --out DIR" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
: > "$log"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
if [[ -z "$smoke" ]]; then
  unset TRITON_INTERPRET                     # Triton must compile for the GPU, not interpret
  export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
  export TRITON_CACHE_DIR="$out/scratch/triton" CUDA_CACHE_PATH="$out/scratch/nv"
fi

if ! "$PY" -c "import pydantic" 2>/dev/null; then
  shopt -s nullglob
  wheels=("$REPO"/.whl/*.whl)
  if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "gpu_check: FAILED: no pydantic here and no wheels in .whl/ (run 'make device-wheels'" \
         "and carry .whl with the working tree)" | tee -a "$log" >&2
    exit 3
  fi
  site=/tmp/site
  "$PY" -m pip install -q --no-index --no-deps --target "$site" "${wheels[@]}" 2>>"$log" \
    || for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$site"; done  # no pip: a wheel is a zip
  export PYTHONPATH="$site:$PYTHONPATH"  # first: its typing_extensions is the one pydantic needs
  "$PY" -c "import pydantic; print('gpu_check: pydantic', pydantic.VERSION, 'from .whl/')" | tee -a "$log"
fi

# Seconds per step: the limits sum to under 7 minutes.
declare -A limit=([A]=140 [B]=120 [C]=75 [D]=45)
t_all=$(date +%s)
for (( i = 0; i < ${#steps}; i++ )); do
  key="${steps:$i:1}"
  t0=$(date +%s)
  timeout -k 10 "${limit[$key]}" "$PY" "$REPO/lab/gpu_check.py" --step "$key" --out "$out" $smoke \
    2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "gpu_check: step $key exit $rc after $(( $(date +%s) - t0 )) s$([[ $rc == 124 ]] && echo " (time limit ${limit[$key]} s)")" | tee -a "$log"
done
"$PY" "$REPO/lab/gpu_check.py" --report --steps "$steps" --out "$out" $smoke 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
rm -rf "$out/scratch"
echo "gpu_check: $(( $(date +%s) - t_all )) s in all" | tee -a "$log"
exit "$rc"
