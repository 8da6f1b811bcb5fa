"""Served acceptance and speed of DFlash drafters against no speculation, in vLLM (bf16).

    python lab/drafter_served.py --prompts RUN/heldout_prompts.jsonl \
        --arm nospec --arm dflash:DRAFTER_DIR:4 [--arm dflash:OTHER:7 ...] \
        [--arm recipe:DRAFTER_DIR:4] [--arm recipe-tree:DRAFTER_DIR:4] [--arm ngram:4] \
        [--arm suffix:16] [--arm recipe-tree-unpriced:DRAFTER_DIR:16] \
        [--arm recipe-tree-conf:DRAFTER_DIR:16] \
        --batch1 12 --batch8 32 --max-tokens 128 --out runs/drafter/served.json

`dflash` arms are vLLM's own DFlash worker; `frozen-fixed` this project's worker with learning
off, fixed K and no lookup (against `dflash`: the plugin's own price); `recipe` arms serve the drafter through this
project's worker with learning off and the CPU serving recipe (budget + prompt lookup);
`recipe-tree` the same with SuffixDecoding's trees as the lookup source (the `cpu` preset's
serving half); `recipe-tree-unpriced` that with the tree's drafts verified whole (no pricing,
as vLLM's suffix decoding does) and `recipe-tree-conf` with the budget's acceptance from the
drafter's top-1 probability (`length_head.estimator: confidence`) instead of the length head;
`ngram` and `suffix` are vLLM's training-free methods. This project's arms also report the
worker's stats at the end (the acceptance estimate's and the population estimate's squared
error on exact labels, tree tokens left unverified, gate shut steps). Every arm is one engine in its own
subprocess (one engine at a time on the CPU box; a fresh process per engine keeps timings
independent). Each engine serves the held-out prompts twice:
one at a time (batch 1: `--batch1` prompts, one request per `llm.chat` call) and in waves of 8
concurrent requests (`--batch8` prompts). Acceptance is read from vLLM's own spec-decode
counters (accepted + drafts) / drafts, the same figure as vLLM's "mean acceptance length".
Spreads: batch 1 per request, batch 8 per wave (min / median / max tok/s).

Wrap the whole command in `flock /tmp/onlinespec-engine.lock` on the shared CPU box. Intel
OpenMP is preloaded for the engine processes when the venv has it (`--no-iomp` to skip):
design.md section 9 measured +22 % on the speculative path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_onlinespec.presets import SERVING_CPU

# This project's worker with learning off and the `cpu` preset's serving half (budget verify
# policy: it may verify nothing where a draft does not pay), with vLLM's ngram rule as lookup
# source (`recipe`) or the preset's suffix tree (`recipe-tree`).
RECIPE_TREE = {"enabled": False, **SERVING_CPU}
SERVING_RECIPE = {**RECIPE_TREE, "prompt_lookup": {"enabled": True, "source": "ngram"}}
# The worker with nothing to do but serve vLLM's DFlash drafter: learning off, fixed K, no
# lookup. Against `dflash` (vLLM's own worker, same drafter and K) it prices the plugin.
FROZEN_FIXED = {"enabled": False, "length_head": {"policy": "fixed"}}
RECIPE_TREE_UNPRICED = {**RECIPE_TREE, "length_head": {**RECIPE_TREE["length_head"],
                                                       "price_lookup": False}}
RECIPE_TREE_CONF = {**RECIPE_TREE, "length_head": {**RECIPE_TREE["length_head"],
                                                   "estimator": "confidence"}}
OURS = {"frozen-fixed": FROZEN_FIXED, "recipe": SERVING_RECIPE, "recipe-tree": RECIPE_TREE,
        "recipe-tree-unpriced": RECIPE_TREE_UNPRICED, "recipe-tree-conf": RECIPE_TREE_CONF}
COUNTERS = {"accepted": "vllm:spec_decode_num_accepted_tokens",
            "drafts": "vllm:spec_decode_num_drafts"}


@dataclass
class Phase:
    batch: int
    prompts: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    accepted: int = 0
    drafts: int = 0
    tok_s_each: list[float] = field(default_factory=list)  # per request (b1) / per wave (b8)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def acceptance_length(self) -> float | None:
        return (self.accepted + self.drafts) / self.drafts if self.drafts else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["tok_s"] = round(self.tok_s, 2)
        d["acceptance_length"] = self.acceptance_length
        d["tok_s_min_med_max"] = ([round(min(self.tok_s_each), 2),
                                   round(statistics.median(self.tok_s_each), 2),
                                   round(max(self.tok_s_each), 2)] if self.tok_s_each else None)
        return d


@dataclass
class ArmConf:
    name: str
    method: str  # none | dflash | ngram
    drafter: str | None = None
    k: int = 0

    @classmethod
    def parse(cls, spec: str) -> "ArmConf":
        parts = spec.split(":")
        if parts[0] == "nospec" and len(parts) == 1:
            return cls(name="nospec", method="none")
        if parts[0] == "ngram" and len(parts) == 2:
            return cls(name=f"ngram-k{parts[1]}", method="ngram", k=int(parts[1]))
        if parts[0] == "suffix" and len(parts) == 2:
            return cls(name=f"suffix-k{parts[1]}", method="suffix", k=int(parts[1]))
        if (parts[0] == "dflash" or parts[0] in OURS) and len(parts) == 3:
            d = Path(parts[1])
            if not (d / "config.json").is_file():
                raise SystemExit(f"--arm {spec}: {d} has no config.json")
            return cls(name=f"{parts[0]}-k{parts[2]}:{d.name}", method=parts[0], drafter=str(d),
                       k=int(parts[2]))
        raise SystemExit(f"--arm {spec!r}: expected nospec, ngram:K, suffix:K, dflash:DIR:K or "
                         f"one of {', '.join(OURS)} as NAME:DIR:K")


def _counters(llm) -> dict[str, int]:
    found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return {k: int(found.get(n, 0)) for k, n in COUNTERS.items()}


def run_engine(arm: ArmConf, prompts: list[dict], n1: int, n8: int, max_tokens: int,
               target: str) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs

    kw = engine_kwargs()
    if arm.method == "dflash" or arm.method in OURS:
        kw["speculative_config"] = {"method": "dflash", "model": arm.drafter,
                                    "num_speculative_tokens": arm.k}
    if arm.method in OURS:  # frozen-fixed against dflash: the plugin's own price
        kw["additional_config"] = {"onlinespec": OURS[arm.method]}
    elif arm.method == "suffix":
        kw["speculative_config"] = {"method": "suffix", "num_speculative_tokens": arm.k}
    elif arm.method == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": arm.k,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    t0 = time.perf_counter()
    llm = LLM(model=target, dtype="bfloat16", disable_log_stats=False, **kw)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat([prompts[0]["messages"]], SamplingParams(temperature=0.0, max_tokens=8),
             use_tqdm=False)  # warm-up: first-call allocations out of the timings
    phases = []
    for batch, n in ((1, n1), (8, n8)):
        ph = Phase(batch=batch)
        sel = prompts[:n]
        c0 = _counters(llm)
        for s in range(0, len(sel), batch):
            wave = sel[s:s + batch]
            t = time.perf_counter()
            outs = llm.chat([p["messages"] for p in wave], params, use_tqdm=False)
            dt = time.perf_counter() - t
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            ph.prompts += len(wave)
            ph.output_tokens += toks
            ph.wall_s += dt
            ph.tok_s_each.append(toks / dt)
        c1 = _counters(llm)
        ph.accepted, ph.drafts = c1["accepted"] - c0["accepted"], c1["drafts"] - c0["drafts"]
        phases.append(ph.to_json())
    worker = None
    if arm.method in OURS:
        from vllm_onlinespec.serving.stats import fetch

        st = fetch(llm)
        c = st.cutter
        worker = {"estimator_mse": c.estimator_mse, "estimator_labels": c.estimator_labels,
                  "estimator_population_mse": c.estimator_population_mse,
                  "head_mse": c.head_mse, "head_labels": c.head_labels,
                  "head_population_mse": c.head_population_mse, "head": c.head,
                  "gate_steps": c.gate_steps, "gate_shut_steps": c.gate_shut_steps,
                  "lookup_drafted": st.lookup_drafted, "lookup_accepted": st.lookup_accepted,
                  "lookup_priced_cut": st.lookup_priced_cut,
                  "lookup_calibration": st.lookup_calibration, "hook_errors": st.hook_errors}
    llm.llm_engine.engine_core.shutdown()
    return {"arm": asdict(arm), "startup_s": round(startup, 1), "phases": phases,
            "worker": worker}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="jsonl of {'messages': [...]} rows")
    ap.add_argument("--arm", action="append", required=True,
                    help="nospec | ngram:K | dflash:DIR:K (repeatable)")
    ap.add_argument("--batch1", type=int, default=12, help="prompts served one at a time")
    ap.add_argument("--batch8", type=int, default=32, help="prompts served 8 at a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", required=True, help="result JSON (one entry per arm, appended)")
    ap.add_argument("--no-iomp", action="store_true")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args()

    from vllm_onlinespec.models import resolve

    target = resolve(args.target)
    rows = [json.loads(x) for x in open(args.prompts, encoding="utf-8") if x.strip()]
    if not rows or any("messages" not in r for r in rows):
        raise SystemExit(f"{args.prompts}: needs jsonl rows with 'messages'")
    if args._child:
        res = run_engine(ArmConf(**json.loads(args._child)), rows, args.batch1, args.batch8,
                         args.max_tokens, target)
        print("@@result " + json.dumps(res), flush=True)
        return 0
    arms = [ArmConf.parse(a) for a in args.arm]
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else []
    env = dict(os.environ)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not args.no_iomp and iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for arm in arms:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--_child", json.dumps(asdict(arm))]
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("@@result ")]
        if proc.returncode or not line:
            print(f"{arm.name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            return 1
        res = json.loads(line[-1][len("@@result "):])
        res.update(prompts_file=args.prompts, max_tokens=args.max_tokens,
                   iomp="LD_PRELOAD" in env, wall_s=round(time.perf_counter() - t, 1))
        results.append(res)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        b1, b8 = res["phases"]
        print(f"{arm.name}: b1 {b1['tok_s']:.1f} tok/s (accept {b1['acceptance_length']}), "
              f"b8 {b8['tok_s']:.1f} tok/s (accept {b8['acceptance_length']}) "
              f"[{res['wall_s']:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
