#!/usr/bin/env bash
# Verification budget under load: `vllm serve` (SmolLM2-135M bf16 + the shipped
# drafter, K = 4, learning off) driven by `vllm bench serve --dataset-name spec_bench` at
# C = 1, 4, 16, 32, 64, three timing repeats over the same prompts (vLLM's spec_bench loader
# takes the same max(8, C) prompts every time), one server per arm:
#   nospec        plain decoding
#   vllm-dflash   vLLM's own DFlash worker, fixed K = 4
#   vllm-dynamic  the same with vLLM's num_speculative_tokens_per_batch_size (K_TABLE below,
#                 chosen by hand on prompts this sweep does not serve: docs/results/concurrency.md)
#   frozen-adaflash, frozen-budget   this project's worker, those verify-length policies
#
#   lab/concurrency.sh [PATH/TO/question.jsonl] [OUT_DIR] [extra `vllm-onlinespec bench-serve` flags]
#
# Output: OUT_DIR/concurrency.{md,json,png}, raw `vllm bench serve` results in OUT_DIR/raw/.
# About 50 min on the 2-core CPU box. Run it alone: a second engine corrupts the timings.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-${SPEC_BENCH:?set SPEC_BENCH to Spec-Bench question.jsonl}}
OUT=${2:-$ROOT/runs/concurrency}
shift $(( $# > 2 ? 2 : $# )) || true
K_TABLE=${K_TABLE:-'[[1,4,1],[5,1024,0]]'}
exec "${CLI:-vllm-onlinespec}" bench-serve --spec-bench "$SPEC_BENCH" \
  --drafter "$ROOT/vllm_onlinespec/drafters/smollm2-135m" \
  --arms nospec,vllm-dflash,vllm-dynamic,frozen-adaflash,frozen-budget \
  --k-per-batch-size "$K_TABLE" --concurrency 1,4,16,32,64 --repeats 3 \
  --output-len 64 --prompts-per-c 1 --out "$OUT" "$@"
