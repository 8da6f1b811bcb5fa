"""Benchmark report: one JSON, one markdown table, PNG plots, under an output folder.

    report.json         every arm's spec, waves, requests and summary row
    report.md           the summary table (+ the run's settings)
    acceptance.png      acceptance length per wave for each speculative arm
    acceptance_requests.png   per-request acceptance length, rolling mean
    throughput.png      output tok/s per arm
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_onlinespec.bench.results import ArmResult


@dataclass
class Row:
    arm: str
    tok_s: float
    speedup: float | None  # tok/s relative to the nospec arm, when there is one
    tpot_ms: float
    acceptance_length: float  # over the whole stream (1.0 for nospec)
    early: float  # first half of the stream
    late: float  # second half
    first_20: float  # mean per-request acceptance length over the first 20 requests sent
    last_quarter: float  # ... over the last quarter of the requests
    drafter_version: int  # published at the end (learning arms)
    learner_updates: int
    output_tokens: int
    startup_s: float
    serve_s: float
    catch_up_s: float  # pauses for the learner between waves, not in tok/s
    error: str | None = None


def summarize(results: Sequence[ArmResult]) -> list[Row]:
    base = next((r.totals()["tok_s"] for r in results if r.spec.method == "none" and r.waves), None)
    rows = []
    for r in results:
        t = r.totals()
        early, late = r.halves()
        rows.append(Row(
            arm=r.name, tok_s=t["tok_s"], speedup=t["tok_s"] / base if base else None,
            tpot_ms=t["tpot_ms"], acceptance_length=t["acceptance_length"],
            early=early["acceptance_length"], late=late["acceptance_length"],
            first_20=request_acceptance(r, 0, 20),
            last_quarter=request_acceptance(r, -(-3 * len(r.requests) // 4), None),
            drafter_version=r.stats.published_version,
            learner_updates=r.stats.learner.updates if r.stats.learner is not None else 0,
            output_tokens=int(t["output_tokens"]), startup_s=r.startup_s, serve_s=r.serve_s,
            catch_up_s=sum(w.catch_up_s for w in r.waves), error=r.error))
    return rows


def request_acceptance(r: ArmResult, start: int, stop: int | None) -> float:
    """Mean per-request acceptance length over requests [start:stop] in sending order (NaN for
    arms without speculation)."""
    reqs = sorted(r.requests, key=lambda q: q.index)[start:stop]
    xs = [q.acceptance_length for q in reqs if q.acceptance_length is not None]
    return sum(xs) / len(xs) if xs else float("nan")


# -- several stream orders (seeds) -------------------------------------------------------------------

SEED_FIELDS = ("tok_s", "speedup", "tpot_ms", "acceptance_length", "first_20", "last_quarter",
               "early", "late")


@dataclass
class SeedRow:
    """One arm over several stream orders: per field the median and the (min, max)."""

    arm: str
    seeds: int
    median: dict[str, float]
    spread: dict[str, tuple[float, float]]
    failed_requests: int
    errors: list[str]


def median_spread(xs) -> tuple[float, float, float, int] | None:
    """(median, min, max, n) of the figures that are numbers (None and NaN left out); None
    when there is none."""
    import statistics

    xs = [x for x in xs if x is not None and x == x]
    return (statistics.median(xs), min(xs), max(xs), len(xs)) if xs else None


def summarize_seeds(per_seed: Sequence[Sequence[Row]], failed: Sequence[dict[str, int]] = ()
                    ) -> list[SeedRow]:
    """Rows of the same arms from several runs (one per seed) -> one SeedRow per arm."""
    arms = list(dict.fromkeys(r.arm for rows in per_seed for r in rows))
    out = []
    for arm in arms:
        rows = [r for rows in per_seed for r in rows if r.arm == arm]
        med, spread = {}, {}
        for k in SEED_FIELDS:
            st = median_spread(getattr(r, k) for r in rows)
            if st:
                med[k], spread[k] = st[0], (st[1], st[2])
        out.append(SeedRow(arm=arm, seeds=len(rows), median=med, spread=spread,
                           failed_requests=sum(f.get(arm, 0) for f in failed),
                           errors=[r.error for r in rows if r.error]))
    return out


def seeds_markdown(rows: Sequence[SeedRow]) -> str:
    def cell(r: SeedRow, k: str, fmt: str) -> str:
        if k not in r.median:
            return "-"
        lo, hi = r.spread[k]
        return f"{format(r.median[k], fmt)} ({format(lo, fmt)}-{format(hi, fmt)})"

    head = ("| arm | seeds | tok/s | vs nospec | accept len | first 20 requests | last quarter "
            "| TPOT ms | failed requests |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r.arm}{' (FAILED)' if r.errors else ''} | {r.seeds} | {cell(r, 'tok_s', '.1f')} | "
        f"{cell(r, 'speedup', '.2f')} | {cell(r, 'acceptance_length', '.2f')} | "
        f"{cell(r, 'first_20', '.2f')} | {cell(r, 'last_quarter', '.2f')} | "
        f"{cell(r, 'tpot_ms', '.1f')} | {r.failed_requests} |" for r in rows) + "\n"


def write_seed_report(rows: Sequence[SeedRow], out_dir: str | Path, *, seeds: Sequence[int],
                      meta: dict, title: str = "", notes: Sequence[str] = (),
                      results: Sequence[Sequence[ArmResult]] = ()) -> dict[str, Path]:
    """OUT/report.{json,md} over the seeds (each seed's own report is in OUT/seed-N/, or
    wherever the caller wrote it). `results`: every seed's arms, in `seeds` order, for one plot
    of per-request acceptance with a curve per arm and seed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(
        {"title": title, "meta": meta, "notes": list(notes), "seeds": list(seeds),
         "summary": [asdict(r) for r in rows],
         "per_seed": {str(s): str(out / f"seed-{s}" / "report.json") for s in seeds}},
        indent=1, default=str))
    title = title or f"vllm-onlinespec bench over {len(seeds)} stream orders"
    paths["markdown"].write_text(
        f"# {title}\n\nMedian (min-max) over {len(seeds)} stream orders (seeds "
        f"{', '.join(map(str, seeds))}); each order's table, windows and plots: "
        f"seed-N/report.md.\n\n" + seeds_markdown(rows) + "".join(f"\n- {n}" for n in notes)
        + "\n\n```json\n" + json.dumps(meta, indent=1, default=str) + "\n```\n")
    if results:
        import dataclasses

        named = [dataclasses.replace(r, spec=dataclasses.replace(r.spec, name=f"{r.name}, order {s}"))
                 for s, rs in zip(seeds, results) for r in rs]
        try:
            paths["acceptance_requests"] = plot_acceptance_requests(
                named, out / "acceptance_requests.png", title)
        except ImportError as e:  # matplotlib is a dev extra: the tables still stand
            print(f"report: no plots ({e})")
    return paths


