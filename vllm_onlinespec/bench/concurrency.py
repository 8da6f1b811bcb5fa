"""Concurrency benchmark: `vllm serve` per arm, `vllm bench serve` at several
concurrencies, vLLM's own client and dataset loader (`--dataset-name spec_bench`).

    vllm-onlinespec bench-serve --spec-bench question.jsonl --arms nospec,fixed,adaflash,budget \\
        --concurrency 1,4,16,32 --out runs/concurrency

Per arm: one server (SmolLM2 + the drafter, online learning on for the speculative arms), then
for each concurrency C one `vllm bench serve` run with --max-concurrency C; /metrics is scraped
before and after each run, so the spec counters are per point. The server keeps learning across
the points of one arm (they run in the order given), as it would in production.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from vllm_onlinespec.bench.arm_catalog import clear_own_checkpoints
from vllm_onlinespec.bench.results import ArmSpec
from vllm_onlinespec.engine import SAME_RUNNER_ENV
from vllm_onlinespec.presets import PRESETS
from vllm_onlinespec.serving_dtype import resolve_dtype_arg

SERVED_NAME = "onlinespec-bench"
COUNTERS = {
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
    "verify_tokens": "onlinespec:verify_tokens_total",
    "proposed_tokens": "onlinespec:draft_tokens_total",
    "version": "onlinespec:drafter_version",
}


@dataclass
class Point:
    arm: str
    concurrency: int
    repeat: int  # 0-based: the same prompts again (a timing repeat)
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    output_tok_s: float
    mean_tpot_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    acceptance_length: float | None = None  # (accepted + drafts) / drafts, vLLM counters
    mean_verify_len: float | None = None  # onlinespec verify tokens per verify step
    verify_fraction: float | None = None  # verified / proposed draft tokens (policy cut)
    drafter_version: int | None = None  # at the end of the point
    # the budget's choice over the point (policy/option_choice.py): steps each option ran, and
    # each option's price per produced token at the end of the point, ms, by batch bucket
    option_steps: dict[str, float] | None = None
    option_ms_per_token: dict[str, float] | None = None


# -- server ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(spec: ArmSpec, port: int) -> list[str]:
    from vllm_onlinespec.engine import serve_args

    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", spec.target, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", spec.dtype, "--served-model-name", SERVED_NAME,
           *serve_args(max_model_len=spec.max_model_len)]
    if spec.speculative_config:
        cmd += ["--speculative-config", json.dumps(spec.speculative_config)]
    if spec.onlinespec is not None:
        cmd += ["--additional-config", json.dumps({"onlinespec": spec.onlinespec})]
    return cmd


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # lets the worker write its final checkpoint
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# labelled metrics kept apart by these labels ("name|tree", "name|tree@B8"): steps summed over
# workers (shares are what is read), prices averaged over them (tensor-parallel ranks each price)
OPTION_STEPS, OPTION_PRICE = "onlinespec:option_steps_total", "onlinespec:option_ms_per_token"


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each metric over its label sets (one engine, possibly several workers); the
    budget's option metrics also per option (and batch bucket)."""
    out: dict[str, float] = {}
    prices: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if not m or m.group(3) == "NaN":
            continue
        name, value = m.group(1), float(m.group(3))
        out[name] = out.get(name, 0.0) + value
        if name in (OPTION_STEPS, OPTION_PRICE):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            key = f"{name}|" + labels.get("option", "?") + (
                f"@B{labels['batch']}" if "batch" in labels else "")
            if name == OPTION_PRICE:
                prices.setdefault(key, []).append(value)
            else:
                out[key] = out.get(key, 0.0) + value
    out.update({k: sum(v) / len(v) for k, v in prices.items()})
    return out


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())


def option_figures(before: dict, after: dict) -> dict:
    """Steps each of the budget's options ran between two scrapes, and each option's price at
    the second (None for arms without the budget's choice)."""
    steps = {k.split("|", 1)[1]: v - before.get(k, 0.0) for k, v in after.items()
             if k.startswith(OPTION_STEPS + "|")}
    prices = {k.split("|", 1)[1]: v for k, v in after.items() if k.startswith(OPTION_PRICE + "|")}
    return {"option_steps": steps or None, "option_ms_per_token": prices or None}


