"""One results page from several passes of lab/drafter_served.py over the same arms (the
arm order reversed on alternate passes): per arm and batch size the median tok/s over passes,
the median and spread (min, max) of its per-pass ratio to the pass's own nospec, and vLLM's
acceptance length.

    python lab/served_report.py --served P1.json --served P2.json --served P3.json \
        --name suffix_hybrid --title "Suffix-tree hybrid" --out docs/results

Writes OUT/NAME.json (rows: arm, batch, tok_s, vs_nospec, accept_len, repeats, spread) and
OUT/NAME.md. A pass without a nospec arm is refused: every ratio is against the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Row:
    arm: str
    batch: int
    tok_s: float  # median over passes
    vs_nospec: float  # median over passes of tok/s / the same pass's nospec tok/s
    spread: tuple[float, float]  # min, max of the per-pass ratios
    accept_len: float | None  # vLLM's mean acceptance length, mean over passes
    repeats: int  # passes


def rows_from_passes(passes: list[list[dict]]) -> list[Row]:
    """Rows in the first pass's arm order. Every pass must hold a nospec arm."""
    per: dict[tuple[str, int], list[tuple[float, float, float | None]]] = {}
    order: list[str] = []
    for i, arms in enumerate(passes):
        base = {ph["batch"]: ph["tok_s"] for a in arms if a["arm"]["name"] == "nospec"
                for ph in a["phases"]}
        if not base:
            raise SystemExit(f"pass {i + 1}: no nospec arm to compare with")
        for a in arms:
            name = a["arm"]["name"]
            if name not in order:
                order.append(name)
            for ph in a["phases"]:
                per.setdefault((name, ph["batch"]), []).append(
                    (ph["tok_s"], ph["tok_s"] / base[ph["batch"]], ph.get("acceptance_length")))
    rows = []
    for name in order:
        for (arm, batch), vals in sorted(per.items(), key=lambda kv: kv[0][1]):
            if arm != name:
                continue
            ratios = [r for _, r, _ in vals]
            acc = [x for _, _, x in vals if x]
            rows.append(Row(arm, batch, round(statistics.median(t for t, _, _ in vals), 2),
                            round(statistics.median(ratios), 3),
                            (round(min(ratios), 3), round(max(ratios), 3)),
                            round(statistics.fmean(acc), 3) if acc else None, len(vals)))
    return rows


def paired(passes: list[list[dict]], a: str, b: str) -> dict[int, list[float]]:
    """Per batch size, arm a's tok/s over arm b's in each pass that has both (same pass: the
    box's drift between passes cancels)."""
    out: dict[int, list[float]] = {}
    for arms in passes:
        by = {x["arm"]["name"]: {ph["batch"]: ph["tok_s"] for ph in x["phases"]} for x in arms}
        if a in by and b in by:
            for batch, t in by[a].items():
                out.setdefault(batch, []).append(round(t / by[b][batch], 3))
    return out


def markdown(rows: list[Row], meta: dict) -> str:
    out = [f"# {meta['title']} ({meta['date']})", "", meta["setup"], "",
           "| arm | batch | tok/s (median) | vs nospec (min-max) | accept len | passes |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r.accept_len:.2f}" if r.accept_len else "-"
        out.append(f"| {r.arm} | {r.batch} | {r.tok_s:.1f} | {r.vs_nospec:.2f}x "
                   f"({r.spread[0]:.2f}-{r.spread[1]:.2f}) | {acc} | {r.repeats} |")
    for pair in meta.get("versus", []):
        out += ["", f"{pair['a']} over {pair['b']}, tok/s in the same pass: " + "; ".join(
            f"batch {b}: {statistics.median(v):.2f}x (passes: {', '.join(f'{x:.2f}' for x in v)})"
            for b, v in sorted(pair["ratios"].items(), key=lambda kv: int(kv[0])))]
    out += ["", f"Passes: {', '.join(meta['sources'])}."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", action="append", required=True,
                    help="a drafter_served.py result JSON (one pass; repeatable)")
    ap.add_argument("--name", required=True, help="output file names NAME.json / NAME.md")
    ap.add_argument("--title", required=True)
    ap.add_argument("--setup", default="", help="a paragraph: box, prompts, settings, command")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--versus", action="append", default=[], metavar="A,B",
                    help="also report arm A's tok/s over arm B's per pass (repeatable)")
    args = ap.parse_args()
    passes = [json.loads(Path(p).read_text()) for p in args.served]
    rows = rows_from_passes(passes)
    meta = {"title": args.title, "date": time.strftime("%Y-%m-%d"), "setup": args.setup,
            "sources": [Path(p).name for p in args.served],
            "versus": [{"a": a, "b": b, "ratios": paired(passes, a, b)}
                       for a, b in (v.split(",", 1) for v in args.versus)]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(
        {"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
