"""One results page from lab/target_shift.sh: per scenario and arm, medians over the two
stream orders (min-max), the acceptance early and late, each arm's per-window series, the
goals' figures, and a plot of acceptance over the stream.

    python lab/target_shift_report.py --run runs/target_shift --out docs/results

Reads RUN/<scenario>/report.json (`vllm-onlinespec bench --seeds 0,1`: the medians) and
RUN/<scenario>/seed-S/report.json (the windows). Writes OUT/target_shift.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCENARIOS = ("finetuned", "swap", "in_domain", "cold_start")
ARM_NAMES = {"nospec": "nospec", "ngram": "ngram", "vllm-suffix": "suffix", "frozen": "frozen",
             "online-ogd": "online"}
ARM_ORDER = ("nospec", "ngram", "suffix", "frozen", "online")
SMOOTH = 8  # requests per point of the plot's moving average


def scenario_rows(folder: Path, scenario: str) -> list[dict]:
    """One row per arm: medians over the orders, spreads, and each order's window series."""
    summary = json.loads((folder / "report.json").read_text())
    series: dict[str, list[list[dict]]] = {}
    swaps: dict[str, list[float]] = {}  # arm -> the swap's time in each order
    per_request: dict[str, list[list[float]]] = {}  # arm -> acceptance per request, finish order
    for seed in summary["seeds"]:
        run = json.loads((folder / f"seed-{seed}" / "report.json").read_text())
        for arm in run["arms"]:
            name = ARM_NAMES.get(arm["spec"]["name"])
            if name:
                series.setdefault(name, []).append(
                    [{"t_s": round(w["t_start_s"], 1), "tok_s": round(w["tok_s"], 2),
                      "accept_len": round(w["acceptance_length"], 3),
                      "drafts": w.get("drafts", 0), "accepted": w.get("accepted", 0),
                      "version": w.get("version_end")} for w in arm["waves"]])
                if arm.get("swap"):
                    swaps.setdefault(name, []).append(arm["swap"]["t_s"])
                done = sorted((r for r in arm.get("requests", [])
                               if r.get("finish_s") is not None
                               and r.get("acceptance_length") is not None),
                              key=lambda r: r["finish_s"])
                per_request.setdefault(name, []).append(
                    [round(r["acceptance_length"], 3) for r in done])
    rows = []
    for s in summary["summary"]:
        name = ARM_NAMES.get(s["arm"])
        if name is None:
            continue
        med, spread = s["median"], s["spread"]
        rows.append({"scenario": scenario, "arm": name, "orders": s["seeds"],
                     "tok_s": med["tok_s"], "tok_s_spread": spread["tok_s"],
                     "vs_nospec": med.get("speedup"), "vs_nospec_spread": spread.get("speedup"),
                     "accept_len": med["acceptance_length"],
                     "accept_len_first_20": med.get("first_20"),
                     "accept_len_last_quarter": med.get("last_quarter"),
                     "failed_requests": s["failed_requests"], "windows": series.get(name, []),
                     "per_request": per_request.get(name, []),
                     **around_swap(series.get(name, []), swaps.get(name, []))})
    rows.sort(key=lambda r: ARM_ORDER.index(r["arm"]))
    return rows


def _accept(windows: list[dict]) -> float | None:
    drafts = sum(w["drafts"] for w in windows)
    return (sum(w["accepted"] for w in windows) + drafts) / drafts if drafts else None