def spec_figures(before: dict, after: dict) -> dict:
    d = {k: after.get(n, 0.0) - before.get(n, 0.0) for k, n in COUNTERS.items()}
    drafts = d["drafts"]
    # vLLM's own DFlash worker verifies what it drafts: its draft tokens are the verify tokens.
    verify = d["verify_tokens"] or d["draft_tokens"]
    return {"acceptance_length": (d["accepted"] + drafts) / drafts if drafts else None,
            "mean_verify_len": verify / drafts if drafts and verify else None,
            "verify_fraction": (d["verify_tokens"] / d["proposed_tokens"]
                                if d["proposed_tokens"] else None),
            "drafter_version": int(after[COUNTERS["version"]]) if COUNTERS["version"] in after
            else None, **option_figures(before, after)}


# -- client ---------------------------------------------------------------------------------------

def bench_point(url: str, spec: ArmSpec, dataset: Path, concurrency: int, num_prompts: int,
                output_len: int, result_dir: Path, log, repeat: int = 0) -> dict:
    name = f"{spec.name}-c{concurrency}-r{repeat}.json"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--base-url", url,
           "--model", SERVED_NAME, "--tokenizer", spec.target, "--dataset-name", "spec_bench",
           "--dataset-path", str(dataset), "--spec-bench-output-len", str(output_len),
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--seed", "0", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
           "--disable-tqdm", "--temperature", "0"]
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    path = result_dir / name
    if rc != 0 or not path.is_file():
        raise RuntimeError(f"vllm bench serve failed (exit code {rc}); see {log.name}")
    return json.loads(path.read_text())


VLLM_SPEC_BENCH_SEED = 0  # vLLM 0.32's spec_bench loader: random.seed(0), then shuffle


def drop_served(lines: list[str], n: int) -> list[str]:
    """The rows left when the first n of vLLM's spec_bench order are dropped: a run on them
    serves none of the n prompts a run on `lines` with --num-prompts n serves first."""
    import random

    order = list(range(len(lines)))
    random.Random(VLLM_SPEC_BENCH_SEED).shuffle(order)
    drop = set(order[:n])
    return [ln for i, ln in enumerate(lines) if i not in drop]


def fresh_dataset(dataset: Path, served: int, out: Path) -> Path:
    """`dataset` without the `served` prompts a point on it just served. Chained point after
    point, every prompt is served once per server: suffix trees that cache finished answers
    never see a prompt again, as in traffic that does not repeat."""
    lines = dataset.read_text(encoding="utf-8").splitlines(keepends=True)
    left = drop_served(lines, served)
    if not left:
        raise ValueError(f"--fresh-prompts: {dataset} has no prompt left after {served} more; "
                         f"serve fewer points per server (--repeats 1, --rounds N) or more prompts")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(left), encoding="utf-8")
    return out


def unseen_texts(drafter: str | Path) -> tuple[set[str], set[str]]:
    """(prompt texts the drafter held out, Spec-Bench categories its recipe excluded), from its
    heldout_prompts.jsonl and train_meta.json: what a benchmark may serve as never trained on."""
    d = Path(drafter)
    held, meta = d / "heldout_prompts.jsonl", d / "train_meta.json"
    if not held.is_file() or not meta.is_file():
        raise FileNotFoundError(f"--unseen-by {d}: needs heldout_prompts.jsonl and "
                                f"train_meta.json (a drafter trained by `vllm-onlinespec train`)")
    texts = {json.loads(ln)["messages"][0]["content"] for ln in held.read_text().splitlines()
             if ln.strip()}
    excluded = json.loads(meta.read_text()).get("excluded_categories") or ""
    cats = {c.strip() for c in (excluded if isinstance(excluded, str) else ",".join(excluded))
            .split(",") if c.strip()}
    return texts, cats


