#!/usr/bin/env bash
# Domain-shift benchmark (issue 4): a drafter trained offline on some Spec-Bench categories serves
# another; frozen vs ogd vs optimistic vs ensemble from the same start weights, on the same stream.
# Every prompt is served once, and measured before the learner has seen it.
#
#   benchmarks/domain_shift.sh [PATH/TO/question.jsonl] [OUT_DIR] [extra `vllm-onlinespec bench` flags]
#
# Train side: qa + translation (short factual answers, German -> English), with the demo's small
# recipe (32 prompts, 2 epochs, K = 4). Serve side: math_reasoning (GSM8K-style word problems),
# 40 prompts in waves of 4, 80 tokens, an 8 s pause per wave for the learner (not counted as
# serving time). `shadow` runs the learner without publishing: shadow vs frozen is the learner's
# cost to serving at the same weights. ~35 min on the 2-core CPU box.
# Output: OUT_DIR/report.{md,json}, acceptance*.png, throughput.png, checkpoints/<arm>/.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-$ROOT/../shared/data/spec_bench/question.jsonl}
OUT=${2:-$ROOT/runs/domain_shift}
shift $(( $# > 2 ? 2 : $# )) || true
exec "${CLI:-vllm-onlinespec}" bench --spec-bench "$SPEC_BENCH" \
  --train-categories qa,translation --serve-categories math_reasoning \
  --train-args "--max-prompts 32 --max-new-tokens 96 --epochs 2 --max-heldout 8 --block-size 5" \
  --arms nospec,frozen,shadow,online-ogd,online-optimistic,online-ensemble \
  --num-prompts 40 --wave 4 --max-tokens 80 --catch-up-s 8 --out "$OUT" "$@"
