"""What the online learner costs the serving core on a 2-core CPU box, and whether the GIL is
why: the learner as a thread of the serving process (as served) against the learner in its own
process (no shared GIL), same cores, same work.

    python lab/learner_contention.py --prompts runs/domain_shift/streams/tune.jsonl \
        --modes thread,process,gil --repeats 3 --out docs/results/learner_contention

A stand-in for vLLM's CPU serving, without vLLM (one engine at a time, and the point is the
learner's neighbourhood, not vLLM's step): the HF target decodes a batch of 4 with its KV cache
on core 0 (one torch thread), vLLM's engine core is stood in for by a process that spins on
sched_yield on core 1 (as vLLM's shared-memory queue readers do), and the learner
(`learner.factory.build_learner`: the shipped drafter, bf16 matmuls, replay, dense anchors; its
buffer fed with the HF target's features of the prompts) runs synchronous updates on core 1 at
SCHED_IDLE, as `learner/cores.py` places it in serving. Every 20 decode steps the learner is
switched on or off, so each run compares decode steps with and without it under the same drift
of the VM (the ratio; the absolute ms drift by +-20 % between runs on this box).

Modes (each run a fresh process): `thread` (the learner is a thread of the decoding process, as
in serving), `thread-si` (the same with sys.setswitchinterval(2e-4): a GIL handed over 25x
sooner), `process` (the learner in its own process), `gil` (a pure-Python loop instead of the
decode, beside the learner thread: its rate with / without the learner is the learner's GIL
share).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVE_CORE, LEARNER_CORE = 0, 1
TOGGLE = 20  # decode steps per on / off phase
K = 4


def spin(stop) -> None:
    """vLLM's engine core between steps: a reader spinning on sched_yield."""
    os.sched_setaffinity(0, {LEARNER_CORE})
    while not stop.is_set():
        for _ in range(1000):
            os.sched_yield()


