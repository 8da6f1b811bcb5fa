#!/usr/bin/env bash
# `vllm serve` SmolLM2-135M with a DFlash drafter that learns online, then the OpenAI client.
#
#   examples/serve_openai.sh            # start the server, run openai_client.py, stop the server
#   KEEP=1 examples/serve_openai.sh     # ... and keep serving until Ctrl-C
#
# Env: DRAFTER (default: the trained smollm2-default drafter, else a random one), PORT (8000),
# MAX_TOKENS (client answer length, 128). Run from the repo root with the venv active.
set -euo pipefail
cd "$(dirname "$0")"
PORT=${PORT:-8000}
MAX_TOKENS=${MAX_TOKENS:-128}
TARGET=$(vllm-onlinespec model path smollm2-135m)
vllm-onlinespec model pull smollm2-135m >/dev/null
DRAFTER=${DRAFTER:-$(python _drafter.py)}
K=$(DRAFTER_PATH="$DRAFTER" python -c "import os,_drafter; print(_drafter.num_speculative_tokens(os.environ['DRAFTER_PATH']))")
# Same CPU defaults as the library's engine_kwargs(): eager mode, explicit 1 GiB KV cache.
ENGINE_ARGS=$(python -c "from vllm_onlinespec.engine import serve_args; print(' '.join(serve_args()))")
LOG=${LOG:-/tmp/vllm-onlinespec-serve-$PORT.log}

# "onlinespec" in --additional-config selects vllm_onlinespec's worker (the plugin does it);
# --worker-cls vllm_onlinespec.SpecDecodeWorker says the same explicitly.
vllm serve "$TARGET" --host 127.0.0.1 --port "$PORT" --dtype float32 \
  --served-model-name smollm2 --worker-cls vllm_onlinespec.SpecDecodeWorker \
  --speculative-config "{\"method\": \"dflash\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": $K}" \
  --additional-config '{"onlinespec": {"lr": 3e-4, "batch_blocks": 16, "learner_cpu_share": 0.5, "length_head": {"policy": "fixed"}}}' \
  $ENGINE_ARGS >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "vllm serve (pid $SERVER) starting, log: $LOG"
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -30 "$LOG"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server not healthy"; exit 1; }
python openai_client.py --base-url "http://127.0.0.1:$PORT" --max-tokens "$MAX_TOKENS"
if [ -n "${KEEP:-}" ]; then
  echo "serving on http://127.0.0.1:$PORT/v1 (Ctrl-C to stop)"
  wait $SERVER
fi