def write_dataset(spec_bench: str, out: Path, tokenizer_path: str, max_prompt_tokens: int,
                  skip_prompts: int = 0, unseen_by: str | None = None) -> Path:
    """Spec-Bench rows whose chat prompt fits max_prompt_tokens, in Spec-Bench's own format (so
    vLLM's spec_bench loader reads it): long RAG contexts would be mostly prefill on a CPU.

    vLLM serves the first n rows of its fixed shuffle of this file. `skip_prompts` = N drops
    the first N rows of that order, so a run on the result serves none of the prompts a run on
    the whole file serves with n <= N (settings tuned on one, reported on the other).
    `unseen_by` (a drafter folder): only rows that drafter never trained on (its held-out
    prompts and the categories its recipe excluded)."""

    from transformers import AutoTokenizer

    from vllm_onlinespec.training.data import load_spec_bench
    from vllm_onlinespec.training.generate import chat_ids

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    keep = {p.text for p in load_spec_bench(spec_bench) if len(chat_ids(tok, p)) <= max_prompt_tokens}
    held, cats = unseen_texts(unseen_by) if unseen_by else (None, None)
    with open(spec_bench, encoding="utf-8") as src:
        lines = [ln if ln.endswith("\n") else ln + "\n" for ln in src
                 if ln.strip() and json.loads(ln)["turns"][0] in keep]
    if held is not None:
        rows = [(ln, json.loads(ln)) for ln in lines]
        lines = [ln for ln, r in rows if r["turns"][0] in held or r.get("category") in cats]
        if not lines:
            raise ValueError(f"--unseen-by {unseen_by}: no Spec-Bench prompt of {spec_bench} "
                             f"is one that drafter never trained on")
    if skip_prompts:
        n_fit = len(lines)
        lines = drop_served(lines, skip_prompts)
        if not lines:
            raise ValueError(f"--skip-prompts {skip_prompts} leaves no prompt of the "
                             f"{n_fit} that fit --max-prompt-tokens")
    path = out / "spec_bench_filtered.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def run_arm(spec: ArmSpec, dataset: Path, concurrencies: list[int], prompts_for, output_len: int,
            out: Path, repeats: int = 1, first_repeat: int = 0, fresh: bool = False) -> list[Point]:
    """One server for the arm; the whole concurrency sweep `repeats` times, so that a slow
    drift of the machine spreads over every point rather than biasing one. Every repeat serves
    the same prompts: vLLM 0.32's spec_bench loader shuffles with a fixed seed (it does not
    read --seed), so a point's spread is timing noise, not prompt choice. `fresh`: each point
    serves prompts no earlier point of this server served (fresh_dataset)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    points: list[Point] = []
    clear_own_checkpoints(spec)
    mode = "w" if first_repeat == 0 else "a"  # a later round's server appends to the round's logs
    with open(logs / f"{spec.name}.serve.log", mode) as slog, \
            open(logs / f"{spec.name}.bench.log", mode) as blog:
        proc = subprocess.Popen(serve_cmd(spec, port), stdout=slog, stderr=subprocess.STDOUT,
                                env={**os.environ, **SAME_RUNNER_ENV, "VLLM_LOGGING_LEVEL": "INFO"})
        try:
            wait_healthy(url, proc)
            plan = [(rep, c) for rep in range(first_repeat, first_repeat + repeats)
                    for c in concurrencies]
            data = dataset
            for rep, c in tqdm(plan, desc=f"{spec.name:>12}", unit="pt", leave=True):
                n = prompts_for(c)
                before = scrape(url)
                r = bench_point(url, spec, data, c, n, output_len, out / "raw", blog, rep)
                if fresh:
                    data = fresh_dataset(data, n, out / "fresh" / f"{spec.name}-r{rep}-c{c}.jsonl")
                figs = spec_figures(before, scrape(url))
                points.append(Point(
                    arm=spec.name, concurrency=c, repeat=rep, num_prompts=n,
                    completed=r["completed"],
                    failed=r.get("failed", n - r["completed"]), duration_s=r["duration"],
                    output_tok_s=r["output_throughput"], mean_tpot_ms=r["mean_tpot_ms"],
                    p50_tpot_ms=r.get("p50_tpot_ms", r["median_tpot_ms"]),
                    p99_tpot_ms=r["p99_tpot_ms"], **figs))
                tqdm.write(f"{spec.name} C={c} repeat {rep}: {r['output_throughput']:.1f} tok/s, "
                           f"TPOT p50 {points[-1].p50_tpot_ms:.0f} ms, "
                           f"accept len {figs['acceptance_length'] or 1:.2f}")
        finally:
            stop(proc)
    return points


# -- report ---------------------------------------------------------------------------------------

@dataclass
class Row:
    """One (arm, C) over its repeats: medians, throughput's spread, failures summed."""
    arm: str
    concurrency: int
    repeats: int
    num_prompts: int  # per repeat
    failed: int  # over all repeats
    tok_s: float  # median output tok/s
    tok_s_min: float
    tok_s_max: float
    tpot_p50_ms: float  # median over repeats of each repeat's p50 (likewise p99)
    tpot_p99_ms: float
    acceptance_length: float | None
    mean_verify_len: float | None
    verify_fraction: float | None
    vs_nospec: float | None  # median tok/s over the nospec arm's median at the same C
    vs_best_other: float | None  # over the best other arm's median at the same C
    # min, max over repeats of tok/s over the same repeat's nospec (a round runs every arm's
    # repeat r back to back, so these pairs share the box's state)
    vs_nospec_spread: tuple[float, float] | None = None
    choice: dict[str, float] | None = None  # share of steps each of the budget's options ran
    # each option's price in C's batch bucket at the end of each repeat, median, ms per token
    option_ms_per_token: dict[str, float] | None = None


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def choice_shares(points: list[Point]) -> dict[str, float] | None:
    """Share of the steps each of the budget's options ran, over these points."""
    steps: dict[str, float] = {}
    for p in points:
        for o, n in (p.option_steps or {}).items():
            steps[o] = steps.get(o, 0.0) + n
    total = sum(steps.values())
    return {o: round(n / total, 4) for o, n in sorted(steps.items())} if total > 0 else None


