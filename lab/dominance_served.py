"""The served half of the dominance comparison: `vllm-onlinespec bench-serve` at several
concurrencies, >= 2 rounds (a server per arm per round, the arm order reversed on every second),
read per round so that every ratio pairs arms that ran back to back.

    python lab/dominance_served.py --run RUN --box "2-vCPU ..., bf16" --command "..." \
        [--name dominance_served] [--out-dir docs/results] [--into docs/results/dominance.json]

RUN is bench-serve's --out (its concurrency.json). Per arm and concurrency C: output tok/s and
TPOT p50 (median over rounds), vs_nospec and vs_best_other (median and min-max of the per-round
ratios; best other = the fastest of nospec, vLLM's suffix decoding and ngram in that round, the
arm itself left out), accept length, and for this project's arms the budget's choice shares and
each option's price in C's batch bucket. --into adds the rows to an existing dominance page's
JSON as `served_rows` (the offline points' runs need not be at hand).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dominance_report import BASELINES, fmt, goal_lines, ratio_stats

from vllm_onlinespec.policy.cycle_overhead import batch_bucket


def served_rows(points: list[dict]) -> list[dict]:
    by: dict[tuple[int, int], dict[str, dict]] = {}  # (C, round) -> arm -> point
    for p in points:
        by.setdefault((p["concurrency"], p["repeat"]), {})[p["arm"]] = p
    arms = list(dict.fromkeys(p["arm"] for p in points))
    rows = []
    for c in sorted({p["concurrency"] for p in points}):
        rounds = [r for (c2, _), r in sorted(by.items()) if c2 == c]
        for arm in arms:
            per = [r for r in rounds if arm in r]
            if not per:
                continue
            tok = [r[arm]["output_tok_s"] for r in per]
            row = {"arm": arm, "concurrency": c, "temperature": 0.0,
                   "tok_s": round(statistics.median(tok), 2),
                   "tpot_p50_ms": round(statistics.median(r[arm]["p50_tpot_ms"] for r in per), 2),
                   "rounds": len(per), "failed_requests": sum(r[arm]["failed"] for r in per)}
            acc = [r[arm]["acceptance_length"] for r in per if r[arm].get("acceptance_length")]
            row["accept_len"] = round(statistics.median(acc), 3) if acc else 1.0
            vs_nospec = [r[arm]["output_tok_s"] / r["nospec"]["output_tok_s"] for r in per
                         if "nospec" in r and arm != "nospec"]
            others = [[r[b]["output_tok_s"] for b in BASELINES if b in r and b != arm]
                      for r in per]
            vs_best = [r[arm]["output_tok_s"] / max(x) for r, x in zip(per, others) if x]
            if vs_nospec:
                row["vs_nospec"] = ratio_stats(vs_nospec)
            if vs_best:
                row["vs_best_other"] = ratio_stats(vs_best)
            steps: dict[str, float] = {}
            for r in per:
                for o, n in (r[arm].get("option_steps") or {}).items():
                    steps[o] = steps.get(o, 0.0) + n
            if sum(steps.values()) > 0:  # a k0 arm holds the options but never chooses
                n = sum(steps.values())
                row["option_shares"] = {o: round(steps.get(o, 0.0) / n, 3)
                                        for o in ("plain", "tree", "drafter")}
                tag = f"@B{batch_bucket(c)}"
                row["option_ms_per_token"] = [
                    {k[: -len(tag)]: v for k, v in (r[arm].get("option_ms_per_token") or {}).items()
                     if k.endswith(tag)} for r in per]
            rows.append(row)
    return rows


def page(rows: list[dict], meta: dict, args: argparse.Namespace) -> str:
    n = sorted({r["rounds"] for r in rows})
    lines = [f"# {args.title}", "", args.box, "",
             f"`vllm serve` per arm and round, `vllm bench serve` at max concurrency C "
             f"({'-'.join(map(str, n))} rounds, a server per arm per round, the arm order "
             f"reversed on every second: {meta.get('run_order')}); every prompt served once per "
             "server; greedy. Ratios are per round, median (min-max). `vs best other`: against "
             "the fastest of nospec, vLLM's suffix decoding and ngram in the same round. "
             "`options`: share of the budget's steps run plain / tree only / tree + drafter, "
             "and each option's price in C's batch bucket (ms per produced token, per round).",
             "", f"Command: `{args.command}`", "",
             "| arm | C | tok/s | vs nospec | vs best other | TPOT p50 ms | accept len "
             "| options plain/tree/drafter | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = r.get("option_shares")
        opts = f"{sh['plain']:.2f} / {sh['tree']:.2f} / {sh['drafter']:.2f}" if sh else "-"
        lines.append(f"| {r['arm']} | {r['concurrency']} | {r['tok_s']:.1f} | "
                     f"{fmt(r, 'vs_nospec')} | {fmt(r, 'vs_best_other')} | "
                     f"{r['tpot_p50_ms']:.1f} | {r['accept_len']:.2f} | {opts} | "
                     f"{r['failed_requests']} |")
    priced = [r for r in rows if r.get("option_ms_per_token")]
    if priced:
        lines += ["", "What each option cost (ms per produced token in C's bucket, per round; "
                  "`-`: never priced there):", ""]
        lines += [f"- {r['arm']}, C {r['concurrency']}: " + "; ".join(
            " / ".join(f"{p[o]:.1f}" if o in p else "-" for o in ("plain", "tree", "drafter"))
            for p in r["option_ms_per_token"]) for r in priced]
    lines += goal_lines(rows, "C", lambda r: f"C {r['concurrency']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="bench-serve's --out")
    p.add_argument("--name", default="dominance_served")
    p.add_argument("--out-dir", default="docs/results")
    p.add_argument("--title", default="The preset against its own parts, served")
    p.add_argument("--box", required=True, help="the machine, one line")
    p.add_argument("--command", default="", help="the bench-serve command, for the page")
    p.add_argument("--into", help="a dominance page's JSON to add the rows to (served_rows)")
    args = p.parse_args()
    meta = json.loads((Path(args.run) / "concurrency.json").read_text())
    rows = served_rows(meta["points"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(
        {"box": args.box, "command": args.command, "run_order": meta.get("run_order"),
         "rows": rows}, indent=1))
    text = page(rows, meta, args)
    (out / f"{args.name}.md").write_text(text)
    if args.into:
        into = Path(args.into)
        d = json.loads(into.read_text())
        d["served_rows"] = rows
        d["served_box"] = args.box
        d["served_command"] = args.command
        into.write_text(json.dumps(d, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
