"""This worker's own price at a fixed K: SpecDecodeWorker (learning off, the verify-length
policy `fixed`, no lookup) against vLLM's own DFlash worker, with the same shipped drafter, the
same K, the same prompts, greedy: the same drafting, so any difference in throughput is what
the worker adds to a step (the page checks the accepted and drafted counts are equal).

    flock /tmp/onlinespec-engine.lock .venv/bin/python lab/worker_price.py \
        --prompts ../shared/data/gsm8k/train.jsonl --batches 1,8 --runs 6 --out runs/worker_price --publish

Every run is one engine in a fresh process (vLLM's in-process engine core: both arms on torch's
libgomp; under `vllm serve` the worker's engines also load libiomp5, serving/openmp.py, which
this comparison leaves out on purpose). Runs alternate A B B A A B ..., so each arm meets the
box early and late; runs 2i and 2i + 1 form a pair. A run serves --rounds rounds of `batch`
distinct prompts of GSM8K's served-only slice (never trained on) at once, `ignore_eos`,
--max-tokens each; its throughput is its tokens over its wall time. For the worker, the step
profile (serving/step_profile.py) splits a step into the target forward, sampling, drafting and
the worker's own hooks. Writes OUT/worker_price.{json,md}; --publish copies them to
docs/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import box  # lab/machine.py

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"vllm-dflash": "vLLM's DFlash worker", "ours": "SpecDecodeWorker, fixed K, learning off"}
ROW = "WORKER_PRICE_ROW "


def run_order(runs: int) -> list[str]:
    """A B B A repeated: each arm first in half of the pairs."""
    a, b = list(ARMS)
    return ([a, b, b, a] * runs)[:runs]


def one_run(arm: str, batch: int, rounds: int, max_tokens: int, prompts: list[str],
            dtype: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's profile by collective_rpc
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.bench.arm_catalog import drafter_k
    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.models import pull, shipped_drafter

    drafter = str(shipped_drafter("smollm2-135m"))
    kw = engine_kwargs(max_model_len=2048)
    kw["speculative_config"] = {"method": "dflash", "model": drafter,
                                "num_speculative_tokens": drafter_k(drafter)}
    if arm == "ours":
        kw["additional_config"] = {"onlinespec": {
            "enabled": False, "length_head": {"policy": "fixed"}, "prompt_lookup": {"enabled": False}}}
    llm = LLM(model=str(pull("smollm2-135m")), dtype=dtype, disable_log_stats=False, **kw)

    def counters() -> tuple[float, float]:
        m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
        return (m.get("vllm:spec_decode_num_accepted_tokens", 0.0),
                m.get("vllm:spec_decode_num_drafts", 0.0))

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = wall = 0.0
    a0, d0 = counters()
    for r in range(rounds):
        convs = [[{"role": "user", "content": p}] for p in prompts[r * batch:(r + 1) * batch]]
        t = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        wall += time.perf_counter() - t
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    a1, d1 = counters()
    row = {"arm": arm, "batch": batch, "tokens": int(tokens), "wall_s": round(wall, 3),
           "tok_s": round(tokens / wall, 2), "accepted": int(a1 - a0), "drafts": int(d1 - d0)}
    if arm == "ours":
        prof = llm.collective_rpc("onlinespec_step_profile")[0]
        row["steps"] = prof["steps"]
        row["per_step_ms"] = {k: round(v, 3) for k, v in prof["per_step_ms"].items()}
    llm.llm_engine.engine_core.shutdown()
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per batch and arm: median (min-max) tok/s over runs; the worker's paired ratio against
    vLLM's (runs 2i and 2i + 1), median and range; its step profile's medians."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == batch]
        pairs = [mine[i:i + 2] for i in range(0, len(mine) - 1, 2)]
        ratios = [next(r for r in p if r["arm"] == "ours")["tok_s"]
                  / next(r for r in p if r["arm"] == "vllm-dflash")["tok_s"]
                  for p in pairs if {r["arm"] for r in p} == set(ARMS)]
        for arm in ARMS:
            runs = [r for r in mine if r["arm"] == arm]
            if not runs:
                continue
            tok = [r["tok_s"] for r in runs]
            s = {"arm": arm, "batch": batch, "label": ARMS[arm], "runs": len(runs),
                 "tok_s": round(statistics.median(tok), 1), "tok_s_min": min(tok),
                 "tok_s_max": max(tok),
                 "accepted_per_draft": round(sum(r["accepted"] for r in runs)
                                             / max(1, sum(r["drafts"] for r in runs)), 3)}
            if arm == "ours":
                s["vs_vllm_dflash"] = round(statistics.median(ratios), 3) if ratios else None
                s["spread"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
                s["per_step_ms"] = {k: round(statistics.median(r["per_step_ms"][k] for r in runs), 2)
                                    for k in runs[0]["per_step_ms"]}
            out.append(s)
    return out


def markdown(doc: dict) -> str:
    md = ["# This worker's own price at a fixed K, against vLLM's DFlash worker", "",
          f"- date: {doc['date']}; box: {doc['box']}",
          f"- command: `{doc['command']}` ({doc['wall_s']} s)",
          f"- greedy, {doc['max_tokens']} tokens a request (`ignore_eos`), {doc['dtype']}, "
          f"SmolLM2-135M-Instruct, the shipped drafter at its K ({doc.get('k', '?')}); {doc['rounds']} rounds of "
          "`batch` distinct GSM8K served-slice prompts a run; a fresh engine a run, runs "
          "ordered A B B A ...; ratio: the worker's tok/s over vLLM's within each pair of runs",
          "", "| batch | arm | runs | tok/s, median (min-max) | worker / vLLM, median (range) "
          "| accepted per draft | ms per step: target / sample / draft / worker hooks / other |",
          "|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        ratio = (f"{s['vs_vllm_dflash']:.3f}x ({s['spread'][0]:.3f}-{s['spread'][1]:.3f})"
                 if s.get("vs_vllm_dflash") else "-")
        prof = s.get("per_step_ms")
        ms = (" / ".join(f"{prof[k]:.2f}" for k in ("target", "sample", "draft", "ours", "other"))
              if prof else "-")
        md.append(f"| {s['batch']} | {s['arm']} | {s['runs']} | {s['tok_s']} ({s['tok_s_min']}-"
                  f"{s['tok_s_max']}) | {ratio} | {s['accepted_per_draft']} | {ms} |")
    md += ["", "## Reading", ""]
    for s in doc["summary"]:
        if s["arm"] != "ours" or not s.get("per_step_ms") or s.get("vs_vllm_dflash") is None:
            continue
        runs = [r for r in doc["rows"] if r["batch"] == s["batch"]]
        same = len({(r["accepted"], r["drafts"]) for r in runs}) == 1
        step = sum(s["per_step_ms"].values())
        lo, hi = s["spread"]
        reading = ("no difference the box can measure" if lo <= 1.0 <= hi
                   else "the worker faster in every pair" if lo > 1.0
                   else "the worker slower in every pair")
        md.append(f"- batch {s['batch']}: {'the same' if same else 'DIFFERENT'} accepted tokens "
                  f"and drafts in every run of both arms; the worker's own hooks "
                  f"{s['per_step_ms']['ours']:.2f} ms of a {step:.1f} ms step "
                  f"({100 * s['per_step_ms']['ours'] / step:.2f} %); throughput "
                  f"{s['vs_vllm_dflash']:.3f}x vLLM's within pairs ({lo:.3f}-{hi:.3f}): {reading}.")
    md += ["", "## Runs", "", "| batch | run | arm | tok/s | accepted / drafts |", "|---|---|---|---|---|"]
    for i, r in enumerate(doc["rows"]):
        md.append(f"| {r['batch']} | {i} | {r['arm']} | {r['tok_s']} | {r['accepted']} / {r['drafts']} |")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="GSM8K train.jsonl (its served-only slice)")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--runs", type=int, default=6, help="engines per batch size, arms alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--publish", action="store_true")
    ap.add_argument("--one", choices=list(ARMS), help=argparse.SUPPRESS)  # a run's own process
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from vllm_onlinespec.training.prompt_sets import gsm8k_served_slice

    batches = [int(b) for b in args.batches.split(",")]
    prompts = [r["prompt"] for r in gsm8k_served_slice(args.prompts)][:max(batches) * args.rounds]
    if args.one:
        row = one_run(args.one, args.batch, args.rounds, args.max_tokens, prompts, args.dtype)
        print(ROW + json.dumps(row), flush=True)
        return
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for batch in batches:
        for arm in run_order(args.runs):
            cmd = [sys.executable, __file__, "--one", arm, "--batch", str(batch), "--prompts",
                   args.prompts, "--batches", args.batches, "--rounds", str(args.rounds),
                   "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
            r = subprocess.run(cmd, capture_output=True, text=True)
            got = [ln[len(ROW):] for ln in r.stdout.splitlines() if ln.startswith(ROW)]
            if r.returncode != 0 or not got:
                raise SystemExit(f"worker_price: {arm} at batch {batch} failed (exit "
                                 f"{r.returncode}): {r.stderr[-2000:]}")
            rows.append(json.loads(got[0]))
            print(json.dumps(rows[-1]), flush=True)
    command = (f"python lab/worker_price.py --prompts $GSM8K_TRAIN --batches {args.batches} "
               f"--runs {args.runs} --rounds {args.rounds} --max-tokens {args.max_tokens} "
               f"--dtype {args.dtype} --out runs/{out.name}")
    from vllm_onlinespec.bench.arm_catalog import drafter_k
    from vllm_onlinespec.models import shipped_drafter

    doc = {"date": time.strftime("%Y-%m-%d"), "box": box(), "command": command,
           "k": drafter_k(shipped_drafter("smollm2-135m")),
           "wall_s": round(time.perf_counter() - t0), "batches": batches, "runs": args.runs,
           "rounds": args.rounds, "max_tokens": args.max_tokens, "dtype": args.dtype,
           "summary": summarise(rows), "rows": rows}
    (out / "worker_price.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "worker_price.md").write_text(markdown(doc))
    if args.publish:
        for ext in ("json", "md"):
            shutil.copy(out / f"worker_price.{ext}", ROOT / "docs/results")
    print(markdown(doc))


if __name__ == "__main__":
    main()