def learner_loop(prompts: str, n_prompts: int, stop, go, ready, counter) -> None:
    """Updates while `go` is set, placed as serving places the learner thread."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from learner_throughput import feed, prompt_features

    from vllm_onlinespec import models
    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.learner.cores import lower_learner_priority, warm_openmp
    from vllm_onlinespec.learner.factory import build_learner

    torch.set_num_threads(1)
    drafter = models.shipped_drafter("smollm2-135m")
    seqs, embed, lm = prompt_features(prompts, models.resolve("smollm2-135m"), drafter, n_prompts)
    cfg = OnlineSpecConfig.from_any({"replay": True, "anchor_stride": 1, "batch_blocks": 32,
                                     "learner_compute_dtype": "bfloat16"})
    parts = build_learner(cfg, drafter, embed.bfloat16(), lm.bfloat16(), K,
                          train_length_head=False)
    warm_openmp()  # as learner/cores.py: OpenMP binds a thread at its first call
    os.sched_setaffinity(0, {LEARNER_CORE})
    lower_learner_priority("idle")
    ready.set()
    passes = 0
    while not stop.is_set():
        if not go.is_set():
            go.wait(0.05)
            continue
        if not parts.learner.ready(parts.buffer):  # out of fresh tokens: the prompts again
            passes += 1
            feed(parts.buffer, seqs, K, f"pass{passes}")
        if parts.learner.sync_step() == "updated":
            with counter.get_lock():
                counter.value += 1


def decode_phases(steps: int, go) -> tuple[list[float], list[float]]:
    """Decode step ms with the learner on and off (the first 2 steps of a phase left out: the
    switch itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_onlinespec import models

    m = AutoModelForCausalLM.from_pretrained(models.resolve("smollm2-135m"),
                                             torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    on, off = [], []
    with torch.no_grad():
        for i in range(steps):
            if i % 40 == 0:  # a fresh cache keeps the context length (and step cost) bounded
                out = m(ids, use_cache=True)
            if i % TOGGLE == 0:
                (go.set if (i // TOGGLE) % 2 else go.clear)()
                time.sleep(0.3)
            t0 = time.perf_counter()
            out = m(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                    use_cache=True)
            ms = (time.perf_counter() - t0) * 1e3
            if i % TOGGLE >= 2 and i >= TOGGLE:
                (on if (i // TOGGLE) % 2 else off).append(ms)
    return on, off


def python_phases(go, phases: int = 6, sec: float = 3.0) -> tuple[list[float], list[float]]:
    """A pure-Python loop's iterations per second with the learner on and off."""
    on, off = [], []
    for p in range(phases):
        (go.set if p % 2 else go.clear)()
        time.sleep(0.3)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < sec:
            for _ in range(1000):
                n += 1
        (on if p % 2 else off).append(n / sec)
    return on, off


def one_run(mode: str, prompts: str, n_prompts: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {SERVE_CORE})
    ctx = mp.get_context("spawn")
    as_process = mode == "process"
    stop = ctx.Event() if as_process else threading.Event()
    go = ctx.Event() if as_process else threading.Event()
    ready = ctx.Event() if as_process else threading.Event()
    counter = ctx.Value("i", 0)
    spin_stop = ctx.Event()
    spinner = ctx.Process(target=spin, args=(spin_stop,), daemon=True)
    spinner.start()
    if mode == "thread-si":
        sys.setswitchinterval(2e-4)
    args = (prompts, n_prompts, stop, go, ready, counter)
    learner = (ctx.Process(target=learner_loop, args=args, daemon=True) if as_process
               else threading.Thread(target=learner_loop, args=args, daemon=True))
    learner.start()
    if not ready.wait(600):
        raise SystemExit(f"{mode}: the learner did not start within 600 s")
    time.sleep(2)
    t0 = time.time()
    on, off = python_phases(go) if mode == "gil" else decode_phases(steps, go)
    wall = time.time() - t0
    stop.set()
    spin_stop.set()
    go.set()
    if as_process:
        learner.join(30)
    ratio = statistics.mean(on) / statistics.mean(off)
    row = {"mode": mode, "ratio_on_off": round(ratio, 4), "updates": counter.value,
           "wall_s": round(wall, 1)}
    if mode == "gil":
        row.update(python_rate_on=round(statistics.mean(on)), python_rate_off=round(statistics.mean(off)))
    else:
        row.update(step_ms_on=round(statistics.mean(on), 2), step_ms_off=round(statistics.mean(off), 2))
    return row


def fmt(xs: list[float], digits: int = 3) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def summarize(rows: list[dict]) -> dict[str, dict[str, str]]:
    """mode -> median (min-max) of the runs' ratios and update counts, printed."""
    modes = list(dict.fromkeys(x["mode"] for x in rows))
    summary = {m: {"ratio_on_off": fmt([x["ratio_on_off"] for x in rows if x["mode"] == m]),
                   "updates": fmt([x["updates"] for x in rows if x["mode"] == m], 0)}
               for m in modes}
    for m, s in summary.items():
        print(f"{m:10s} with / without the learner: {s['ratio_on_off']}  updates {s['updates']}")
    return summary


def write_outputs(out: Path, meta: dict, rows: list[dict], notes: str | None) -> None:
    """OUT.json (every run) and OUT.md (the table, then the notes file)."""
    summary = summarize(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "runs": rows}, indent=1) + "\n")
    md = ["# The learner's cost to the serving core: thread or process (learner_contention)",
          "", f"Command ({meta['date']}, {meta['cpu']} CPUs): `{meta['command']}`", "",
          "| mode | runs | decode step with / without the learner, median (min-max) | "
          "learner updates per run |", "|---|---|---|---|"]
    md += [f"| {m} | {sum(x['mode'] == m for x in rows)} | {s['ratio_on_off']} | "
           f"{s['updates']} |" for m, s in summary.items()]
    if notes:
        md += ["", Path(notes).read_text().rstrip()]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", help="prompt file whose features feed the learner")
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--modes", default="thread,thread-si,process,gil")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=240, help="decode steps per run")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--notes", default=None, help="a markdown file appended to OUT.md (the "
                    "reading of the figures, written by hand)")
    ap.add_argument("--render", default=None, help="re-write --out from this saved OUT.json "
                    "(e.g. after editing --notes) without running anything")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a single run (child)
    a = ap.parse_args()
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        write_outputs(Path(a.out or Path(a.render).with_suffix("")), saved["meta"], saved["runs"],
                      a.notes)
        return 0
    if not a.prompts:
        raise SystemExit("learner_contention: --prompts is required (a prompt file)")
    if a.one:
        print(json.dumps(one_run(a.one, a.prompts, a.max_prompts, a.steps)), flush=True)
        os._exit(0)  # the spawned helpers are daemons: no waiting on them
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("learner_contention: needs 2 cores (decode on 0, learner on 1)")
    rows = []
    for r in range(a.repeats):  # modes interleaved: the VM's drift weighs on each alike
        for mode in a.modes.split(","):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--prompts", a.prompts,
                                  "--max-prompts", str(a.max_prompts), "--steps", str(a.steps)],
                                 capture_output=True, text=True)
            lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
            if out.returncode or not lines:
                raise SystemExit(f"{mode}: run failed: {out.stderr.strip().splitlines()[-1:]}")
            row = json.loads(lines[-1]) | {"repeat": r}
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
            "cpu": os.cpu_count(), "steps": a.steps, "repeats": a.repeats}
    if a.out:
        write_outputs(Path(a.out), meta, rows, a.notes)
    else:
        summarize(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
