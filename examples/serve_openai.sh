#!/usr/bin/env bash
# `vllm serve` SmolLM2-135M with a DFlash drafter that learns online, then the OpenAI client.
#
#   examples/serve_openai.sh            # start the server, run openai_client.py, stop the server
#   KEEP=1 examples/serve_openai.sh     # ... and keep serving until Ctrl-C
#
# Env: DRAFTER (default: the shipped drafter), PORT (8000),
# MAX_TOKENS (client answer length, 128). Run from the repo root with the venv active.
set -euo pipefail
cd "$(dirname "$0")"
PORT=${PORT:-8000}
MAX_TOKENS=${MAX_TOKENS:-128}
LOG=${LOG:-/tmp/vllm-onlinespec-serve-$PORT.log}
source _server.sh
# --worker-cls vllm_onlinespec.SpecDecodeWorker says explicitly what "onlinespec" implies.
# The recommended CPU configuration (vllm_onlinespec/presets.py); any key given beside it wins.
start_server '{"onlinespec": {"preset": "cpu"}}' \
  --worker-cls vllm_onlinespec.SpecDecodeWorker
python openai_client.py --base-url "http://127.0.0.1:$PORT" --max-tokens "$MAX_TOKENS"
if [ -n "${KEEP:-}" ] && [ -n "${SERVER:-}" ]; then
  echo "serving on http://127.0.0.1:$PORT/v1 (Ctrl-C to stop)"
  wait $SERVER
fi
