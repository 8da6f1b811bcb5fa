"""The price of one speculative step on this CPU, and the ceiling a perfect drafter reaches.

    flock /tmp/onlinespec-engine.lock .venv/bin/python lab/step_cost.py \
        --spec-bench $SPEC_BENCH --out runs/step_cost

Arms (each one engine in its own subprocess, one engine at a time, in this order):
    nospec, nospec+iomp, ngram K, vLLM's plain DFlash worker K, frozen K (this project's worker,
    learning off, fixed policy), frozen K without Intel OpenMP, online K (learning on, with and
    without re-packing), budget K (learning off, the budget policy with its step gate), oracle K
    at tau = K + 1 (every draft accepted; benchmark-only, output NOT the target's), the K = 0
    floor (k0, k0-forward; in float32 k0-fp32, k0-fp32-no-iomp, k0-recipe-fp32)
for K in --ks; float32 arms are compared with nospec-fp32 where it ran. Each engine serves
batches of --batches requests (greedy, `ignore_eos`, --max-tokens each, the same Spec-Bench
prompts in every arm), --repeats times per batch size,
and reports per (arm, batch): output tok/s and ms per engine step (median, min-max over the
repeats), accept length (vLLM's counters), verify tokens per step. Our worker's arms add a
breakdown of the step (serving/step_profile.py: target forward, sampler, drafter, our hooks,
rest of the runner) and the engine-side remainder (scheduler, IPC) as wall / steps - worker.

Writes OUT/step_cost.json and .md; `--publish` also copies them to docs/results/.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = {"accepted": "vllm:spec_decode_num_accepted_tokens",
            "drafts": "vllm:spec_decode_num_drafts",
            "draft_tokens": "vllm:spec_decode_num_draft_tokens"}
STEPS_METRIC = "vllm:iteration_tokens_total"  # histogram: one observation per engine step


@dataclass
class ArmConf:
    name: str
    method: str  # none | ngram | dflash-vllm | ours
    k: int = 0
    iomp: str = "auto"  # auto: what this project decides | on: preloaded by hand | off
    online: dict | None = None
    oracle: float | None = None
    dtype: str = "bfloat16"


@dataclass
class Run:
    batch: int
    wall_s: float
    output_tokens: int
    steps: int
    accepted: int
    drafts: int
    draft_tokens: int
    profile: dict | None = None  # worker phase seconds, this run only


@dataclass
class Row:
    arm: str
    batch: int
    K: int
    tok_s: float
    tok_s_min: float
    tok_s_max: float
    step_ms: float
    step_ms_min: float
    step_ms_max: float
    accept_len: float | None
    verify_tokens_per_step: float
    tokens_per_step: float  # output tokens per engine step, per request (what decoding gains)
    repeats: int
    breakdown_ms: dict | None = None
    speedup: float | None = None  # tok/s against nospec (same batch, same run)


def arms_for(ks: list[int], drafter: str) -> list[ArmConf]:
    """Per K: ngram, frozen, oracle; at the first K also the cost comparisons (vLLM's own DFlash
    worker, no Intel OpenMP, learning on with and without re-packing)."""
    frozen = {"enabled": False, "length_head": {"policy": "fixed"}}
    online = {"length_head": {"policy": "fixed"}}
    k0 = {"enabled": False, "features": {"plain": True}}  # every step drafts nothing
    out = [ArmConf("nospec", "none"), ArmConf("nospec+iomp", "none", iomp="on"),
           ArmConf("nospec-fp32", "none", dtype="float32")]
    for i, k in enumerate(ks):
        out += [ArmConf("ngram", "ngram", k, iomp="on"), ArmConf("frozen", "ours", k, online=frozen),
                ArmConf("oracle", "ours", k, online=frozen, oracle=float(k + 1))]
        if i == 0:
            out += [ArmConf("frozen-fp32", "ours", k, online=frozen, dtype="float32"),
                    ArmConf("dflash-vllm", "dflash-vllm", k, iomp="on"),
                    ArmConf("frozen-no-iomp", "ours", k, iomp="off", online=frozen),
                    ArmConf("online", "ours", k, online=online),
                    ArmConf("online-repack", "ours", k,
                            online={**online, "publish": {"repack": True}}),
                    # the budget with its step gate (k_min 0: a step may verify nothing)
                    ArmConf("budget", "ours", k, online={
                        "enabled": False, "length_head": {"policy": "budget", "k_min": 0}}),
                    # the floor: every step drafts nothing (context K/V only), and the same
                    # with vLLM's own K = 0 drafter forward
                    ArmConf("k0", "ours", k, online=k0),
                    ArmConf("k0-forward", "ours", k,
                            online={**k0, "length_head": {"k0_step": "forward"}}),
                    # the floor in float32 (boxes without AVX512-BF16 serve float32), with and
                    # without Intel OpenMP, and as `bench-serve`'s k0 arm runs it (the cpu
                    # preset's budget and suffix-tree lookup configured, K = 16)
                    ArmConf("k0-fp32", "ours", k, online=k0, dtype="float32"),
                    ArmConf("k0-fp32-no-iomp", "ours", k, iomp="off", online=k0,
                            dtype="float32"),
                    ArmConf("k0-recipe-fp32", "ours", 16, dtype="float32", online={
                        **k0, "length_head": {"policy": "budget", "k_min": 0},
                        "prompt_lookup": {"enabled": True, "source": "suffix_tree"}}),
                    # the cpu preset itself, learning off (its drafting steps and its floor)
                    ArmConf("recipe-fp32", "ours", 16, dtype="float32",
                            online={"preset": "cpu", "enabled": False})]
    return out


# ---------------------------------------------------------------------------------------------
# One engine (subprocess)
# ---------------------------------------------------------------------------------------------

def _metric_values(llm) -> tuple[dict[str, int], int]:
    counters, steps = {}, 0
    for m in llm.get_metrics():
        if m.name == STEPS_METRIC and hasattr(m, "count"):
            steps += int(m.count)
        elif hasattr(m, "value"):
            counters[m.name] = counters.get(m.name, 0) + int(m.value)
    return {k: counters.get(n, 0) for k, n in COUNTERS.items()}, steps


def _profile(llm, ours: bool) -> dict | None:
    if not ours:
        return None
    return llm.collective_rpc("onlinespec_step_profile")[0]


def run_engine(arm: ArmConf, drafter: str, target: str, prompts: list[list[dict]],
               batches: list[int], repeats: int, max_tokens: int,
               temperature: float = 0.0) -> list[dict]:
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs

    kw = engine_kwargs(max_model_len=1024)
    if arm.method == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": arm.k,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif arm.method in ("dflash-vllm", "ours"):
        kw["speculative_config"] = {"method": "dflash", "model": drafter,
                                    "num_speculative_tokens": arm.k}
    if arm.method == "ours":
        online = dict(arm.online or {})
        if arm.oracle is not None:
            online["oracle"] = {"accept_len": arm.oracle}
        kw["additional_config"] = {"onlinespec": online}
    llm = LLM(model=target, dtype=arm.dtype, disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ours = arm.method == "ours"
    llm.chat(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    runs = []
    for batch in batches:
        for r in range(repeats):
            sel = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
            c0, s0 = _metric_values(llm)
            p0 = _profile(llm, ours)
            t = time.perf_counter()
            # Sampled: seeded per request (as RL rollouts are), so the invariant sampler runs
            # wherever drafts may change (sampling.invariant "auto").
            ps = params if temperature == 0 else [
                SamplingParams(temperature=temperature, seed=1000 * r + i, max_tokens=max_tokens,
                               ignore_eos=True) for i in range(batch)]
            outs = llm.chat(sel, ps, use_tqdm=False)
            wall = time.perf_counter() - t
            c1, s1 = _metric_values(llm)
            p1 = _profile(llm, ours)
            prof = None
            if p0 is not None and p1 is not None:
                prof = {k: p1[k] - p0[k] for k in p1 if isinstance(p1[k], (int, float))}
            runs.append(asdict(Run(batch=batch, wall_s=wall,
                                   output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                                   steps=s1 - s0, accepted=c1["accepted"] - c0["accepted"],
                                   drafts=c1["drafts"] - c0["drafts"],
                                   draft_tokens=c1["draft_tokens"] - c0["draft_tokens"],
                                   profile=prof)))
    llm.llm_engine.engine_core.shutdown()
    return runs


def _child_env(arm: ArmConf) -> dict:
    env = dict(os.environ)
    if arm.iomp == "on" and "libiomp" not in env.get("LD_PRELOAD", ""):
        from vllm_onlinespec.serving.openmp import find_libiomp

        lib = find_libiomp()
        if lib:
            env["LD_PRELOAD"] = ":".join(x for x in (env.get("LD_PRELOAD"), lib) if x)
    elif arm.iomp == "off":
        env["VLLM_ONLINESPEC_IOMP"] = "0"
    elif arm.iomp == "auto":
        env.pop("VLLM_ONLINESPEC_IOMP", None)  # the project's default
    if arm.oracle is not None:
        env["VLLM_ONLINESPEC_BENCHMARK_ORACLE"] = "1"
    return env


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

def summarize(arm: ArmConf, runs: list[dict]) -> list[Row]:
    rows = []
    for batch in sorted({r["batch"] for r in runs}):
        rs = [r for r in runs if r["batch"] == batch]
        tok_s = [r["output_tokens"] / r["wall_s"] for r in rs]
        step_ms = [1e3 * r["wall_s"] / max(1, r["steps"]) for r in rs]
        acc, drafts = sum(r["accepted"] for r in rs), sum(r["drafts"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        breakdown = None
        profs = [r["profile"] for r in rs if r.get("profile")]
        if profs:
            n = sum(p["steps"] for p in profs) or 1
            tot = {k: sum(p[k] for p in profs) for k in profs[0]}
            other = tot["sample_tokens_s"] - tot["sample_s"] - tot["draft_s"] - tot["ours_in_sample_tokens_s"]
            worker = tot["target_s"] + tot["sample_tokens_s"] + (tot["ours_s"] - tot["ours_in_sample_tokens_s"])
            wall = sum(r["wall_s"] for r in rs)
            breakdown = {"target": 1e3 * tot["target_s"] / n, "sampler": 1e3 * tot["sample_s"] / n,
                         "drafter": 1e3 * tot["draft_s"] / n, "ours": 1e3 * tot["ours_s"] / n,
                         "runner_other": 1e3 * max(0.0, other) / n,
                         "engine_other": 1e3 * max(0.0, wall - worker) / n}
        rows.append(Row(arm=arm.name, batch=batch, K=arm.k, tok_s=statistics.median(tok_s),
                        tok_s_min=min(tok_s), tok_s_max=max(tok_s),
                        step_ms=statistics.median(step_ms), step_ms_min=min(step_ms),
                        step_ms_max=max(step_ms),
                        accept_len=(acc + drafts) / drafts if drafts else None,
                        verify_tokens_per_step=sum(r["draft_tokens"] for r in rs) / max(1, steps),
                        tokens_per_step=sum(r["output_tokens"] for r in rs) / max(1, steps) / batch,
                        repeats=len(rs), breakdown_ms=breakdown))
    return rows


def baseline_arm(arm: str, arms: set[str]) -> str:
    """The plain arm an arm is compared with: float32 arms with nospec-fp32 where it ran."""
    return "nospec-fp32" if "fp32" in arm and "nospec-fp32" in arms else "nospec"


def add_speedups(rows: list[Row]) -> None:
    arms = {r.arm for r in rows}
    base = {(r.arm, r.batch): r.tok_s for r in rows}
    for r in rows:
        b = base.get((baseline_arm(r.arm, arms), r.batch))
        if b and r.arm != baseline_arm(r.arm, arms):
            r.speedup = r.tok_s / b


def markdown(rows: list[Row], meta: dict) -> str:
    out = [f"# Step cost and ceiling ({meta['date']})", "",
           f"Command: `{meta['command']}`", "",
           f"Target {meta['target']}, {meta['dtype']}, drafter `{meta['drafter']}`, "
           + ("greedy" if not meta.get("temperature") else
              f"sampled (temperature {meta['temperature']:g}, one seed per request)") + ", "
           f"{meta['max_tokens']} tokens per request (`ignore_eos`), batches {meta['batches']}, "
           f"{meta['repeats']} repeats per point (median, min-max). One engine at a time. "
           f"`oracle` accepts every draft (benchmark-only; its output is NOT the target's). "
           f"`iomp`: Intel OpenMP preloaded for vLLM's workers (this project does it with "
           f"VLLM_ONLINESPEC_IOMP=1; `nospec+iomp`, `ngram`, `dflash-vllm` preload it by hand). Wall time {meta['wall_s']:.0f} s. Box: {meta.get('box', 'not recorded')}.",
           "",
           "| arm | K | batch | tok/s (min-max) | vs nospec | ms/step (min-max) | accept len | "
           "tokens/step/request | verify tok/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r.accept_len:.2f}" if r.accept_len else "-"
        sp = f"{r.speedup:.2f}x" if r.speedup else "-"
        out.append(f"| {r.arm} | {r.K or '-'} | {r.batch} | {r.tok_s:.1f} ({r.tok_s_min:.1f}-"
                   f"{r.tok_s_max:.1f}) | {sp} | {r.step_ms:.1f} ({r.step_ms_min:.1f}-"
                   f"{r.step_ms_max:.1f}) | {acc} | {r.tokens_per_step:.2f} | "
                   f"{r.verify_tokens_per_step:.1f} |")
    arms = {r.arm for r in rows}
    base = {(r.arm, r.batch): r.step_ms for r in rows}
    batches = sorted({r.batch for r in rows})
    out += ["", "Step cost relative to a plain step (ms/step over the plain arm's, same batch and "
            "dtype):", "",
            "| arm | K | " + " | ".join(f"batch {b}" for b in batches) + " |",
            "|---|---|" + "---|" * len(batches)]
    for name, k in dict.fromkeys((r.arm, r.K) for r in rows
                                 if r.arm != baseline_arm(r.arm, arms)):
        cells = []
        for b in batches:
            m = [r for r in rows if r.arm == name and r.K == k and r.batch == b]
            ref = base.get((baseline_arm(name, arms), b))
            cells.append(f"{m[0].step_ms / ref:.2f}x" if m and ref else "-")
        out.append(f"| {name} | {k or '-'} | " + " | ".join(cells) + " |")
    bd = [r for r in rows if r.breakdown_ms]
    if bd:
        out += ["", "Where a step's time goes (this project's worker; ms per engine step):", "",
                "| arm | K | batch | target fwd | sampler | drafter | ours | runner other | "
                "engine other |", "|---|---|---|---|---|---|---|---|---|"]
        for r in bd:
            b = r.breakdown_ms
            out.append(f"| {r.arm} | {r.K} | {r.batch} | {b['target']:.1f} | {b['sampler']:.1f} | "
                       f"{b['drafter']:.1f} | {b['ours']:.2f} | {b['runner_other']:.1f} | "
                       f"{b['engine_other']:.1f} |")
    return "\n".join(out) + "\n"


def load_prompts(spec_bench: str | None, n: int, target: str) -> list[list[dict]]:
    """n chat prompts of at most 384 tokens, categories interleaved (the same list every arm)."""
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench import prompts as P

    ps = P.spec_bench(spec_bench, None) if spec_bench else P.builtin_chat()
    ps = P.interleave(P.by_length(ps, AutoTokenizer.from_pretrained(target), 384), seed=0)
    return [p.messages for p in ps[:n]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec-bench", help="Spec-Bench question.jsonl (default: built-in prompts)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", help="DFlash drafter folder (default: the shipped SmolLM2 "
                    "drafter if installed, else a fresh random 1-layer one)")
    ap.add_argument("--ks", default="4,7")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: sampled, one seed per request")
    ap.add_argument("--arms", help="comma-separated arm names to keep (default all)")
    ap.add_argument("--reversed-pass", action="store_true",
                    help="measure every arm again in reversed order; rows merge both passes")
    ap.add_argument("--name", default="step_cost",
                    help="report file names NAME.json / NAME.md (in --out and, with --publish, "
                         "docs/results/)")
    ap.add_argument("--out", default="runs/step_cost")
    ap.add_argument("--publish", action="store_true", help="copy the report to docs/results/")
    ap.add_argument("--report", action="store_true", help="only rebuild the report from the "
                    "arms already measured in --out (job-*.json + runs-*.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: JSON job file
    args = ap.parse_args(argv)
    if args.one:
        job = json.loads(Path(args.one).read_text())
        runs = run_engine(ArmConf(**job["arm"]), job["drafter"], job["target"], job["prompts"],
                          job["batches"], job["repeats"], job["max_tokens"],
                          job.get("temperature", 0.0))
        Path(job["result"]).write_text(json.dumps(runs))
        return 0

    from vllm_onlinespec.models import resolve

    t0 = time.perf_counter()
    out = Path(args.out)
    if args.report:
        rows, meta = rows_from_disk(out)
        return write_reports(out, merge_passes(rows), meta, args.publish)
    out.mkdir(parents=True, exist_ok=True)
    target = str(resolve(args.target))
    drafter = args.drafter or default_drafter(target, out)
    ks = [int(x) for x in args.ks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    prompts = load_prompts(args.spec_bench, max(batches) * args.repeats, target)
    arms = arms_for(ks, drafter)
    if args.arms:
        keep = set(args.arms.split(","))
        arms = [a for a in arms if a.name in keep]
    if args.reversed_pass:  # a second pass with the arm order reversed: drift shows as spread
        arms = arms + arms[::-1]
    rows: list[Row] = []
    for i, arm in enumerate(arms):
        job = out / f"job-{i}.json"
        res = out / f"runs-{i}-{arm.name}-k{arm.k}.json"
        job.write_text(json.dumps({"arm": asdict(arm), "drafter": drafter, "target": target,
                                   "prompts": prompts, "batches": batches,
                                   "repeats": args.repeats, "max_tokens": args.max_tokens,
                                   "temperature": args.temperature, "result": str(res)}))
        print(f"[{i + 1}/{len(arms)}] {arm.name} K={arm.k} ...", flush=True)
        log = out / f"log-{i}-{arm.name}-k{arm.k}.txt"
        with open(log, "w") as fh:
            rc = subprocess.call([sys.executable, __file__, "--one", str(job)], stdout=fh,
                                 stderr=subprocess.STDOUT, env=_child_env(arm))
        if rc != 0:
            print(f"  FAILED (rc {rc}); see {log}", flush=True)
            continue
        arm_rows = summarize(arm, json.loads(res.read_text()))
        for r in arm_rows:
            print(f"  batch {r.batch}: {r.tok_s:.1f} tok/s, {r.step_ms:.1f} ms/step, accept "
                  f"{r.accept_len or 1:.2f}", flush=True)
        rows += arm_rows
    rows = merge_passes(rows)
    meta = {"date": time.strftime("%Y-%m-%d"), "target": target, "drafter": drafter,
            "dtype": "bfloat16 unless the arm says fp32", "max_tokens": args.max_tokens, "batches": batches,
            "temperature": args.temperature,
            "repeats": args.repeats, "ks": ks, "wall_s": time.perf_counter() - t0,
            "command": "python lab/step_cost.py " + " ".join(argv or sys.argv[1:]),
            "name": args.name, "box": box()}
    (out / "meta.json").write_text(json.dumps(meta))
    return write_reports(out, rows, meta, args.publish)


def box() -> str:
    """The CPU this ran on, as lscpu names it, and its core count."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    isa = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no AVX512-BF16/AMX"
    return f"{model}, {os.cpu_count()} logical CPUs ({isa})"


