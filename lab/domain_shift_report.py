"""Tables of the domain-shift benchmark (lab/domain_shift.sh) for docs/results.

    python lab/domain_shift_report.py --run runs/domain_shift --out docs/results
    python lab/domain_shift_report.py --run runs/domain_shift --best-lr   # prints the tuned lr

Reads RUN/<scenario>/seed-S/report.json (bench's per-seed reports; `tune` has one folder per lr)
and writes OUT/domain_shift.{json,md,png}: per scenario and arm the median and min-max over
seeds of tok/s, acceptance length (whole stream, first 20 requests, last quarter; aba: the
return to A), each against frozen and nospec, and the per-window series of every seed.
The lr is chosen on the `tune` stream only, by the online-ogd arm's acceptance length over the
whole stream; so is the learner's data use (LEARN_VARIANTS, scenario `tune-learn`: dense anchors,
replay, a larger lr with them); the other scenarios never feed back into either.

    python lab/domain_shift_report.py --run RUN --best-learn       # the chosen variant's name
    python lab/domain_shift_report.py --run RUN --learn-json NAME  # its onlinespec keys
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


# How the learner uses its data (sample efficiency), chosen on the tune stream. Keys are
# onlinespec config keys laid over the recipe and the lr; update.lr here overrides the tuned one.
LEARN_VARIANTS: dict[str, dict] = {
    # Each variant names both data-use keys: the bench's online settings (DEFAULT_ONLINE) already
    # hold replay and dense anchors, so a variant naming one key only would
    # inherit the other. "defaults" = DEFAULT_ONLINE as it stands.
    "defaults": {},
    "base": {"anchor_stride": None, "replay": False},  # blocks tile the fresh tokens, no replay
    "dense": {"anchor_stride": 1, "replay": False},  # every fresh token anchors a block
    "replay": {"anchor_stride": None, "replay": True},  # batches filled from recent trained tokens
    "dense+replay": {"anchor_stride": 1, "replay": True},
    "dense+replay@1e-3": {"anchor_stride": 1, "replay": True,
                          "update": {"lr": 1e-3}},  # larger steps
    # The learner's matmul dtype (learner_compute_dtype; the variants above use the default,
    # "auto": bf16 autocast where the CPU computes bf16 natively): float32 as before it existed.
    "replay+fp32": {"anchor_stride": None, "replay": True, "learner_compute_dtype": "float32"},
    "replay@1e-3": {"anchor_stride": None, "replay": True, "update": {"lr": 1e-3}},
    # Each publish loads and re-packs vLLM's drafter weights on the engine thread (~10 ms on
    # the 2-core box): every update against every 4th (DEFAULT_ONLINE's).
    "replay+publish-every-1": {"anchor_stride": None, "replay": True,
                               "publish": {"every_n_updates": 1}},
    "replay+publish-every-4": {"anchor_stride": None, "replay": True,
                               "publish": {"every_n_updates": 4}},
    # How much of the wall time the learner may be busy (DEFAULT_ONLINE: 0.25).
    "share-0.8": {"pacing": {"learner_cpu_share": 0.8}},
}


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
            "learner_updates": s.get("learner_updates", 0),
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
    """Rows of the tune stream: kind "lr" (online-ogd at each lr), "learn" (a LEARN_VARIANTS
    entry, `lr` then the lr it ran with), "frozen"; each with the updates its learner made."""
    rows = []
    for kind, arm, folders in (("lr", "online-ogd", "lr-*"), ("learn", "online-ogd", "learn-*"),
                               ("frozen", "frozen", "frozen")):
        for d in sorted((run / "tune").glob(folders)):
            for s, rep in seed_reports(d).items():
                r = next((v for k, v in arm_rows(rep).items() if k.split("+")[0] == arm), None)
                if r is None:
                    continue
                name = d.name.split("-", 1)[1] if kind != "frozen" else "frozen"
                online = rep.get("meta", {}).get("online") or {}
                rows.append({"kind": kind, "setting": name, "seed": s,
                             "lr": name if kind == "lr" else
                             online.get("update", {}).get("lr", online.get("lr", "-")) if kind == "learn" else "-",
                             "learner_updates": r["learner_updates"],
                             **{k: r[k] for k in FIGS[:4]}})
    return rows


def _best(run: Path, kind: str, what: str) -> str:
    rows = [r for r in tune_table(run) if r["kind"] == kind]
    if not rows:
        raise SystemExit(f"no tuning runs ({kind}) under {run}/tune (run the `{what}` scenario or set "
                         f"{'LR' if kind == 'lr' else 'LEARN'})")
    return max(rows, key=lambda r: r["accept_len"])["setting"]


def best_lr(run: Path) -> str:
    return _best(run, "lr", "tune")


def best_learn(run: Path) -> str:
    return _best(run, "learn", "tune-learn")


def learn_variant(name: str) -> dict:
    if name not in LEARN_VARIANTS:
        raise SystemExit(f"unknown learn variant {name!r} (known: {', '.join(LEARN_VARIANTS)})")
    return LEARN_VARIANTS[name]


def cell(st: dict | None, fmt: str = ".2f", suffix: str = "") -> str:
    if not st:
        return "-"
    m, lo, hi = st["median"], st["min"], st["max"]
    return f"{format(m, fmt)}{suffix} ({format(lo, fmt)}-{format(hi, fmt)})" if st["n"] > 1 \
        else f"{format(m, fmt)}{suffix}"


def markdown(summary: dict, tune: list[dict], meta: dict) -> str:
    md = ["# Domain shift, continuous serving", "",
          f"Made by `lab/domain_shift.sh` then `lab/domain_shift_report.py` "
          f"({meta.get('date', '')}). Each cell: median (min-max) over the seeds (stream orders); "
          "ratios are per seed, on the same stream, then their median (min-max).", ""]
    if tune:
        md += [f"**Tuning** (the `tune` stream only; chosen: lr = {meta.get('lr')}, learner data "
               f"use = {meta.get('learn')}, each by online-ogd's acceptance length over the "
               "stream; learn variants: lab/domain_shift_report.py LEARN_VARIANTS):", "",
               "| setting | lr | seed | tok/s | accept len | first 20 | last quarter | updates |",
               "|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['kind']} {r['setting'] if r['kind'] != 'frozen' else ''} | {r['lr']} | "
               f"{r['seed']} | {r['tok_s']:.1f} | {r['accept_len']:.3f} | "
               f"{r['accept_len_first_20']:.3f} | {r['accept_len_last_quarter']:.3f} | "
               f"{r['learner_updates']} |" for r in tune]
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
    ap.add_argument("--best-learn", action="store_true",
                    help="print the learn variant chosen on `tune-learn` and exit")
    ap.add_argument("--learn-json", metavar="NAME", help="print the onlinespec keys of a learn "
                    "variant (LEARN_VARIANTS) as JSON and exit")
    ap.add_argument("--notes", help="a markdown file whose text follows the page's header (the "
                    "reading of the figures, what was not run)")
    a = ap.parse_args(argv)
    run = Path(a.run)
    if a.best_lr:
        print(best_lr(run))
        return 0
    if a.best_learn:
        print(best_learn(run))
        return 0
    if a.learn_json:
        print(json.dumps(learn_variant(a.learn_json)))
        return 0
    import datetime

    summary = {sc: scenario_summary(seed_reports(run / sc)) for sc in ("shifted", "own", "aba")
               if seed_reports(run / sc)}
    tune = tune_table(run)
    meta = {"date": datetime.date.today().isoformat(), "run": str(run),
            "lr": best_lr(run) if any(r["kind"] == "lr" for r in tune) else
            ((served_settings(run).get("online") or {}).get("update") or {}).get("lr"),
            "learn": best_learn(run) if any(r["kind"] == "learn" for r in tune) else None,
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
