#!/usr/bin/env bash
# `vllm bench serve --dataset-name spec_bench` against a `vllm serve` that learns online.
#
#   examples/bench_serve_spec_bench.sh PATH/TO/question.jsonl [NUM_PROMPTS] [CONCURRENCY]
#
# Spec-Bench's question.jsonl: https://github.com/hemingkx/Spec-Bench (data/spec_bench/).
# Env: DRAFTER, PORT (8001), OUTPUT_LEN (128). Serves the recommended CPU configuration (the
# `cpu` preset: budget verify policy, suffix-tree lookup, K = 16).
# For the full concurrency sweep with a table and plot: `vllm-onlinespec bench-serve`.
set -euo pipefail
SPEC_BENCH=$(realpath "${1:?usage: $0 PATH/TO/question.jsonl [NUM_PROMPTS] [CONCURRENCY]}")
NUM_PROMPTS=${2:-16}
CONCURRENCY=${3:-4}
cd "$(dirname "$0")"
PORT=${PORT:-8001}
OUTPUT_LEN=${OUTPUT_LEN:-128}
LOG=${LOG:-/tmp/vllm-onlinespec-bench-$PORT.log}
source _server.sh
start_server '{"onlinespec": {"preset": "cpu"}}'
vllm bench serve --base-url "http://127.0.0.1:$PORT" --model smollm2 --tokenizer "$TARGET" \
  --dataset-name spec_bench --dataset-path "$SPEC_BENCH" --spec-bench-output-len "$OUTPUT_LEN" \
  --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" --temperature 0 --seed 0 \
  --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99
echo "--- online speculation metrics (/metrics) ---"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^(onlinespec:(drafter_version|learner_updates_total|verify_tokens_total|draft_tokens_total)|vllm:spec_decode_num_(accepted_tokens|drafts)_total)'
