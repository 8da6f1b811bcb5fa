#!/usr/bin/env bash
# Domain-shift benchmark, continuous serving, everything counted: the shipped drafter
# (Spec-Bench without math_reasoning + HumanEval) serves
#   tune     40 math word problems, online-ogd at each lr of LRS + frozen: settings are chosen here
#   tune-learn  the same stream, online-ogd with each of LEARN_VARIANTS (how the learner uses its
#            data: dense anchors, replay; domain_shift_report.py) at the tuned lr, + frozen
#   shifted  the OTHER 40 math word problems (never tuned on): the reported shifted domain
#   own      the drafter's held-out prompts of its own domain (no harm?)
#   aba      own half -> shifted -> other own half (forgetting: the return to A)
# Arms nospec, frozen, online-ogd, online-optimistic, online-ensemble, one engine at a time, all arms
# on the same stream in one run, SEEDS stream orders (aba: one file per order); 4 clients in a
# closed loop, the learner beside serving, no pauses, windows of 20 s (bench/engine_loop.py).
#
#   lab/domain_shift.sh [SPEC_BENCH] [OUT] [SCENARIO ...]      (default: all four)
#   LR=1e-3 lab/domain_shift.sh ... shifted own aba            (skip tuning, use this lr)
#   LEARN=dense+replay ...      the learn variant of the reported scenarios (default: the one
#                               tune-learn chose; "defaults" (the bench's online settings) when it did not run)
#   RECIPE='{...}' lab/domain_shift.sh ...   onlinespec settings of every speculative arm,
#       frozen and learning alike (default: the budget verify policy + prompt lookup, the best
#       serving recipe measured on this CPU; '{}' = vLLM's drafts verified in full)
#
# Output: OUT/<scenario>/[seed-S/]report.{md,json} + windows; then
#   python lab/domain_shift_report.py --run OUT --out docs/results
# ~12 min per scenario and seed on the 2-core CPU box (5 arms x 40 prompts x 96 tokens).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC_BENCH=${1:-${SPEC_BENCH:?set SPEC_BENCH to Spec-Bench question.jsonl}}
OUT=${2:-$ROOT/runs/domain_shift}
shift $(( $# > 2 ? 2 : $# )) || true
SCENARIOS=${*:-tune tune-learn shifted own aba}
CLI=${CLI:-vllm-onlinespec}
PY=${PY:-python}
SEEDS=${SEEDS:-0,1}
LRS=${LRS:-3e-4 1e-3 3e-3}
LEARN_VARIANTS=${LEARN_VARIANTS:-base dense replay dense+replay dense+replay@1e-3}
REPORT="$ROOT/lab/domain_shift_report.py"
ARMS=${ARMS:-nospec,frozen,online-ogd,online-optimistic,online-ensemble}
RECIPE=${RECIPE:-'{"length_head": {"policy": "budget", "k_min": 0}, "prompt_lookup": {"enabled": true}}'}
DRAFTER=${DRAFTER:-$($CLI model drafter smollm2-135m)}
COMMON=(--drafter "$DRAFTER" --arrivals "${ARRIVALS:-closed:4}" --window-s 20
        --max-tokens "${MAX_TOKENS:-96}" --num-prompts 200)
mkdir -p "$OUT"
$PY "$ROOT/lab/shift_streams.py" --spec-bench "$SPEC_BENCH" \
  --heldout "$DRAFTER/heldout_prompts.jsonl" --out "$OUT/streams" --seeds "$SEEDS"

# The recipe plus the lr and a learn variant's keys (its own update.lr wins; update.ensemble_lrs
# bracket the final lr), as one --online JSON:  online [LR [VARIANT_NAME]]
online() { $PY -c "import json, sys; r = json.loads(sys.argv[1]); a = sys.argv[2:]
def merge(base, over):  # sections merge key by key: a variant's length_head keeps the recipe's policy
    for k, v in over.items():
        base[k] = merge(dict(base[k]), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base
if a: r = merge(r, {'update': {'lr': float(a[0])}})
if len(a) > 1: r = merge(r, json.loads(a[1]))
u = r.get('update', {})
if 'lr' in u: u['ensemble_lrs'] = [x * u['lr'] for x in (0.3, 1, 3)]
print(json.dumps(r))" "$RECIPE" "${@:1:1}" ${2:+"$($PY "$REPORT" --run "$OUT" --learn-json "$2")"}; }
tuned_lr() { echo "${LR:-$($PY "$REPORT" --run "$OUT" --best-lr)}"; }
tuned_learn() { echo "${LEARN:-$($PY "$REPORT" --run "$OUT" --best-learn 2>/dev/null || echo defaults)}"; }

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
    tune-learn)
      lr=$(tuned_lr)
      for v in $LEARN_VARIANTS; do
        "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/tune.jsonl" --arms online-ogd \
          --online "$(online "$lr" "$v")" --out "$OUT/tune/learn-$v"
      done
      [ -f "$OUT/tune/frozen/report.json" ] || "$CLI" bench "${COMMON[@]}" \
        --prompts "$OUT/streams/tune.jsonl" --arms frozen --online "$(online)" --out "$OUT/tune/frozen"
      ;;
    shifted|own)
      "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/$sc.jsonl" --arms "$ARMS" --seeds "$SEEDS" \
        --online "$(online "$(tuned_lr)" "$(tuned_learn)")" --out "$OUT/$sc"
      ;;
    aba)
      for s in ${SEEDS//,/ }; do
        "$CLI" bench "${COMMON[@]}" --prompts "$OUT/streams/aba-seed-$s.jsonl" --in-order --arms "$ARMS" \
          --online "$(online "$(tuned_lr)" "$(tuned_learn)")" --out "$OUT/aba/seed-$s"
      done
      ;;
    *) echo "unknown scenario $sc (tune, tune-learn, shifted, own, aba)" >&2; exit 2 ;;
  esac
done
