"""Does the `cpu` preset ever lose to its own parts? docs/results/dominance.{md,json} from
`vllm-onlinespec bench` runs, one per (batch, temperature) point, each over >= 2 stream orders
(`--seeds 0,1`: the arm order reversed on the second).

    python lab/dominance_report.py --run 1:0:RUN_B1 --run 8:0:RUN_B8 [--run 8:1:RUN_B8_T1] \
        --name dominance --box "2-vCPU AMD EPYC (Zen 3), float32" --command "..."

Each --run is BATCH:TEMPERATURE:FOLDER (the bench's --out with its seed-N/ folders). Per point
and arm: tok/s (median over orders), vs_nospec and vs_best_other (the median of the per-order
ratios; best other = the fastest of nospec, vLLM's suffix decoding and ngram in that order's run,
the arm itself left out), their min-max over the orders, accept length, and for this project's
arms the budget's choice shares (plain / tree / drafter steps) and its measured price per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vllm_onlinespec.policy.cycle_overhead import batch_bucket

BASELINES = ("nospec", "vllm-suffix", "ngram")
OURS_PREFIXES = ("frozen", "online", "k0", "budget", "shadow")


def load_point(folder: Path) -> list[dict]:
    """Per order: {arm: {"tok_s", "accept", "cutter"}} from each seed-N/report.json."""
    seeds = sorted(folder.glob("seed-*/report.json")) or [folder / "report.json"]
    out = []
    for path in seeds:
        rep = json.loads(path.read_text())
        arms = {}
        for a in rep["arms"]:
            name = a["spec"]["name"]
            t = a["totals"]
            arms[name] = {"tok_s": t["tok_s"], "accept": t["acceptance_length"],
                          "error": a.get("error"), "failed": len(a.get("failed", [])),
                          "cutter": (a.get("learner") or {}).get("cutter", {}),
                          "profile": a.get("step_profile") or {},
                          "order": rep["meta"].get("run_order", [])}
        out.append(arms)
    return out


def ratio_stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4)}


def point_rows(batch: int, temperature: float, orders: list[dict]) -> list[dict]:
    arms = list(dict.fromkeys(a for o in orders for a in o))
    rows = []
    for arm in arms:
        per = [o for o in orders if arm in o and not o[arm]["error"]]
        if not per:
            continue
        vs_nospec = [o[arm]["tok_s"] / o["nospec"]["tok_s"] for o in per if "nospec" in o]
        others = [[o[b]["tok_s"] for b in BASELINES if b in o and b != arm] for o in per]
        vs_best = [o[arm]["tok_s"] / max(x) for o, x in zip(per, others) if x]
        row = {"arm": arm, "batch": batch, "temperature": temperature,
               "tok_s": round(statistics.median(o[arm]["tok_s"] for o in per), 2),
               "accept_len": round(statistics.median(o[arm]["accept"] for o in per), 3),
               "orders": len(per), "failed_requests": sum(o[arm]["failed"] for o in per)}
        if vs_nospec:
            row["vs_nospec"] = ratio_stats(vs_nospec)
        if vs_best:
            row["vs_best_other"] = ratio_stats(vs_best)
        steps = [o[arm]["cutter"].get("option_steps") or {} for o in per]
        tot = {k: sum(s.get(k, 0) for s in steps) for k in ("plain", "tree", "drafter")}
        if sum(tot.values()):  # a k0 arm holds the options but never chooses
            n = sum(tot.values())
            row["option_shares"] = {k: round(v / n, 3) for k, v in tot.items()}
            row["option_ms_per_token"] = [o[arm]["cutter"].get("option_ms_per_token", {})
                                          for o in per]
        prof = [o[arm]["profile"] for o in per if o[arm]["profile"].get("per_step_ms")]
        if prof:  # this project's arms: where a step's time went in the worker
            row["step_ms"] = {k: round(statistics.median(p["per_step_ms"][k] for p in prof), 2)
                              for k in ("target", "sample", "draft", "ours", "other")}
            row["steps"] = round(statistics.median(p["steps"] for p in prof))
        gate = [o[arm]["cutter"] for o in per if o[arm]["cutter"].get("gate_steps")]
        if gate:
            row["gate_shut_share"] = round(sum(c["gate_shut_steps"] for c in gate)
                                           / sum(c["gate_steps"] for c in gate), 3)
        rows.append(row)
    # The options' own gain: the preset against itself with the cost-model gate alone.
    for arm in arms:
        if arm.endswith("+gateonly") and arm[: -len("+gateonly")] in arms:
            base = arm[: -len("+gateonly")]
            per = [o for o in orders if base in o and arm in o]
            if per:
                rows.append({"arm": f"{base} / {arm}", "batch": batch, "temperature": temperature,
                             "ratio": ratio_stats([o[base]["tok_s"] / o[arm]["tok_s"]
                                                   for o in per]), "orders": len(per)})
    return rows


def fmt(r: dict, key: str) -> str:
    s = r.get(key)
    return "-" if s is None else f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def orders_of(rows: list[dict]) -> str:
    """The stream orders behind the page's points ("2", or "2-4" where they differ)."""
    n = sorted({r["orders"] for r in rows if "orders" in r})
    return str(n[0]) if len(n) == 1 else f"{n[0]}-{n[-1]}" if n else "?"