def merge_passes(rows: list[Row]) -> list[Row]:
    """One row per (arm, K, batch): an arm measured in two passes (--reversed-pass) gets the
    mean of its passes' medians, the min and max over every repeat of both, and their repeats;
    the rest (accept length, step breakdown) from the first pass."""
    merged: dict[tuple, Row] = {}
    for r in rows:
        key = (r.arm, r.K, r.batch)
        m = merged.get(key)
        if m is None:
            merged[key] = Row(**asdict(r))
            continue
        n = m.repeats // r.repeats  # passes already merged in
        m.tok_s = (m.tok_s * n + r.tok_s) / (n + 1)
        m.step_ms = (m.step_ms * n + r.step_ms) / (n + 1)
        m.tok_s_min, m.tok_s_max = min(m.tok_s_min, r.tok_s_min), max(m.tok_s_max, r.tok_s_max)
        m.step_ms_min = min(m.step_ms_min, r.step_ms_min)
        m.step_ms_max = max(m.step_ms_max, r.step_ms_max)
        m.repeats += r.repeats
    return list(merged.values())


def rows_from_disk(out: Path) -> tuple[list[Row], dict]:
    """Rows of every arm measured in `out` (in job order), and the run's meta."""
    rows = []
    for job in sorted(out.glob("job-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        spec = json.loads(job.read_text())
        res = Path(spec["result"])
        if res.is_file():
            rows += summarize(ArmConf(**spec["arm"]), json.loads(res.read_text()))
    meta_path = out / "meta.json"
    if meta_path.is_file():
        return rows, json.loads(meta_path.read_text())
    first = json.loads(min(out.glob("job-*.json")).read_text())  # a run stopped before its end
    logs = sorted(out.glob("log-*.txt"))
    wall = logs[-1].stat().st_mtime - first_mtime(out) if logs else 0.0
    return rows, {"date": time.strftime("%Y-%m-%d"), "target": first["target"],
                  "drafter": first["drafter"], "dtype": "bfloat16 unless the arm says fp32",
                  "max_tokens": first["max_tokens"], "batches": first["batches"],
                  "repeats": first["repeats"], "wall_s": wall,
                  "command": "python lab/step_cost.py --spec-bench "
                             "$SPEC_BENCH (stopped after the arms "
                             "listed; report rebuilt with --report)"}


def first_mtime(out: Path) -> float:
    return min(p.stat().st_mtime for p in out.glob("job-*.json"))


def write_reports(out: Path, rows: list[Row], meta: dict, publish: bool) -> int:
    add_speedups(rows)
    name = meta.get("name", "step_cost")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]},
                                                 indent=1))
    (out / f"{name}.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    if publish:
        dst = ROOT / "docs" / "results"
        for fn in (f"{name}.json", f"{name}.md"):
            shutil.copy(out / fn, dst / fn)
    return 0


def default_drafter(target: str, out: Path) -> str:
    """The shipped drafter when the package has one, else a random one of the recipe's shape
    (a step's cost does not depend on what the weights are)."""
    try:
        from vllm_onlinespec.models import shipped_drafter

        return str(shipped_drafter("smollm2-135m"))
    except Exception:  # noqa: BLE001 - none shipped (yet): a random one costs the same
        pass
    import torch
    from transformers import AutoConfig

    from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, save_drafter

    cfg = DFlashConfig.for_target(AutoConfig.from_pretrained(target), mask_token_id=16,
                                  num_layers=1, block_size=8, torch_dtype="bfloat16")
    torch.manual_seed(0)
    dst = out / "random-drafter"
    save_drafter(str(dst), cfg, DFlashDrafter(cfg))
    return str(dst)


if __name__ == "__main__":
    sys.exit(main())