def _f(x: float | None, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| arm | tok/s | vs nospec | TPOT ms | accept len | early | late | late - early "
            "| first 20 requests | last quarter | drafter version | output tokens "
            "| learner catch-up s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        spec = r.arm != "nospec"

        def acc(x: float, fmt: str = ".2f") -> str:
            return _f(x, fmt) if spec else "-"

        lines.append(
            f"| {r.arm}{' (FAILED)' if r.error else ''} | {_f(r.tok_s, '.1f')} | "
            f"{_f(r.speedup) + 'x' if r.speedup else '-'} | {_f(r.tpot_ms, '.1f')} | "
            f"{_f(r.acceptance_length) if spec else '1'} | {acc(r.early)} | {acc(r.late)} | "
            f"{acc(r.late - r.early, '+.2f')} | {acc(r.first_20)} | {acc(r.last_quarter)} | "
            f"{r.drafter_version or '-'} | {r.output_tokens} | {r.catch_up_s:.0f} |")
    return head + "\n".join(lines) + "\n"


STEP_PHASES = ("target", "sample", "draft", "ours", "other")


def step_markdown(results: Sequence[ArmResult]) -> str:
    """Where each arm's engine steps went (ms per step; the arms on this project's worker).
    `engine` is what the worker does not see: the stream's wall time per step minus the
    worker's phases (scheduler, engine-core <-> worker hand-off, the client threads, and any
    wait for a CPU the learner holds). The last two columns: the steps that began while the
    learner was inside an update, and their target forward's ms per scheduled token over the
    other steps', per batch bucket weighted by the other steps (what a busy learner costs a
    step, like for like)."""
    lines = []
    for r in results:
        prof = r.step_profile
        steps = int(prof.get("steps", 0)) if prof else 0
        if not steps:
            continue
        ms = prof["per_step_ms"]
        worker = 1e3 * (prof["target_s"] + prof["sample_tokens_s"]
                        + prof["ours_s"] - prof["ours_in_sample_tokens_s"]) / steps
        wall = 1e3 * r.totals()["wall_s"] / steps
        busy = r.stats.learner.busy_s if r.stats.learner is not None else 0.0
        split = prof.get("learner", {})
        n_busy = int(sum(v[0] for k, v in split.items() if k.startswith("busy")))
        cost = prof.get("learner_cost", {}).get("all")
        lines.append(f"| {r.name} | {steps} | {wall:.1f} | "
                     + " | ".join(f"{ms[k]:.2f}" for k in STEP_PHASES)
                     + f" | {wall - worker:.2f} | {busy:.1f} | {n_busy if split else '-'} | "
                     + (f"{cost:.3f}x" if cost is not None else "-") + " |")
    if not lines:
        return ""
    head = ("| arm | engine steps | wall ms/step | target | sample | draft | ours | runner other "
            "| engine | learner busy s | steps begun in an update | target ms per token, "
            "those / the rest |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(lines) + "\n"


def text_table(rows: Sequence[Row]) -> str:
    """The same figures for a terminal."""
    out = [f"{'arm':<20} {'tok/s':>7} {'vs nospec':>9} {'accept len':>10} {'early':>6} "
           f"{'late':>6} {'version':>7}"]
    for r in rows:
        spec = r.arm != "nospec"
        out.append(f"{r.arm:<20} {_f(r.tok_s, '.1f'):>7} "
                   f"{(_f(r.speedup) + 'x') if r.speedup else '-':>9} "
                   f"{_f(r.acceptance_length) if spec else '1':>10} "
                   f"{_f(r.early) if spec else '-':>6} {_f(r.late) if spec else '-':>6} "
                   f"{r.drafter_version or '-':>7}" + ("  FAILED: " + r.error if r.error else ""))
    return "\n".join(out)


# -- plots ------------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance_waves(results: Sequence[ArmResult], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r.spec.method == "none" or not r.waves:
            continue
        x, served = [], 0
        for w in r.waves:
            served += w.prompts
            x.append(served)
        ax.plot(x, [w.acceptance_length for w in r.waves], marker="o", ms=3, label=r.name)
    return _finish(fig, ax, path, title, "requests served",
                   "mean acceptance length per wave\n(tokens per verify step)")


def _finish(fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def rolling(xs: Sequence[float], n: int) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc.append(x)
        if len(acc) > n:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_acceptance_requests(results: Sequence[ArmResult], path: Path, title: str,
                             window: int = 8) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        pts = [(q.index, q.acceptance_length) for q in r.requests if q.acceptance_length]
        if not pts:
            continue
        xs, ys = zip(*sorted(pts))
        line, = ax.plot(xs, rolling(ys, window), label=f"{r.name} (rolling mean of {window})")
        ax.scatter(xs, ys, s=6, alpha=0.25, color=line.get_color())
    return _finish(fig, ax, path, title, "request, in serving order (each prompt new)",
                   "acceptance length (tokens per verify step)")


def plot_throughput(rows: Sequence[Row], path: Path, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 4))
    bars = ax.bar([r.arm for r in rows], [r.tok_s for r in rows], color="tab:blue")
    for b, r in zip(bars, rows):
        ax.annotate(f"{r.tok_s:.1f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s (serving time)")
    ax.set_title(title)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(results: Sequence[ArmResult], out_dir: str | Path, *, title: str,
                 meta: dict | None = None, notes: Sequence[str] = ()) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(
        {"title": title, "meta": meta or {}, "notes": list(notes),
         "summary": [asdict(r) for r in rows], "arms": [r.to_json() for r in results]},
        indent=1, default=str))
    md = [f"# {title}", "", markdown_table(rows)]
    md += [f"- {n}" for n in notes]
    steps = step_markdown(results)
    if steps:
        md += ["", "Where the engine steps went (ms per step, over the whole stream):", "", steps]
    if meta:
        md += ["", "Settings:", "", "```json", json.dumps(meta, indent=1, default=str), "```"]
    paths["markdown"].write_text("\n".join(md) + "\n")
    try:
        paths["acceptance"] = plot_acceptance_waves(results, out / "acceptance.png", title)
        paths["acceptance_requests"] = plot_acceptance_requests(
            results, out / "acceptance_requests.png", title)
        paths["throughput"] = plot_throughput(rows, out / "throughput.png", title)
    except ImportError as e:  # matplotlib is a dev extra: the tables still stand
        print(f"report: no plots ({e})")
    return paths
