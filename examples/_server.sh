# Sourced by the shell examples: SmolLM2 + a DFlash drafter under `vllm serve`, in the background.
#   start_server ADDITIONAL_CONFIG_JSON [extra `vllm serve` flags]
# Env: PORT, DRAFTER (default: the shipped drafter, see _drafter.py), K, LOG. Sets TARGET, DRAFTER, SERVER (pid); stops
# the server on exit (SIGINT, so the learner writes its final checkpoint).
# A vLLM server already healthy on PORT is used as it is (started and stopped by whoever started
# it), so several examples can share one: `source _server.sh; start_server ...; ./serve_openai.sh`.
start_server() {
  TARGET=$(vllm-onlinespec model path smollm2-135m)
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    echo "using the vllm server already on port $PORT (not started here; its own flags stand)"
    return 0
  fi
  vllm-onlinespec model pull smollm2-135m >/dev/null
  DRAFTER=${DRAFTER:-$(python _drafter.py)}
  local k engine_args
  # vLLM's K for the cpu preset: the suffix tree drafts up to 16 tokens, the drafter its own block.
  k=${K:-$(python _drafter.py --k)}
  # Same CPU defaults as the library's engine_kwargs(): eager mode, explicit 1 GiB KV cache.
  engine_args=$(python -c "from vllm_onlinespec.engine import serve_args; print(' '.join(serve_args()))")
  # bfloat16 where the hardware computes it (GPU, AVX512-BF16/AMX), else float32 (DTYPE overrides).
  local dtype=${DTYPE:-$(python -c "from vllm_onlinespec.serving_dtype import resolve_dtype; print(resolve_dtype('auto'))")}
  # "onlinespec" in --additional-config selects vllm_onlinespec's worker (the plugin does it).
  vllm serve "$TARGET" --host 127.0.0.1 --port "$PORT" --dtype "$dtype" --served-model-name smollm2 \
    --speculative-config "{\"method\": \"dflash\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": $k}" \
    --additional-config "$1" "${@:2}" $engine_args >"$LOG" 2>&1 &
  SERVER=$!
  trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  echo "vllm serve (pid $SERVER) starting, log: $LOG"
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 $SERVER 2>/dev/null || { tail -30 "$LOG"; exit 1; }
    sleep 1
  done
  echo "server not healthy after 300 s; log: $LOG"
  exit 1
}
