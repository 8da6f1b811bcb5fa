#!/usr/bin/env bash
# Concurrency benchmark (issue 5): `vllm serve` (SmolLM2 + the trained default drafter, online
# learning on) driven by `vllm bench serve --dataset-name spec_bench` at several concurrencies,
# for nospec and the three verify-length policies.
#
#   benchmarks/concurrency.sh [PATH/TO/question.jsonl] [OUT_DIR] [extra `vllm-onlinespec bench-serve` flags]
#
# Needs the default drafter (`vllm-onlinespec train --recipe smollm2-default`) or --drafter DIR.
# Output: OUT_DIR/concurrency.{md,json,png}, raw `vllm bench serve` results in OUT_DIR/raw/.
# On the 2-core CPU box this sweep (C = 1,4,16,32; max(8, C) prompts per point, 96
# tokens) takes about 5 min per arm, ~20 min in all.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-$ROOT/../shared/data/spec_bench/question.jsonl}
OUT=${2:-$ROOT/runs/concurrency}
shift $(( $# > 2 ? 2 : $# )) || true
exec "${CLI:-vllm-onlinespec}" bench-serve --spec-bench "$SPEC_BENCH" \
  --arms nospec,fixed,adaflash,budget --concurrency 1,4,16,32 --output-len 96 --prompts-per-c 1 \
  --out "$OUT" "$@"
