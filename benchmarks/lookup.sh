#!/usr/bin/env bash
# Prompt lookup beside the DFlash drafter, served (config `prompt_lookup`): what it adds to the
# frozen shipped drafter, alone and with the budget verify policy, against plain decoding and
# vLLM's own ngram drafter. Continuous serving as in the demo (4 closed-loop clients, bf16,
# nothing left out of the wall time), every arm on the same stream in one run, one engine at a
# time, SEEDS stream orders (median and min-max over them).
#
#   benchmarks/lookup.sh [PROMPTS] [OUT]
#
# PROMPTS defaults to the shipped drafter's held-out prompts of its own domain (Spec-Bench
# without math_reasoning + HumanEval, never trained on): the recipe (budget + lookup) was chosen
# on 24 math word problems, so it is reported on a stream it was not chosen on.
# Output: OUT/report.{md,json} (over seeds) and OUT/seed-S/; then docs/results/lookup.{md,json}.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CLI=${CLI:-vllm-onlinespec}
PY=${PY:-python}
DRAFTER=${DRAFTER:-$($CLI model drafter smollm2-135m)}
PROMPTS=${1:-$DRAFTER/heldout_prompts.jsonl}
OUT=${2:-$ROOT/runs/lookup}
SEEDS=${SEEDS:-0,1}
ARMS=${ARMS:-nospec,ngram,frozen,frozen+lookup,frozen-budget+lookup}
CMD=("$CLI" bench --drafter "$DRAFTER" --prompts "$PROMPTS" --arms "$ARMS" --seeds "$SEEDS"
     --arrivals closed:4 --window-s 20 --max-tokens "${MAX_TOKENS:-96}" --num-prompts 200
     --out "$OUT")
echo "${CMD[*]}"
"${CMD[@]}"
$PY - "$OUT" "$ROOT/docs/results" "${CMD[*]}" <<'EOF'
import json, sys, time
from pathlib import Path

out, dest, cmd = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rep = json.loads((out / "report.json").read_text())
rep["command"] = cmd
rep["date"] = time.strftime("%Y-%m-%d")
(dest / "lookup.json").write_text(json.dumps(rep, indent=1))
md = (f"# Prompt lookup beside the DFlash drafter, served ({rep['date']})\n\n"
      "`benchmarks/lookup.sh`: the shipped drafter frozen, bf16, 4 closed-loop clients, 96 "
      "tokens, every arm on the same stream, one engine at a time; median (min-max) over stream "
      "orders. `+lookup`: config `prompt_lookup` (drafter/prompt_lookup.py); `frozen-budget`: "
      "the budget verify policy with its step gate (k_min 0). Accept len is vLLM's mean "
      "acceptance length over drafted steps.\n\n```bash\n" + cmd + "\n```\n\n"
      + (out / "report.md").read_text().split("\n", 1)[1])
(dest / "lookup.md").write_text(md)
print(f"wrote {dest / 'lookup.md'} and {dest / 'lookup.json'}")
EOF
