#!/usr/bin/env bash
# Domain-shift benchmark (issue 14), continuous serving, everything counted: the shipped drafter
# (Spec-Bench without math_reasoning + HumanEval) serves
#   tune     40 math word problems, online-ogd at each lr of LRS + frozen: settings are chosen here
#   shifted  the OTHER 40 math word problems (never tuned on): the reported shifted domain
#   own      the drafter's held-out prompts of its own domain (no harm?)
#   aba      own half -> shifted -> other own half (forgetting: the return to A)
# Arms nospec, frozen, online-ogd, online-optimistic, online-ensemble, one engine at a time, all arms
# on the same stream in one run, SEEDS stream orders (aba: one file per order); 4 clients in a
# closed loop, the learner beside serving, no pauses, windows of 20 s (bench/engine_loop.py).
#
#   benchmarks/domain_shift.sh [SPEC_BENCH] [OUT] [SCENARIO ...]      (default: all four)
#   LR=1e-3 benchmarks/domain_shift.sh ... shifted own aba            (skip tuning, use this lr)
#   RECIPE='{...}' benchmarks/domain_shift.sh ...   onlinespec settings of every speculative arm,
#       frozen and learning alike (default: the budget verify policy + prompt lookup, the best
#       serving recipe measured on this CPU; '{}' = vLLM's drafts verified in full)
#
# Output: OUT/<scenario>/[seed-S/]report.{md,json} + windows; then
#   python benchmarks/domain_shift_report.py --run OUT --out docs/results
# ~12 min per scenario and seed on the 2-core CPU box (5 arms x 40 prompts x 96 tokens).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-$ROOT/../shared/data/spec_bench/question.jsonl}
OUT=${2:-$ROOT/runs/domain_shift}
shift $(( $# > 2 ? 2 : $# )) || true
SCENARIOS=${*:-tune shifted own aba}
CLI=${CLI:-vllm-onlinespec}
PY=${PY:-python}
SEEDS=${SEEDS:-0,1}
LRS=${LRS:-3e-4 1e-3 3e-3}
ARMS=${ARMS:-nospec,frozen,online-ogd,online-optimistic,online-ensemble}
RECIPE=${RECIPE:-'{"length_head": {"policy": "budget", "k_min": 0}, "prompt_lookup": {"enabled": true}}'}
DRAFTER=${DRAFTER:-$($CLI model drafter smollm2-135m)}
COMMON=(--drafter "$DRAFTER" --arrivals "${ARRIVALS:-closed:4}" --window-s 20
        --max-tokens "${MAX_TOKENS:-96}" --num-prompts 200)
mkdir -p "$OUT"
$PY "$ROOT/benchmarks/shift_streams.py" --spec-bench "$SPEC_BENCH" \
  --heldout "$DRAFTER/heldout_prompts.jsonl" --out "$OUT/streams" --seeds "$SEEDS"

# The recipe plus the lr (ensemble_lrs bracket it), as one --online JSON.
online() { $PY -c "import json, sys; r = json.loads(sys.argv[1]); lr = float(sys.argv[2]) if len(sys.argv) > 2 else None
if lr: r.update(lr=lr, ensemble_lrs=[x * lr for x in (0.3, 1, 3)])
print(json.dumps(r))" "$RECIPE" "$@"; }

for sc in $SCENARIOS; do
  case $sc in
    tune)
      for lr in $LRS; do
        "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/tune.jsonl" --arms online-ogd \
          --online "$(online "$lr")" --out "$OUT/tune/lr-$lr"
      done
      "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/tune.jsonl" --arms frozen \
        --online "$(online)" --out "$OUT/tune/frozen"
      ;;
    shifted|own)
      LR=${LR:-$($PY "$ROOT/benchmarks/domain_shift_report.py" --run "$OUT" --best-lr)}
      "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/$sc.jsonl" --arms "$ARMS" --seeds "$SEEDS" \
        --online "$(online "$LR")" --out "$OUT/$sc"
      ;;
    aba)
      LR=${LR:-$($PY "$ROOT/benchmarks/domain_shift_report.py" --run "$OUT" --best-lr)}
      for s in ${SEEDS//,/ }; do
        "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/aba-seed-$s.jsonl" --in-order --arms "$ARMS" \
          --online "$(online "$LR")" --out "$OUT/aba/seed-$s"
      done
      ;;
    *) echo "unknown scenario $sc (tune, shifted, own, aba)" >&2; exit 2 ;;
  esac
done
