#!/usr/bin/env bash
# Online learning under a target shift, continuous serving, everything counted. The drafter
# shipped for the base model (SmolLM2-135M-Instruct) serves:
#   finetuned   64 Spec-Bench math word problems to smollm2-135m-terse (the base fine-tuned to
#               answer in terse numbered steps): the gap online learning exists for
#   swap        the same 64 prompts, the base target until request 32, then its weights replaced
#               in place by smollm2-135m-terse's (`bench --swap-to`: as an RL loop does; every
#               arm faces it, vLLM's own arms through vLLM's reload)
#   in_domain   the drafter's own held-out prompts (43, never trained on) on the base target:
#               what learning costs where there is little to learn
#   cold_start  the same 64 math word problems on the base target from a cold drafter
#               (lab/cold_drafter.py: untrained weights): the floor, and whether
#               learning from traffic alone gets speculation to pay
# Arms: nospec, vLLM's ngram and suffix decoding (the training-free peers), frozen and
# online-ogd (this project's worker, the `cpu` preset, learning off / on); cold_start: nospec,
# frozen, online-ogd. Every arm on the same stream in one run, two stream orders with the arms
# reversed on the second; 4 clients in a closed loop, windows of 20 s (bench/engine_loop.py).
# The learner's settings are the preset's (chosen on the domain-shift tuning stream, never on
# these streams).
#
#   lab/target_shift.sh [SPEC_BENCH] [OUT] [SCENARIO ...]      (default: all four)
#
# Output: OUT/<scenario>/[seed-S/]report.{md,json}, then OUT/target_shift.{md,json,png}
# (lab/target_shift_report.py; REPORT_OUT=docs/results writes the page there).
# ~12 min per scenario on the 2-core CPU box (in_domain ~9, cold_start ~8).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-${SPEC_BENCH:?set SPEC_BENCH to Spec-Bench question.jsonl}}
OUT=${2:-$ROOT/runs/target_shift}
shift $(( $# > 2 ? 2 : $# )) || true
SCENARIOS=${*:-finetuned swap in_domain cold_start}
CLI=${CLI:-vllm-onlinespec}
PY=${PY:-python}
DRAFTER=${DRAFTER:-$($CLI model drafter smollm2-135m)}
PEERS=nospec,ngram,vllm-suffix,frozen,online-ogd
COMMON=(--arrivals closed:4 --window-s 20 --max-tokens 96 --seeds 0,1 --preset cpu)
MATH=(--spec-bench "$SPEC_BENCH" --serve-categories math_reasoning --num-prompts 64)
mkdir -p "$OUT"
for sc in $SCENARIOS; do
  case $sc in
    finetuned)
      $CLI bench --target smollm2-135m-terse --drafter "$DRAFTER" "${MATH[@]}" --arms "$PEERS" \
        "${COMMON[@]}" --out "$OUT/finetuned" ;;
    swap)
      $CLI bench --target smollm2-135m --swap-to smollm2-135m-terse --swap-at 33 \
        --drafter "$DRAFTER" "${MATH[@]}" --arms "$PEERS" "${COMMON[@]}" --out "$OUT/swap" ;;
    in_domain)
      $CLI bench --target smollm2-135m --drafter "$DRAFTER" \
        --prompts "$DRAFTER/heldout_prompts.jsonl" --num-prompts 64 --arms "$PEERS" \
        "${COMMON[@]}" --out "$OUT/in_domain" ;;
    cold_start)
      $PY "$ROOT/lab/cold_drafter.py" --like "$DRAFTER" --out "$OUT/cold_drafter" --seed 0
      $CLI bench --target smollm2-135m --drafter "$OUT/cold_drafter" "${MATH[@]}" \
        --arms nospec,frozen,online-ogd "${COMMON[@]}" --out "$OUT/cold_start" ;;
    *) echo "unknown scenario $sc (finetuned, swap, in_domain, cold_start)" >&2; exit 2 ;;
  esac
done
$PY "$ROOT/lab/target_shift_report.py" --run "$OUT" --out "${REPORT_OUT:-$OUT}"