def bucket_prices(points: list[Point], concurrency: int) -> dict[str, float] | None:
    """Median over points of each option's price in the batch bucket C fills."""
    from vllm_onlinespec.policy.cycle_overhead import batch_bucket

    tag = f"@B{batch_bucket(concurrency)}"
    per: dict[str, list[float]] = {}
    for p in points:
        for key, ms in (p.option_ms_per_token or {}).items():
            if key.endswith(tag):
                per.setdefault(key[: -len(tag)], []).append(ms)
    return {o: round(_median(v), 3) for o, v in sorted(per.items())} or None


def summarize(points: list[Point]) -> list[Row]:
    groups: dict[tuple[str, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.arm, p.concurrency), []).append(p)
    med = {k: _median([p.output_tok_s for p in ps]) for k, ps in groups.items()}
    base = {(p.concurrency, p.repeat): p.output_tok_s for p in points if p.arm == "nospec"}
    rows = []
    for (arm, c), ps in groups.items():
        others = [v for (a, c2), v in med.items() if c2 == c and a != arm]
        nospec = med.get(("nospec", c))
        paired = [p.output_tok_s / base[(c, p.repeat)] for p in ps
                  if arm != "nospec" and base.get((c, p.repeat))]
        rows.append(Row(
            arm=arm, concurrency=c, repeats=len(ps), num_prompts=ps[0].num_prompts,
            failed=sum(p.failed for p in ps), tok_s=med[(arm, c)],
            tok_s_min=min(p.output_tok_s for p in ps), tok_s_max=max(p.output_tok_s for p in ps),
            tpot_p50_ms=_median([p.p50_tpot_ms for p in ps]),
            tpot_p99_ms=_median([p.p99_tpot_ms for p in ps]),
            acceptance_length=_median([p.acceptance_length for p in ps]),
            mean_verify_len=_median([p.mean_verify_len for p in ps]),
            verify_fraction=_median([p.verify_fraction for p in ps]),
            vs_nospec=med[(arm, c)] / nospec if nospec and arm != "nospec" else None,
            vs_best_other=med[(arm, c)] / max(others) if others else None,
            vs_nospec_spread=(round(min(paired), 4), round(max(paired), 4)) if paired else None,
            choice=choice_shares(ps), option_ms_per_token=bucket_prices(ps, c)))
    return rows


def _choice(r: Row) -> str:
    if not r.choice:
        return "-"
    price = r.option_ms_per_token or {}
    return ", ".join(f"{o} {share:.2f}" + (f" ({price[o]:.1f} ms)" if o in price else "")
                     for o, share in r.choice.items())


def _f(x, fmt=".2f"):
    return "-" if x is None else format(x, fmt)


