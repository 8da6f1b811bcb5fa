"""What an unseeded sampled step costs this worker, by how it samples: vLLM's rejection
sampler as vLLM 0.32 ships it, the same with its recovery noise drawn only for requests with
drafts (serving/compat/recovery_noise.py), and the invariant sampler covering every sampled
request (`sampling.invariant: all`, what `auto` resolves to on one rank); plain vLLM beside it.

    flock /tmp/onlinespec-engine.lock .venv/bin/python lab/unseeded_sampling.py \
        --prompts ../shared/data/gsm8k/train.jsonl --out runs/unseeded --publish

Two engines, one at a time, in this process (vLLM's in-process engine core, so the worker's
settings can be switched between rounds): nospec, then this worker (the `cpu` preset, learning
off, the shipped drafter, K 16). Requests: the first --batch problems of GSM8K's served-only
slice (never trained on), temperature 1, top-p 1, no seed, `ignore_eos`, one `llm.chat`
call a round, at each of --batches (with --max-tokens each, paired by position). The worker's three modes run in rounds ordered A B C C B A, that
pattern --repeats times, so each mode meets the box early and late; nospec runs 2 x --repeats
rounds. Per round: output tok/s, the worker's sampler ms per engine step (serving/
step_profile.py), vLLM's acceptance length. Writes OUT/unseeded_sampling.{json,md}; --publish
copies them to docs/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from machine import box  # lab/machine.py

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # switch settings by callables
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

ROOT = Path(__file__).resolve().parents[1]
# mode -> (label, invariant mode, lean recovery noise)
MODES = {"vllm": ("rejection sampler, vLLM 0.32's noise", "seeded", False),
         "lean": ("rejection sampler, noise only where drafts", "seeded", True),
         "all": ("invariant sampler for every sampled request", "all", True)}


def set_mode(mode: str):
    _, invariant, lean = MODES[mode]

    def on_worker(worker) -> bool:
        from vllm.v1.sample import rejection_sampler as rs

        from vllm_onlinespec.serving.compat import recovery_noise as R
        import vllm_onlinespec.serving.compat as C

        runner = worker.model_runner
        runner._onlinespec_invariant.mode = invariant
        R.install()
        C.lean_recovery_noise = R.ours if lean else _off  # what the runner's _sample enters
        return rs.sample_recovered_tokens._onlinespec_vllm is not None

    return on_worker


def _off():
    from contextlib import nullcontext

    return nullcontext()


def profile(worker) -> dict:
    p = worker.model_runner.onlinespec_profile()
    return {"steps": p.steps, "sample_s": p.sample_s}


def counters(llm) -> tuple[float, float]:
    m = {x.name: x for x in llm.get_metrics()}
    get = lambda k: m[k].value if k in m else 0.0  # noqa: E731
    return get("vllm:spec_decode_num_accepted_tokens"), get("vllm:spec_decode_num_drafts")


def rounds_for(engine: str, repeats: int) -> list[str]:
    if engine == "nospec":
        return ["nospec"] * (2 * repeats)
    return (list(MODES) + list(MODES)[::-1]) * repeats


def run_engine(engine: str, args, prompts: list, points: list[tuple[int, int]]) -> list[dict]:
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.models import pull, shipped_drafter
    from vllm_onlinespec.presets import PRESET_K

    kw = engine_kwargs(max_model_len=2048)
    if engine == "ours":
        kw["speculative_config"] = {"method": "dflash", "num_speculative_tokens": PRESET_K["cpu"],
                                    "model": str(shipped_drafter("smollm2-135m"))}
        kw["additional_config"] = {"onlinespec": {"preset": "cpu", "enabled": False}}
    llm = LLM(model=str(pull("smollm2-135m")), dtype=args.dtype, disable_log_stats=False, **kw)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(convs[:2], SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)  # warm
    rows = []
    for batch, max_tokens in points:
        rows += run_point(llm, engine, args, convs[:batch], max_tokens)
    llm.llm_engine.engine_core.shutdown()
    return rows


def run_point(llm, engine: str, args, convs: list, max_tokens: int) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for i, mode in enumerate(rounds_for(engine, args.repeats)):
        if engine == "ours":
            llm.collective_rpc(set_mode(mode))
            p0 = llm.collective_rpc(profile)[0]
        a0, d0 = counters(llm)
        t = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        wall = time.perf_counter() - t
        a1, d1 = counters(llm)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row = {"arm": mode, "round": i, "batch": len(convs), "tokens": tokens,
               "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
               "accept_len": round(1 + (a1 - a0) / (d1 - d0), 3) if d1 > d0 else None}
        if engine == "ours":
            p1 = llm.collective_rpc(profile)[0]
            steps = p1["steps"] - p0["steps"]
            row["steps"] = steps
            row["sample_ms_per_step"] = round(1e3 * (p1["sample_s"] - p0["sample_s"]) / steps, 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        out += summarise_point([r for r in rows if r["batch"] == batch])
    return out


def summarise_point(rows: list[dict]) -> list[dict]:
    out = []
    nospec = statistics.median(r["tok_s"] for r in rows if r["arm"] == "nospec")
    for arm in ["nospec", *MODES]:
        mine = [r for r in rows if r["arm"] == arm]
        tok = [r["tok_s"] for r in mine]
        s = {"arm": arm, "batch": rows[0]["batch"], "label": MODES[arm][0] if arm in MODES else "plain vLLM",
             "rounds": len(mine), "tok_s": round(statistics.median(tok), 1),
             "tok_s_min": min(tok), "tok_s_max": max(tok),
             "vs_nospec": round(statistics.median(tok) / nospec, 3)}
        if arm in MODES:
            s["sample_ms_per_step"] = round(statistics.median(r["sample_ms_per_step"]
                                                              for r in mine), 2)
            acc = [r["accept_len"] for r in mine if r["accept_len"]]
            s["accept_len"] = round(statistics.median(acc), 3) if acc else None
        out.append(s)
    return out


def write(out: Path, args, rows: list[dict], wall: float) -> None:
    summary = summarise(rows)
    command = (f"python lab/unseeded_sampling.py --prompts $GSM8K_TRAIN --batches {args.batches} "
               f"--max-tokens {args.max_tokens} --repeats {args.repeats} --dtype {args.dtype} "
               f"--out runs/{out.name}")
    doc = {"date": time.strftime("%Y-%m-%d"), "box": box(), "command": command,
           "wall_s": round(wall),
        "batches": args.batches, "max_tokens": args.max_tokens, "dtype": args.dtype,
        "summary": summary, "rows": rows}
    (out / "unseeded_sampling.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = ["# Unseeded sampled requests: what this worker's sampling costs a step", "",
          f"- date: {doc['date']}; box: {doc['box']}",
          f"- command: `{doc['command']}` ({doc['wall_s']} s)",
          f"- {args.batches} requests of GSM8K's served-only slice at once, temperature 1, top-p "
          f"1, no seed, {args.max_tokens} tokens each (`ignore_eos`), {args.dtype}; SmolLM2-135M-"
          "Instruct; this worker: the `cpu` preset, learning off, the shipped drafter, K 16",
          "- rounds of one engine ordered A B C C B A (repeated): median (min-max) over rounds",
          "", "| batch | arm | sampling | rounds | tok/s | vs nospec | sampler ms / step | "
          "accept len |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        md.append(f"| {s['batch']} | {s['arm']} | {s['label']} | {s['rounds']} | {s['tok_s']} "
                  f"({s['tok_s_min']}-{s['tok_s_max']}) | {s['vs_nospec']:.3f}x | "
                  f"{s.get('sample_ms_per_step', '-')} | {s.get('accept_len') or '-'} |")
    md += ["", "## Rounds", "", "| batch | round | arm | tok/s | sampler ms / step | steps | "
           "accept len |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['batch']} | {r['round']} | {r['arm']} | {r['tok_s']} | {r.get('sample_ms_per_step', '-')}"
                  f" | {r.get('steps', '-')} | {r.get('accept_len') or '-'} |")
    (out / "unseeded_sampling.md").write_text("\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="GSM8K train.jsonl (its served-only slice)")
    ap.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", default="128,64", help="tokens per request, one per batch")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--publish", action="store_true")
    args = ap.parse_args()
    from vllm_onlinespec.training.prompt_sets import gsm8k_served_slice

    batches = [int(b) for b in args.batches.split(",")]
    tokens = [int(t) for t in args.max_tokens.split(",")]
    if len(tokens) != len(batches):
        ap.error(f"--max-tokens: {len(tokens)} values for {len(batches)} batch sizes")
    points = list(zip(batches, tokens))
    prompts = [r["prompt"] for r in gsm8k_served_slice(args.prompts)][:max(batches)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for engine in ("nospec", "ours"):
        rows += run_engine(engine, args, prompts, points)
    write(out, args, rows, time.perf_counter() - t0)
    if args.publish:
        for ext in ("json", "md"):
            shutil.copy(out / f"unseeded_sampling.{ext}", ROOT / "docs/results")
    print((out / "unseeded_sampling.md").read_text())


if __name__ == "__main__":
    main()