def option_prices(prices: dict[str, float], batch: int) -> str:
    """One order's prices in the bucket of the point's batch ("plain@B8": ms per token)."""
    bucket = batch_bucket(batch)
    return "plain / tree / drafter " + " / ".join(
        f"{prices[k]:.1f}" if (k := f"{o}@B{bucket}") in prices else "-"
        for o in ("plain", "tree", "drafter")) + f" ms (B{bucket})"


def page(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# {args.title}", "", args.box, "",
             f"Every arm on the same prompts in the same run, each point over "
             f"{orders_of(rows)} stream orders with the arm order reversed on every second "
             "one; ratios are per order, median (min-max). `vs best other`: against the fastest of nospec, vLLM's suffix decoding "
             "and ngram in the same order. `options`: share of the budget's steps run plain / "
             "tree only / tree + drafter (policy/option_choice.py).", "",
             f"Command: `{args.command}`", "",
             "| arm | batch | T | tok/s | vs nospec | vs best other | accept len | options "
             "plain/tree/drafter | failed |", "|---|---|---|---|---|---|---|---|---|"]
    ratios = [r for r in rows if "ratio" in r]
    rows = [r for r in rows if "ratio" not in r]
    for r in rows:
        sh = r.get("option_shares")
        opts = f"{sh['plain']:.2f} / {sh['tree']:.2f} / {sh['drafter']:.2f}" if sh else "-"
        lines.append(f"| {r['arm']} | {r['batch']} | {r['temperature']:g} | {r['tok_s']:.1f} | "
                     f"{fmt(r, 'vs_nospec')} | {fmt(r, 'vs_best_other')} | {r['accept_len']:.2f} "
                     f"| {opts} | {r['failed_requests']} |")
    if ratios:
        lines += ["", "The choice among options against the cost-model gate alone (tok/s, same "
                  "order):", ""] + [
            f"- {r['arm']}, batch {r['batch']}, T {r['temperature']:g}: "
            f"{r['ratio']['median']:.2f}x ({r['ratio']['min']:.2f}-{r['ratio']['max']:.2f})"
            for r in ratios]
    profiled = [r for r in rows if r.get("step_ms")]
    if profiled:
        lines += ["", "Where this project's steps went (the worker's step profile: ms per engine "
                  "step, median over orders; the scheduler and engine-core hand-off are outside "
                  "it):", "", "| arm | batch | T | steps | target | sampler | drafting | hooks | "
                  "other |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['arm']} | {r['batch']} | {r['temperature']:g} | {r['steps']} | "
                  + " | ".join(f"{r['step_ms'][k]:.1f}" for k in ("target", "sample", "draft",
                                                                   "ours", "other")) + " |"
                  for r in profiled]
    priced = [r for r in rows if r.get("option_ms_per_token")]
    if priced:
        lines += ["", "What each option cost where the budget chose (its measured ms per produced "
                  "token in the point's batch bucket, per order; `-`: never priced there):", ""]
        lines += [f"- {r['arm']}, batch {r['batch']}, T {r['temperature']:g}: "
                  + "; ".join(option_prices(p, r["batch"]) for p in r["option_ms_per_token"])
                  for r in priced]
    lines += goal_lines(rows, "point", lambda r: f"batch {r['batch']} T {r['temperature']:g}")
    return "\n".join(lines) + "\n"


def goal_lines(rows: list[dict], unit: str, where) -> list[str]:
    """The issue's goals, one line per arm of ours and point (`where(row)` names the point)."""
    lines = ["", f"Goals: the preset (frozen, online) >= 0.99x the best other at every {unit}; "
             "the floor (k0) >= 0.98x nospec.", ""]
    for r in rows:
        if r["arm"].startswith(("frozen", "online", "k0")) and "vs_best_other" in r:
            floor = r["arm"].startswith("k0")  # k0 and its variants (k0+gomp)
            key, goal = ("vs_nospec", 0.98) if floor else ("vs_best_other", 0.99)
            met = r[key]["median"] >= goal
            lines.append(f"- {r['arm']} {where(r)}: {key} {r[key]['median']:.2f}x -> "
                         f"{'met' if met else 'MISSED'}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="BATCH:TEMPERATURE:FOLDER")
    p.add_argument("--name", default="dominance")
    p.add_argument("--out-dir", default="docs/results")
    p.add_argument("--title", default="The preset against its own parts")
    p.add_argument("--box", required=True, help="the machine, one line")
    p.add_argument("--command", default="", help="the bench commands, for the page")
    args = p.parse_args()
    rows = []
    for spec in args.run:
        batch, temp, folder = spec.split(":", 2)
        rows += point_rows(int(batch), float(temp), load_point(Path(folder)))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(
        {"box": args.box, "command": args.command, "rows": rows}, indent=1))
    (out / f"{args.name}.md").write_text(page(rows, args))
    print(page(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