def markdown(points: list[Point]) -> str:
    """The summary over repeats, then every repeat's figures."""
    head = ("| arm | C | repeats | failed | output tok/s median (min-max) | vs nospec "
            "| vs nospec per repeat (min-max) | vs best other | TPOT p50 ms | TPOT p99 ms "
            "| accept len | mean verify len | verified/proposed "
            "| budget's choice (price in C's bucket, ms/token) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    summary = head + "\n".join(
        f"| {r.arm} | {r.concurrency} | {r.repeats} | {r.failed} | {r.tok_s:.1f} "
        f"({r.tok_s_min:.1f}-{r.tok_s_max:.1f}) | {_f(r.vs_nospec)} | "
        f"{'-' if r.vs_nospec_spread is None else '%.2f-%.2f' % r.vs_nospec_spread} | "
        f"{_f(r.vs_best_other)} | "
        f"{r.tpot_p50_ms:.1f} | {r.tpot_p99_ms:.1f} | {_f(r.acceptance_length)} | "
        f"{_f(r.mean_verify_len)} | {_f(r.verify_fraction)} | {_choice(r)} |"
        for r in summarize(points)) + "\n"
    head = ("| arm | C | repeat | prompts | failed | output tok/s | TPOT mean ms | TPOT p50 ms "
            "| TPOT p99 ms | accept len | mean verify len | verified/proposed | drafter version |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    raw = head + "\n".join(
        f"| {p.arm} | {p.concurrency} | {p.repeat} | {p.num_prompts} | {p.failed} | "
        f"{p.output_tok_s:.1f} | {p.mean_tpot_ms:.1f} | {p.p50_tpot_ms:.1f} | "
        f"{p.p99_tpot_ms:.1f} | {_f(p.acceptance_length)} | {_f(p.mean_verify_len)} | "
        f"{_f(p.verify_fraction)} | {_f(p.drafter_version, 'd')} |" for p in points) + "\n"
    return f"## Median over repeats\n\n{summary}\n## Every repeat\n\n{raw}"


