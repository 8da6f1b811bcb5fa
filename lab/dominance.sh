#!/usr/bin/env bash
# Does the `cpu` preset ever lose to its own parts? Every point (BATCH:TEMPERATURE) is one
# `vllm-onlinespec bench` over two stream orders (arm order reversed on the second), every arm a
# fresh engine on the same prompts; then lab/dominance_report.py rolls the points up into
# OUT/dominance.{md,json}.
#
#   lab/dominance.sh [PATH/TO/question.jsonl] [OUT_DIR]
#   POINTS="1:0 8:0 8:1 32:0 1:1" ARMS=... SEEDS=0,1 lab/dominance.sh ...
#
# Resumable: the runs live in OUT_DIR (default outside the work tree, in the cache) and every
# bench runs with --resume, so the same command after a stop keeps each finished stream order
# and serves the first unfinished one again, whole. A new machine starts from nothing.
# About 2-3 min per arm and order at batch 1, 1.5-2 at batch 8 on a 2-core box in float32;
# ~1 min at batch 1, 8 or 32 in bf16 on a Xeon with AMX (the five default-arm points: 58 min).
# Run it alone: a second engine corrupts the timings.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-${SPEC_BENCH:-$ROOT/../shared/data/spec_bench/question.jsonl}}
CLI=${CLI:-vllm-onlinespec}
PY=${PY:-python}
# auto -> what the engines will serve here (bfloat16 on AVX512-BF16 / AMX, else float32)
DTYPE=$("$PY" -c "from vllm_onlinespec.serving_dtype import resolve_dtype as r; print(r('${DTYPE:-auto}'))")
OUT=${2:-${VLLM_ONLINESPEC_CACHE:-$HOME/.cache/vllm-onlinespec}/runs/dominance-$DTYPE}
POINTS=${POINTS:-"1:0 8:0 8:1"}
ARMS=${ARMS:-nospec,ngram,vllm-suffix,vllm-dflash,frozen,online-ogd,k0}
SEEDS=${SEEDS:-0,1}
MAX_TOKENS=${MAX_TOKENS:-96}
DRAFTER="$ROOT/vllm_onlinespec/drafters/smollm2-135m"
runs=()
for point in $POINTS; do
  batch=${point%%:*}; temp=${point#*:}
  n=$(( batch * 2 > 6 ? batch * 2 : 6 ))  # two waves at batch >= 3; 6 prompts at batch 1
  dir="$OUT/b$batch-t$temp"
  "$CLI" bench --spec-bench "$SPEC_BENCH" --serve-categories math_reasoning \
    --drafter "$DRAFTER" --arms "$ARMS" --wave "$batch" --num-prompts "$n" \
    --max-tokens "$MAX_TOKENS" --temperature "$temp" --seeds "$SEEDS" --dtype "$DTYPE" \
    --out "$dir" --resume || echo "point $point: an arm failed (its report says which; rerun to serve that order again)"
  runs+=(--run "$batch:$temp:$dir")
done
"$PY" "$ROOT/lab/dominance_report.py" "${runs[@]}" --out-dir "$OUT" \
  --box "$("$PY" -c "import sys; sys.path.insert(0, '$ROOT/lab'); from machine import box; print(box())"), $DTYPE" \
  --command "lab/dominance.sh (POINTS=\"$POINTS\" ARMS=$ARMS SEEDS=$SEEDS MAX_TOKENS=$MAX_TOKENS DTYPE=$DTYPE)"
