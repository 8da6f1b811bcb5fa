"""Tables of the domain-shift benchmark (benchmarks/domain_shift.sh) for docs/results.

    python benchmarks/domain_shift_report.py --run runs/domain_shift --out docs/results
    python benchmarks/domain_shift_report.py --run runs/domain_shift --best-lr   # prints the tuned lr

Reads RUN/<scenario>/seed-S/report.json (bench's per-seed reports; `tune` has one folder per lr)
and writes OUT/domain_shift.{json,md,png}: per scenario and arm the median and min-max over
seeds of tok/s, acceptance length (whole stream, first 20 requests, last quarter; aba: the
return to A), each against frozen and nospec, and the per-window series of every seed.
The lr is chosen on the `tune` stream only, by the online-ogd arm's acceptance length over the
whole stream; the other scenarios never feed back into it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_onlinespec.bench.report import median_spread

SCENARIOS = {"shifted": "math word problems the drafter never saw (reported stream, not tuned on)",
             "own": "held-out prompts of the drafter's own training domain",
             "aba": "own half -> shifted -> other own half (the return to A measures forgetting)",
             "tune": "the tuning stream (other math word problems): where lr was chosen"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def per_request_acceptance(arm: dict, keep) -> float:
    xs = [q["acceptance_length"] for q in sorted(arm["requests"], key=lambda q: q["index"])
          if q.get("acceptance_length") is not None and keep(q)]
    return sum(xs) / len(xs) if xs else float("nan")


def return_to_a(arm: dict) -> float:
    last_b = max((q["index"] for q in arm["requests"] if q["category"].startswith("B:")), default=-1)
    return per_request_acceptance(arm, lambda q: q["index"] > last_b)


def arm_rows(report: dict) -> dict[str, dict]:
    """arm -> the figures of one seed."""
    out = {}
    for s, arm in zip(report["summary"], report["arms"]):
        out[s["arm"]] = {
            "tok_s": s["tok_s"], "accept_len": s["acceptance_length"],
            "accept_len_first_20": s["first_20"], "accept_len_last_quarter": s["last_quarter"],
            "accept_len_return_to_a": return_to_a(arm) if any(
                q["category"].startswith("B:") for q in arm["requests"]) else None,
            "drafter_version": s["drafter_version"], "failed_requests": len(arm.get("failed", [])),
            "error": s["error"], "requests": len(arm["requests"]),
            "windows": [{"t_start_s": w.get("t_start_s"), "tok_s": w["tok_s"],
                         "accept_len": w["acceptance_length"], "requests": w["prompts"],
                         "version": w["version_end"]} for w in arm["waves"]]}
    return out


def seed_reports(folder: Path) -> dict[str, dict]:
    """seed -> report.json of a scenario folder (seed-S/ subfolders, or one report)."""
    seeds = {p.parent.name.removeprefix("seed-"): load(p) for p in sorted(folder.glob("seed-*/report.json"))}
    if not seeds and (folder / "report.json").is_file():
        rep = load(folder / "report.json")
        seeds = {str(rep["meta"].get("seed", 0)): rep}
    return seeds


def _stat(xs: list) -> dict | None:
    st = median_spread(xs)
    return None if st is None else dict(zip(("median", "min", "max", "n"), st))


FIGS = ("tok_s", "accept_len", "accept_len_first_20", "accept_len_last_quarter",
        "accept_len_return_to_a")


def base_arm(arm: str, base: str) -> str:
    """The arm `arm` is compared with: nospec, or the frozen drafter served the same way
    (online-ogd+lookup -> frozen+lookup: only learning differs)."""
    if base == "nospec":
        return base
    return base + arm[arm.index("+"):] if "+" in arm else base


def scenario_summary(seeds: dict[str, dict]) -> dict:
    per_seed = {s: arm_rows(rep) for s, rep in seeds.items()}
    arms = list(dict.fromkeys(a for rows in per_seed.values() for a in rows))
    out = {}
    for arm in arms:
        rows = [rows[arm] for rows in per_seed.values() if arm in rows]
        d = {k: _stat([r[k] for r in rows]) for k in FIGS}
        for base in ("frozen", "nospec"):  # ratios per seed (same stream), then their spread
            for k in ("tok_s", "accept_len", "accept_len_first_20", "accept_len_last_quarter",
                      "accept_len_return_to_a"):
                if arm == "nospec":  # no acceptance; its speed vs frozen is frozen's row
                    d[f"{k}_vs_{base}"] = None
                    continue
                if base == "nospec" and k != "tok_s":
                    continue
                b = base_arm(arm, base)
                d[f"{k}_vs_{base}"] = _stat([
                    rows_s[arm][k] / rows_s[b][k] for rows_s in per_seed.values()
                    if arm in rows_s and b in rows_s and rows_s[arm][k] and rows_s[b][k]])
        d["failed_requests"] = sum(r["failed_requests"] for r in rows)
        d["errors"] = [r["error"] for r in rows if r["error"]]
        d["per_seed"] = {s: rows_s[arm] for s, rows_s in per_seed.items() if arm in rows_s}
        out[arm] = d
    return out


def tune_table(run: Path) -> list[dict]:
    rows = []
    for d in sorted((run / "tune").glob("lr-*")):
        for s, rep in seed_reports(d).items():
            rows_s = arm_rows(rep)
            r = next((v for k, v in rows_s.items() if k.split("+")[0] == "online-ogd"), None)
            if r:
                rows.append({"lr": d.name.removeprefix("lr-"), **{k: r[k] for k in FIGS[:4]}})
    fz = seed_reports(run / "tune" / "frozen")
    for s, rep in fz.items():
        r = next((v for k, v in arm_rows(rep).items() if k.split("+")[0] == "frozen"), None)
        if r:
            rows.append({"lr": "frozen", **{k: r[k] for k in FIGS[:4]}})
    return rows


def best_lr(run: Path) -> str:
    rows = [r for r in tune_table(run) if r["lr"] != "frozen"]
    if not rows:
        raise SystemExit(f"no tuning runs under {run}/tune (run the `tune` scenario or set LR)")
    return max(rows, key=lambda r: r["accept_len"])["lr"]


def cell(st: dict | None, fmt: str = ".2f", suffix: str = "") -> str:
    if not st:
        return "-"
    m, lo, hi = st["median"], st["min"], st["max"]
    return f"{format(m, fmt)}{suffix} ({format(lo, fmt)}-{format(hi, fmt)})" if st["n"] > 1 \
        else f"{format(m, fmt)}{suffix}"


def markdown(summary: dict, tune: list[dict], meta: dict) -> str:
    md = ["# Domain shift, continuous serving (issue 14)", "",
          f"Made by `benchmarks/domain_shift.sh` then `benchmarks/domain_shift_report.py` "
          f"({meta.get('date', '')}). Each cell: median (min-max) over the seeds (stream orders); "
          "ratios are per seed, on the same stream, then their median (min-max).", ""]
    if tune:
        md += [f"**Tuning** (the `tune` stream only; chosen lr = {meta.get('lr')}, by online-ogd's "
               "acceptance length over the stream):", "",
               "| lr | tok/s | accept len | first 20 | last quarter |", "|---|---|---|---|---|"]
        md += [f"| {r['lr']} | {r['tok_s']:.1f} | {r['accept_len']:.3f} | "
               f"{r['accept_len_first_20']:.3f} | {r['accept_len_last_quarter']:.3f} |" for r in tune]
        md.append("")
    for sc, arms in summary.items():
        md += [f"## {sc}: {SCENARIOS.get(sc, '')}", "",
               "| arm | tok/s | vs nospec | vs frozen | accept len | vs frozen | first 20 requests "
               "| vs frozen | last quarter | vs frozen | return to A | vs frozen | failed |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, d in arms.items():
            md.append(
                f"| {arm}{' (ERROR)' if d['errors'] else ''} | {cell(d['tok_s'], '.1f')} | "
                f"{cell(d['tok_s_vs_nospec'], '.2f', 'x')} | {cell(d['tok_s_vs_frozen'], '.2f', 'x')} | "
                f"{cell(d['accept_len'])} | {cell(d['accept_len_vs_frozen'], '.2f', 'x')} | "
                f"{cell(d['accept_len_first_20'])} | {cell(d['accept_len_first_20_vs_frozen'], '.2f', 'x')} | "
                f"{cell(d['accept_len_last_quarter'])} | "
                f"{cell(d['accept_len_last_quarter_vs_frozen'], '.2f', 'x')} | "
                f"{cell(d['accept_len_return_to_a'])} | "
                f"{cell(d['accept_len_return_to_a_vs_frozen'], '.2f', 'x')} | {d['failed_requests']} |")
        md.append("")
    return "\n".join(md) + "\n"


def plot(summary: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    scs = [s for s in summary if s != "tune"]
    if not scs:
        return None
    fig, axes = plt.subplots(1, len(scs), figsize=(5 * len(scs), 4), squeeze=False)
    for ax, sc in zip(axes[0], scs):
        for arm, d in summary[sc].items():
            if arm == "nospec":
                continue
            for i, (s, r) in enumerate(sorted(d["per_seed"].items())):
                ws = [w for w in r["windows"] if w["accept_len"]]
                line, = ax.plot([w["t_start_s"] for w in ws], [w["accept_len"] for w in ws],
                                label=arm if i == 0 else None, alpha=0.8,
                                color=None if i == 0 else line.get_color(), ls="-" if i == 0 else ":")
        ax.set_title(sc)
        ax.set_xlabel("seconds into the stream (window start)")
        ax.set_ylabel("acceptance length per 20 s window")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def served_settings(run: Path) -> dict:
    """The arms' onlinespec settings, protocol and lengths of the first reported scenario."""
    for sc in ("shifted", "own", "aba"):
        for rep_ in seed_reports(run / sc).values():
            m = rep_.get("meta", {})
            return {k: m.get(k) for k in ("arms", "drafter", "protocol", "max_tokens", "dtype",
                                          "online")}
    return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--out")
    ap.add_argument("--best-lr", action="store_true", help="print the lr chosen on `tune` and exit")
    ap.add_argument("--notes", help="a markdown file whose text follows the page's header (the "
                    "reading of the figures, what was not run)")
    a = ap.parse_args(argv)
    run = Path(a.run)
    if a.best_lr:
        print(best_lr(run))
        return 0
    import datetime

    summary = {sc: scenario_summary(seed_reports(run / sc)) for sc in ("shifted", "own", "aba")
               if seed_reports(run / sc)}
    tune = tune_table(run)
    meta = {"date": datetime.date.today().isoformat(), "run": str(run),
            "lr": best_lr(run) if any(r["lr"] != "frozen" for r in tune) else None,
            "settings": served_settings(run)}
    out = Path(a.out or run)
    out.mkdir(parents=True, exist_ok=True)
    (out / "domain_shift.json").write_text(json.dumps(
        {"meta": meta, "tune": tune, "scenarios": summary}, indent=1, default=str))
    md = markdown(summary, tune, meta)
    if a.notes:
        head, _, rest = md.partition("\n\n")
        md = head + "\n\n" + Path(a.notes).read_text().strip() + "\n\n" + rest
    md += "\nSettings of the reported scenarios (bench's meta of one seed):\n\n```json\n" + \
        json.dumps(meta["settings"], indent=1) + "\n```\n"
    png = plot(summary, out / "domain_shift.png")
    if png:
        md += f"\n![acceptance per window](domain_shift.png)\n"
    (out / "domain_shift.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