def plot(points: list[Point], path: Path) -> Path:
    from vllm_onlinespec.bench.report import _plt

    plt = _plt()
    rows = summarize(points)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in dict.fromkeys(r.arm for r in rows):
        rs = sorted((r for r in rows if r.arm == arm), key=lambda r: r.concurrency)
        cs = [r.concurrency for r in rs]
        a1.errorbar(cs, [r.tok_s for r in rs], yerr=[[r.tok_s - r.tok_s_min for r in rs],
                                                      [r.tok_s_max - r.tok_s for r in rs]],
                    marker="o", capsize=3, label=arm)
        line, = a2.plot(cs, [r.tpot_p50_ms for r in rs], marker="o", label=f"{arm} p50")
        a2.plot(cs, [r.tpot_p99_ms for r in rs], marker="x", ls="--", color=line.get_color(),
                label=f"{arm} p99")
    for ax, yl in ((a1, "output tokens / s (median, min-max)"), (a2, "TPOT, ms (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("vllm bench serve, Spec-Bench")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- command line ---------------------------------------------------------------------------------

def add_bench_serve_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench-serve", help="`vllm serve` + `vllm bench serve` at several "
                       "concurrencies per arm", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a = b.add_argument
    a("--spec-bench", required=True, metavar="PATH", help="Spec-Bench question.jsonl")
    a("--arms", default="nospec,fixed,adaflash,budget", help="comma-separated arms")
    a("--concurrency", default="1,4,16,32", help="comma-separated max concurrencies")
    a("--num-prompts", type=int, default=None, help="prompts per point (default: max(8, "
      "round(prompts-per-c * C)))")
    a("--prompts-per-c", type=float, default=2.0, help="prompts per point per unit of "
      "concurrency, when --num-prompts is not given (default 2: the server stays full)")
    a("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    a("--max-prompt-tokens", type=int, default=512, help="skip longer Spec-Bench prompts")
    a("--skip-prompts", type=int, default=0, metavar="N", help="leave out the N prompts a "
      "sweep with at most N prompts per point serves (tune on the rest, report on those)")
    a("--fresh-prompts", action="store_true", help="every point serves prompts no earlier "
      "point of the same server served (default: every point starts from the same prompts, "
      "so a suffix tree's cache of finished answers sees repeats); needs repeats x the "
      "prompts of one sweep <= the prompts there are")
    a("--unseen-by", metavar="DRAFTER", help="serve only the Spec-Bench prompts this drafter "
      "folder never trained on (its heldout_prompts.jsonl and the categories its recipe "
      "excluded), so acceptance is measured on unseen prompts")
    a("--drafter", help="DFlash drafter folder (default: the one shipped for --target)")
    a("--target", default="smollm2-135m")
    a("--dtype", default="auto", type=resolve_dtype_arg,
      help="auto (default: bfloat16 where the hardware computes it natively, a GPU or an "
      "AVX512-BF16/AMX CPU, ~1.7x faster than float32 there; float32 elsewhere: an AVX2 CPU "
      "emulates bf16, 2.6x slower), bfloat16, or float32 (greedy output then identical across "
      "arms, token for token)")
    a("--preset", default="cpu", choices=[*sorted(PRESETS), "none"],
      help="the settings every arm of ours starts from: 'cpu' (default) = the recommended CPU "
      "configuration (vllm_onlinespec/presets.py: learner settings, budget verify policy, "
      "suffix-tree lookup at K = 16), so `frozen` is that recipe with learning off; 'none' = "
      "the learner's settings with the config's serving defaults (fixed K, no lookup)")
    a("--online", default="{}", help="JSON merged into the learning arms' onlinespec settings")
    a("--k-per-batch-size", type=json.loads, default=None, metavar="JSON",
      help="vLLM's per-batch-size K for the vllm-dynamic arm: [[first_bs, last_bs, K], ...]")
    a("--repeats", type=int, default=3, help="sweeps per arm and server over the same prompts "
      "(timing repeats; default 3)")
    a("--rounds", type=int, default=1, help="servers per arm: each round starts every arm's "
      "server once and runs --repeats sweeps on it, the arm order reversed on every other "
      "round, so the box's drift weighs on every arm alike (default 1)")
    a("--out", required=True)
    b.set_defaults(func=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    from vllm_onlinespec.bench.arm_catalog import (base_settings, make_arm, merge_sections,
                                                   needs_drafter)
    from vllm_onlinespec.bench.launch import counterbalanced
    from vllm_onlinespec.models import ModelError, resolve, shipped_drafter

    out = Path(args.out)
    target = resolve(args.target)
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    drafter = args.drafter
    if drafter is None and any(needs_drafter(a) for a in arms):
        try:
            drafter = str(shipped_drafter(args.target))
        except ModelError as e:
            raise FileNotFoundError(f"--drafter: none given and {e}") from None
    if drafter is not None and not (Path(drafter) / "config.json").is_file():
        raise FileNotFoundError(f"--drafter {drafter}: no config.json there")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    online = merge_sections(base_settings(args.preset), json.loads(args.online))
    dataset = write_dataset(args.spec_bench, out, target, args.max_prompt_tokens,
                            args.skip_prompts, args.unseen_by)
    points: list[Point] = []
    if args.repeats < 1 or args.rounds < 1:
        raise ValueError(f"--repeats and --rounds must be >= 1, got {args.repeats} and "
                         f"{args.rounds}")
    specs = [make_arm(name, target=target, prompts=str(dataset), out_dir=out, drafter=drafter,
                      online=online, dtype=args.dtype,
                      k_per_batch_size=args.k_per_batch_size if name == "vllm-dynamic" else None)
             for name in arms]  # every arm's settings are checked before the first server starts
    run_order = [[arms[i] for i in counterbalanced(len(arms), rnd)] for rnd in range(args.rounds)]
    prompts_for = lambda c: args.num_prompts or max(8, round(args.prompts_per_c * c))  # noqa: E731
    if args.fresh_prompts:
        need = args.repeats * sum(prompts_for(c) for c in concurrencies)
        have = len(dataset.read_text(encoding="utf-8").splitlines())
        if need > have:
            raise ValueError(f"--fresh-prompts: one server serves {need} prompts "
                             f"({args.repeats} repeats of {concurrencies}) but {have} are there")
    for rnd, order in enumerate(run_order):
        for name in order:
            try:
                points += run_arm(specs[arms.index(name)], dataset, concurrencies, prompts_for,
                                  args.output_len, out, args.repeats, rnd * args.repeats,
                                  args.fresh_prompts)
            except Exception as e:  # noqa: BLE001 - the other arms still run
                tqdm.write(f"{name}: FAILED: {e}")
            (out / "concurrency.json").write_text(json.dumps(
                {"arms": arms, "drafter": drafter, "online": online, "repeats": args.repeats,
                 "rounds": args.rounds, "run_order": run_order,
                 "k_per_batch_size": args.k_per_batch_size, "output_len": args.output_len,
                 "rows": [asdict(r) for r in summarize(points)],
                 "points": [asdict(p) for p in points]},
                indent=1))
    (out / "concurrency.md").write_text("# vllm bench serve, Spec-Bench\n\n" + markdown(points))
    print("\n" + markdown(points))
    if points:
        print(f"plot: {plot(points, out / 'concurrency.png')}")
    print(f"table: {out / 'concurrency.md'}")
    return 0 if {p.arm for p in points} == set(arms) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m vllm_onlinespec.bench.concurrency")
    add_bench_serve_parser(p.add_subparsers(dest="verb", required=True))
    ns = p.parse_args(["bench-serve", *sys.argv[1:]])
    sys.exit(ns.func(ns))
