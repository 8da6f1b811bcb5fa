#!/usr/bin/env bash
# Concurrency benchmark (issue 5): `vllm serve` (SmolLM2 + the trained default drafter, online
# learning on) driven by `vllm bench serve --dataset-name spec_bench` at several concurrencies,
# for nospec and the three verify-length policies.
#
#   benchmarks/concurrency.sh [PATH/TO/question.jsonl] [OUT_DIR] [extra `vllm-onlinespec bench-serve` flags]
#
# Needs the default drafter (`vllm-onlinespec train --recipe smollm2-default`) or --drafter DIR.
# Output: OUT_DIR/concurrency.{md,json,png}, raw `vllm bench serve` results in OUT_DIR/raw/.
# On the 2-core CPU box the default sweep (C = 1,4,16,32; max(8, 2C) prompts per point, 128
# tokens) takes roughly 15-25 min per arm.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-$ROOT/../shared/data/spec_bench/question.jsonl}
OUT=${2:-$ROOT/runs/concurrency}
shift $(( $# > 2 ? 2 : $# )) || true
exec "${CLI:-vllm-onlinespec}" bench-serve --spec-bench "$SPEC_BENCH" \
  --arms nospec,fixed,adaflash,budget --concurrency 1,4,16,32 --output-len 128 \
  --out "$OUT" "$@"
