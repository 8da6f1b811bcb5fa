#!/usr/bin/env bash
# Domain-shift benchmark (issue 4): a drafter trained offline on some Spec-Bench categories serves
# others; frozen vs ogd vs optimistic vs ensemble from the same start weights, on the same stream.
#
#   benchmarks/domain_shift.sh [PATH/TO/question.jsonl] [OUT_DIR] [extra `vllm-onlinespec bench` flags]
#
# Train side: qa + math_reasoning (short factual and arithmetic answers); serve side: translation,
# writing, roleplay, stem, humanities, reasoning, extraction (prose in other registers and a
# language shift). Output: OUT_DIR/report.{md,json}, acceptance*.png, throughput.png.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-$ROOT/../shared/data/spec_bench/question.jsonl}
OUT=${2:-$ROOT/runs/domain_shift}
shift $(( $# > 2 ? 2 : $# )) || true
exec "${CLI:-vllm-onlinespec}" bench --spec-bench "$SPEC_BENCH" \
  --train-categories qa,math_reasoning \
  --serve-categories translation,writing,roleplay,stem,humanities,reasoning,extraction \
  --arms frozen,online-ogd,online-optimistic,online-ensemble \
  --num-prompts 96 --wave 4 --max-tokens 128 --out "$OUT" "$@"
