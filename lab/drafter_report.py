"""docs/results/drafter.{json,md,png}: the learning curve and the architecture table.

    python lab/drafter_report.py --run runs/drafter/main [--run runs/drafter/l2 ...] \
        --served runs/drafter/served.json --out docs/results

Rows come from the training runs' held-out evaluations (train_log.jsonl: offline acceptance at
each snapshot, with the response tokens trained on so far) joined with the served results
(lab/drafter_served.py) of the same snapshot folders; speedups are against the nospec
arm of the same served file at the same batch size.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class CurveRow:
    run: str
    step: int
    train_tokens: int  # response tokens of the sequences trained on so far (repeats counted)
    distinct_train_tokens: int  # response tokens in the run's training data
    layers: int
    K: int
    accept_len_offline: float
    accept_len_served: float | None = None  # vLLM bf16, batch 8 phase (more drafts counted)
    accept_len_served_b1: float | None = None
    tok_s_b1: float | None = None
    tok_s_b8: float | None = None
    speedup_b1: float | None = None
    speedup_b8: float | None = None
    snapshot: str | None = None


def _served_index(path: Path | None) -> tuple[dict, dict]:
    """{(drafter dir, K): (b1, b8, nospec of the same file)}, and that file's nospec: a speedup
    is only ever taken against the plain arm of the same run."""
    if path is None or not path.is_file():
        return {}, {}
    rows = json.loads(path.read_text())
    nospec = {}
    for r in rows:
        if r["arm"]["method"] == "none":
            b1, b8 = r["phases"]
            nospec = {"b1": b1["tok_s"], "b8": b8["tok_s"]}
    by_dir = {(str(Path(r["arm"]["drafter"]).resolve()), r["arm"]["k"]): (*r["phases"], nospec)
              for r in rows if r["arm"]["method"] == "dflash"}
    return by_dir, nospec


def rows_for(run: Path, served: dict) -> list[CurveRow]:
    meta = json.loads((run / "train_meta.json").read_text())
    cfg = meta["train_config"]
    k = meta["num_speculative_tokens"]
    rows = []
    seen = set()
    for line in (run / "train_log.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") != "eval" or ev["step"] in seen:
            continue
        seen.add(ev["step"])
        snap = run / "snapshots" / f"step-{ev['step']:06d}"
        row = CurveRow(run=run.name, step=ev["step"],
                       train_tokens=int(ev.get("response_tokens_seen", 0)),
                       distinct_train_tokens=meta["train_response_tokens"],
                       layers=cfg.get("layers", cfg.get("num_layers")), K=k,
                       accept_len_offline=round(ev["acceptance"], 3),
                       snapshot=str(snap) if snap.is_dir() else None)
        for kk in sorted({k, 4, 7}):
            hit = served.get((str(snap.resolve()), kk))
            if hit is None and ev["step"] == meta.get("steps_total"):
                hit = served.get((str(run.resolve()), kk))
            if hit and kk == k:
                b1, b8, plain = hit
                row.accept_len_served = b8["acceptance_length"]
                if not b1["prompts"]:  # an acceptance-only run (no batch-1 phase): no timings
                    continue
                row.accept_len_served_b1 = b1["acceptance_length"]
                row.tok_s_b1, row.tok_s_b8 = b1["tok_s"], b8["tok_s"]
                if plain:
                    row.speedup_b1 = round(b1["tok_s"] / plain["b1"], 3)
                    row.speedup_b8 = round(b8["tok_s"] / plain["b8"], 3)
        rows.append(row)
    return rows


TABLE_BEGIN, TABLE_END = "<!-- curve table -->", "<!-- end curve table -->"


def _fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write(rows: list[CurveRow], out: Path, nospec: dict, notes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter.json").write_text(json.dumps(
        {"nospec_tok_s": nospec, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    lines = ["| run | step | train tokens seen | distinct | layers | K | accept len offline | accept len "
             "served b8 | served b1 | tok/s b1 | tok/s b8 | speedup b1 | speedup b8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.run} | {r.step} | {r.train_tokens:,} | "
                     f"{min(r.train_tokens, r.distinct_train_tokens):,} | {r.layers} | {r.K} | "
                     f"{r.accept_len_offline:.3f} | {_fmt(r.accept_len_served)} | "
                     f"{_fmt(r.accept_len_served_b1)} | {_fmt(r.tok_s_b1, 1)} | "
                     f"{_fmt(r.tok_s_b8, 1)} | {_fmt(r.speedup_b1, 3)} | {_fmt(r.speedup_b8, 3)} |")
    # The table goes between the markers of drafter.md (its prose is written by hand).
    md = out / "drafter.md"
    if md.is_file() and TABLE_BEGIN in md.read_text():
        text = md.read_text()
        a, b = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
        md.write_text(text[:a] + "\n" + "\n".join(lines) + "\n" + text[b:])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for run in dict.fromkeys(r.run for r in rows):
            rs = [r for r in rows if r.run == run and r.step > 0]
            ax.plot([r.train_tokens for r in rs], [r.accept_len_offline for r in rs], "o-",
                    label=f"{run} offline (L{rs[0].layers}, K={rs[0].K})")
            sv = [r for r in rs if r.accept_len_served is not None]
            if sv:
                ax.plot([r.train_tokens for r in sv], [r.accept_len_served for r in sv], "s--",
                        label=f"{run} served (vLLM bf16, b8)")
        ax.set_xscale("log")
        ax.set_xlabel("training response tokens seen")
        ax.set_ylabel("held-out acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "drafter.png", dpi=110)
    except ImportError:
        pass
    print("\n".join(lines))
    for n in notes:
        print(n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="training output folder")
    ap.add_argument("--served", action="append", default=[],
                    help="drafter_served.py result JSON (repeatable; later files win)")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--keep-rows", action="store_true",
                    help="keep the rows of OUT/drafter.json whose run is not given with --run "
                    "(earlier rounds whose run folders are gone), before the new ones")
    args = ap.parse_args()
    served, nospec = {}, {}
    for f in args.served:
        sv, ns = _served_index(Path(f))
        served.update(sv)
        nospec = ns or nospec
    rows = [r for run in args.run for r in rows_for(Path(run), served)]
    old = Path(args.out) / "drafter.json"
    if args.keep_rows and old.is_file():
        new_runs = {r.run for r in rows}
        rows = [CurveRow(**r) for r in json.loads(old.read_text())["rows"]
                if r["run"] not in new_runs] + rows
    write(rows, Path(args.out), nospec, [])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
