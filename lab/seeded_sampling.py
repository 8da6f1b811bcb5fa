"""What drafter-invariant verification costs on sampled traffic, and whether seeded requests
reproduce across a drafter publish: vLLM's rejection sampling (`sampling.invariant: off`)
against the invariant mode (`seeded`), same drafter, same prompts, same seeds.

    flock /tmp/onlinespec-engine.lock .venv/bin/python lab/seeded_sampling.py \
        --spec-bench ../shared/data/spec_bench/question.jsonl --out runs/seeded --publish

Each mode is one engine (bf16, SmolLM2-135M-Instruct, the shipped drafter learning online at
K = 4, verify policy fixed) in its own subprocess; the modes run in the order given, then
reversed (two repeats each). Per temperature (0.7, then 1.0), pass 1 serves the prompts at
once with seeds 0..N-1; the engine then serves other prompts until the learner has published
new weights; pass 2 serves pass 1's requests again. `reproducible`: pass 2's tokens equal
pass 1's for every request. accept_len: vLLM's mean acceptance length (tokens per verify step)
in pass 1 (pass 2 repeats text the learner has trained on, in the reproducible modes only);
tok_s: output tokens over both passes' wall time.
Writes docs/results/seeded_sampling.{json,md} with --publish.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# mode -> (report label, sampling section)
MODES = {"off": ("rejection (vLLM)", {"invariant": "off"}),
         "greedy-drafts": ("invariant, greedy drafts", {"invariant": "seeded",
                                                         "coupled_drafts": False}),
         "coupled": ("invariant, coupled drafts", {"invariant": "seeded", "coupled_drafts": True})}
LABEL = {m: v[0] for m, v in MODES.items()}
TEMPERATURES = (0.7, 1.0)
FILLER = ["Tell me about the history of Rome.", "How do airplanes fly?",
          "Describe a day at the beach.", "What makes a good teacher?"]


def counters(llm) -> tuple[float, float]:
    m = {x.name: x for x in llm.get_metrics()}
    return (m["vllm:spec_decode_num_accepted_tokens"].value,
            m["vllm:spec_decode_num_drafts"].value)


def child(mode: str, args: argparse.Namespace, out: Path) -> None:
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.models import pull, shipped_drafter
    from vllm_onlinespec.serving.stats import fetch
    from vllm_onlinespec.training.data import load_spec_bench

    prompts = [p.text for p in load_spec_bench(args.spec_bench, args.categories.split(","))]
    prompts = prompts[:args.num_prompts]
    online = {"length_head": {"policy": "fixed"}, "sampling": MODES[mode][1]}
    llm = LLM(model=str(pull("smollm2-135m")), dtype="bfloat16", disable_log_stats=False,
              **engine_kwargs(max_model_len=2048),
              speculative_config={"method": "dflash", "model": str(shipped_drafter("smollm2-135m")),
                                  "num_speculative_tokens": 4},
              additional_config={"onlinespec": online})
    convs = [[{"role": "user", "content": p}] for p in prompts]
    rows = []
    for temp in TEMPERATURES:
        params = [SamplingParams(temperature=temp, seed=i, max_tokens=args.max_tokens)
                  for i in range(len(convs))]
        passes, wall, tokens = [], 0.0, 0
        a0, s0 = counters(llm)
        for p in range(2):
            if p == 1:  # other traffic until the learner publishes
                v0, deadline = fetch(llm).published_version, time.time() + 300
                while fetch(llm).published_version <= v0 and time.time() < deadline:
                    llm.chat([[{"role": "user", "content": f}] for f in FILLER],
                             SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
                a_mid, s_mid = counters(llm)
            t0 = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            wall += time.perf_counter() - t0
            passes.append([list(o.outputs[0].token_ids) for o in outs])
            tokens += sum(len(t) for t in passes[-1])
            if p == 0:
                a1, s1 = counters(llm)
        a2, s2 = counters(llm)
        st = fetch(llm)
        rows.append({"mode": LABEL[mode], "temperature": temp,
                     # pass 1 only: a reproducible pass 2 repeats text the learner has just
                     # trained on, which would flatter the reproducible modes
                     "accept_len": 1 + (a1 - a0) / (s1 - s0) if s1 > s0 else None,
                     "accept_len_pass2": 1 + (a2 - a_mid) / (s2 - s_mid) if s2 > s_mid else None,
                     "tok_s": tokens / wall, "reproducible": passes[0] == passes[1],
                     "requests_differing": sum(a != b for a, b in zip(*passes)),
                     "published_version": st.published_version,
                     "invariant_rows": st.invariant_rows, "coupled_rows": st.coupled_rows,
                     "tokens": tokens, "wall_s": wall})
        print(rows[-1], flush=True)
    (out / f"{mode}-{args.repeat}.json").write_text(json.dumps(rows))
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec-bench", required=True)
    ap.add_argument("--categories", default="writing,roleplay,translation,qa",
                    help="Spec-Bench categories served (the drafter never saw Spec-Bench)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="runs/seeded")
    ap.add_argument("--publish", action="store_true", help="copy the report to docs/results/")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.child:
        child(args.child, args, out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    order = [*MODES, *list(MODES)[::-1]]
    runs = []
    for rep, mode in enumerate(order):
        print(f"{mode} (run {rep}) ...", flush=True)
        with open(out / f"{mode}-{rep}.log", "w") as fh:
            subprocess.call([sys.executable, __file__, "--child", mode, "--repeat", str(rep),
                             "--out", str(out), "--spec-bench", args.spec_bench,
                             "--categories", args.categories,
                             "--num-prompts", str(args.num_prompts),
                             "--max-tokens", str(args.max_tokens)],
                            stdout=fh, stderr=subprocess.STDOUT, timeout=1800)
        f = out / f"{mode}-{rep}.json"
        if not f.is_file():
            raise SystemExit(f"{mode} (run {rep}) gave no result: see {out / f'{mode}-{rep}.log'}")
        runs += [{**r, "run": rep} for r in json.loads(f.read_text())]
    rows = []
    for mode in MODES:
        for temp in TEMPERATURES:
            rs = [r for r in runs if r["mode"] == LABEL[mode] and r["temperature"] == temp]
            acc, tps = [r["accept_len"] for r in rs], [r["tok_s"] for r in rs]
            rows.append({"mode": LABEL[mode], "temperature": temp,
                         "accept_len": statistics.mean(acc), "accept_len_range": [min(acc), max(acc)],
                         "tok_s": statistics.mean(tps), "tok_s_range": [min(tps), max(tps)],
                         "reproducible": all(r["reproducible"] for r in rs),
                         "requests_differing": [r["requests_differing"] for r in rs],
                         "repeats": len(rs)})
    box = f"{platform.machine()}, {os.cpu_count()} vCPU"
    wall = time.perf_counter() - t0
    report = {"rows": rows, "runs": runs, "box": box, "wall_s": wall,
              "date": time.strftime("%Y-%m-%d"), "num_prompts": args.num_prompts,
              "max_tokens": args.max_tokens, "categories": args.categories}
    by = {(r["mode"], r["temperature"]): r for r in rows}
    md = [f"# Seeded sampling on a learning engine ({report['date']}, {box})", "",
          f"Command: `python lab/seeded_sampling.py --spec-bench "
          f"../shared/data/spec_bench/question.jsonl --publish` ({wall:.0f} s, everything "
          f"counted). SmolLM2-135M-Instruct bf16, shipped drafter learning online, K = 4, "
          f"verify policy fixed; {args.num_prompts} Spec-Bench prompts ({args.categories}), "
          f"seeds 0..{args.num_prompts - 1}, {args.max_tokens} tokens, served at once; each "
          f"mode is one engine, modes in the order {', '.join(order)} (two repeats each, means "
          f"and min-max). Pass 2 repeats pass 1's requests after the learner published new "
          f"weights. accept_len: pass 1 only (a reproducible pass 2 repeats text the learner "
          f"has just trained on); tok/s: both passes.", "",
          "| mode | temperature | accept_len (min-max) | tok/s (min-max) | reproducible | "
          "requests differing per run |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['mode']} | {r['temperature']} | {r['accept_len']:.3f} "
                  f"({r['accept_len_range'][0]:.3f}-{r['accept_len_range'][1]:.3f}) | "
                  f"{r['tok_s']:.1f} ({r['tok_s_range'][0]:.1f}-{r['tok_s_range'][1]:.1f}) | "
                  f"{'yes' if r['reproducible'] else 'no'} | "
                  f"{', '.join(map(str, r['requests_differing']))} / {args.num_prompts} |")
    md.append("")
    for temp in TEMPERATURES:
        rej = by[(LABEL["off"], temp)]
        for mode in ("greedy-drafts", "coupled"):
            inv = by[(LABEL[mode], temp)]
            md.append(f"At temperature {temp}, {LABEL[mode]}: {inv['tok_s'] / rej['tok_s']:.2f}x "
                      f"vLLM's rejection sampling's tok/s.")
    # accept_len is not compared as a ratio: each request's text is one draw per mode (a
    # reproducible mode's repeats draw the same text), and a greedy draft is accepted with
    # probability p(draft) under either rule (lab/greedy_draft_acceptance.py measures that).
    md += ["", "accept_len compares one sampled text per request and mode (the invariant modes' "
           "repeats sample the same texts: their min-max is not a sampling spread), so its "
           "differences between modes are not attributed to the verification rule here; for "
           "greedy drafts see the offline check below."]
    from vllm_onlinespec.bench.results import write_result_files

    # The offline section lab/greedy_draft_acceptance.py keeps on the same page survives a rerun.
    page = ROOT / "docs" / "results" / "seeded_sampling.md"
    begin, end = "<!-- greedy_draft_acceptance: begin -->", "<!-- greedy_draft_acceptance: end -->"
    if args.publish and page.is_file() and begin in page.read_text():
        old = page.read_text()
        md += ["", old[old.index(begin):old.index(end) + len(end)]]
        report["greedy_draft_acceptance"] = json.loads(
            page.with_suffix(".json").read_text()).get("greedy_draft_acceptance")

    write_result_files(out, "seeded_sampling", md, report,
                       ROOT / "docs" / "results" if args.publish else None)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