def around_swap(orders: list[list[dict]], swap_t: list[float]) -> dict:
    """Acceptance (tokens per verify step) in the windows before the swap, in the first window
    after it and over the last quarter of the stream's windows: medians over the orders."""
    if not swap_t or len(swap_t) != len(orders):
        return {}
    before, first, last = [], [], []
    for ws, t in zip(orders, swap_t):
        pre = [w for w in ws if w["t_s"] < t - 1e-6]
        post = [w for w in ws if w["t_s"] >= t - 1e-6]
        before.append(_accept(pre))
        first.append(_accept(post[:1]))
        last.append(_accept(post[-max(1, len(post) // 4):]))

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    return {"swap_t_s": med(swap_t), "accept_len_before_swap": med(before),
            "accept_len_first_window_after_swap": med(first),
            "accept_len_last_quarter_after_swap": med(last)}


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, each with the figure it is judged on (None where not measured)."""
    by = {(r["scenario"], r["arm"]): r for r in rows}
    out = []
    fr, on = by.get(("finetuned", "frozen")), by.get(("finetuned", "online"))
    if fr and on:
        late = on["accept_len_last_quarter"] / fr["accept_len_last_quarter"]
        tok = on["tok_s"] / fr["tok_s"]
        out.append(f"finetuned: online acceptance over the last quarter {late:.3f}x frozen "
                   f"(goal >= 1.25x), whole-stream tok/s {tok:.3f}x frozen (goal >= 1.1x)")
    fr, on = by.get(("swap", "frozen")), by.get(("swap", "online"))
    if fr and on and fr.get("accept_len_before_swap") and on.get("accept_len_last_quarter_after_swap"):
        cost = fr["accept_len_before_swap"] - fr["accept_len_last_quarter_after_swap"]
        won = on["accept_len_last_quarter_after_swap"] - fr["accept_len_last_quarter_after_swap"]
        what = (f"recovered {won / cost:.0%} of what the swap cost" if cost > 0 else
                "the swap cost frozen no acceptance, so there was nothing to recover")
        out.append(f"swap: frozen {fr['accept_len_before_swap']:.3f} before the swap, "
                   f"{fr['accept_len_last_quarter_after_swap']:.3f} over the last quarter after "
                   f"it; online {on['accept_len_last_quarter_after_swap']:.3f}: {what} "
                   f"(goal >= 80 % within 200 requests)")
    fr, on = by.get(("in_domain", "frozen")), by.get(("in_domain", "online"))
    if fr and on:
        out.append(f"in_domain: online tok/s {on['tok_s'] / fr['tok_s']:.3f}x frozen "
                   f"(goal >= 0.98x)")
    ns = by.get(("cold_start", "nospec"))
    if ns:
        base = statistics.median(w["tok_s"] for order in ns["windows"] for w in order)
        for arm in ("frozen", "online"):
            r = by.get(("cold_start", arm))
            if r:
                after = [w["tok_s"] / base for order in r["windows"] for w in order[1:]]
                out.append(f"cold_start: {arm} lowest window after the first "
                           f"{min(after):.3f}x nospec's median window (goal >= 0.95x); "
                           f"acceptance first 20 {r['accept_len_first_20']:.3f}, last quarter "
                           f"{r['accept_len_last_quarter']:.3f}")
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# Online learning under a target shift", "",
             f"{meta['when']}, {meta['box']}. Made by `lab/target_shift.sh` "
             f"(continuous serving: 4 closed-loop clients, the learner beside serving, nothing "
             f"paused or left out of tok/s; bf16; two stream orders with the arms reversed on "
             f"the second; medians (min-max) over the orders).", "",
             "| scenario | arm | tok/s | vs nospec | accept len | first 20 requests | "
             "last quarter | failed |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["tok_s_spread"]
        vs = r["vs_nospec"]
        vs_txt = "-" if vs is None else (f"{vs:.2f}x ({r['vs_nospec_spread'][0]:.2f}-"
                                         f"{r['vs_nospec_spread'][1]:.2f})")
        f20, lq = r["accept_len_first_20"], r["accept_len_last_quarter"]
        lines.append(f"| {r['scenario']} | {r['arm']} | {r['tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
                     f"{vs_txt} | {r['accept_len']:.2f} | "
                     f"{'-' if f20 is None else f'{f20:.2f}'} | "
                     f"{'-' if lq is None else f'{lq:.2f}'} | {r['failed_requests']} |")
    lines += ["", "Goals:", ""] + [f"- {g}" for g in goals(rows)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = [s for s in SCENARIOS if any(r["scenario"] == s for r in rows)]
    if not scen:
        return None
    fig, axes = plt.subplots(1, len(scen), figsize=(5 * len(scen), 3.6), squeeze=False)
    colors = dict(zip(ARM_ORDER, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, s in zip(axes[0], scen):
        for r in rows:
            if r["scenario"] != s or r["arm"] == "nospec":
                continue
            for k, accepts in enumerate(r.get("per_request") or []):
                ma = [statistics.mean(accepts[max(0, i - SMOOTH + 1):i + 1])
                      for i in range(len(accepts))]
                ax.plot(range(1, len(ma) + 1), ma, color=colors[r["arm"]], alpha=0.85,
                        label=r["arm"] if k == 0 else None, linestyle="-" if k == 0 else "--")
        ax.set_title(f"{s} (solid: order 0, dashed: order 1)", fontsize=9)
        ax.set_xlabel("requests finished")
        ax.set_ylabel(f"tokens per verify step (mean of {SMOOTH})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="lab/target_shift.sh's output folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--box", default="2-vCPU AMD EPYC Zen 5 (AVX512-BF16, no AMX)")
    args = ap.parse_args()
    run, out = Path(args.run), Path(args.out)
    rows = [r for s in SCENARIOS if (run / s / "report.json").is_file()
            for r in scenario_rows(run / s, s)]
    if not rows:
        raise SystemExit(f"--run {run}: no <scenario>/report.json under it")
    meta = {"when": time.strftime("%Y-%m-%d"), "box": args.box, "run": str(run)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "target_shift.json").write_text(json.dumps(
        {"meta": meta, "goals": goals(rows), "rows": rows}, indent=1) + "\n")
    (out / "target_shift.md").write_text(markdown(rows, meta))
    png = plot(rows, out / "target_shift.png")
    print(markdown(rows, meta))
    print(f"wrote {out / 'target_shift.json'}, {out / 'target_shift.md'}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
