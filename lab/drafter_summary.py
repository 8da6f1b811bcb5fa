"""docs/results/drafter.{json,md}: one row per drafter, from its training record, the offline
held-out walk and the served comparison.

    python lab/drafter_summary.py \
        --drafter shipped=vllm_onlinespec/drafters/smollm2-135m \
        --drafter scaled=RUN --walk EVAL/hybrid_ceiling.json \
        --served SERVED_ORDER1.json --served SERVED_ORDER2.json --out docs/results

Rows trained: the supervised draft rows of the run (a row = one labelled draft position). From
train_log.jsonl's per-window `rows` where the log has them; else counted from the run's data
(`--data NAME=DIR`: per sequence visit min(anchors, allowed) blocks, full windows first) over
the steps taken, else the settings' upper bound, batch x anchors x K per step
(`rows_estimated` says which are not from the log).
Served figures: per arm the median over the served files (arm orders) of tok/s and acceptance
length, speedups against the nospec arm of the same file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows_per_epoch(data: Path, anchors: int, k: int) -> float:
    """Supervised rows of one pass over a run's training shards: per sequence, min(anchors,
    allowed) blocks, full windows (K rows) first, partial ones (K-1 .. 1 rows) at their mean."""
    from vllm_onlinespec.training.shards import iter_shards, read_manifest

    folder = data / "train"
    total = 0.0
    for r in iter_shards(folder, read_manifest(folder).header):
        n, start = len(r.ids), r.start
        allowed = max(0, n - 1 - start)
        full = max(0, min(allowed, n - k - start))
        f = min(anchors, full)
        part = min(anchors - f, allowed - full)
        total += k * f + (part * (allowed - full + 1) / 2 if part else 0)
    return total


def rows_trained(run: Path, meta: dict, data: Path | None = None) -> tuple[int | None, bool]:
    """(rows, estimated): from the log's windows, else counted from the data and settings
    (data given), else the settings' upper bound."""
    log = run / "train_log.jsonl"
    if log.is_file():
        rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        # A resumed run logs the steps after its last checkpoint again: the last one counts.
        tr = list({r["step"]: r for r in rows if r.get("event") == "train"}.values())
        if tr and all("rows" in r for r in tr):
            return sum(int(r["rows"]) for r in tr), False
    tc = meta.get("train_config", {})
    steps = meta.get("steps_total")
    if not steps:
        return None, True
    k = int(meta.get("num_speculative_tokens", 4))
    if data is not None:
        per_epoch_steps = -(-int(meta["train_sequences"]) // tc.get("batch_size", 4))
        return int(rows_per_epoch(data, tc.get("anchors_per_seq", 8), k) * steps
                   / per_epoch_steps), True
    return int(steps * tc.get("batch_size", 4) * tc.get("anchors_per_seq", 8) * k), True


def served_table(files: list[Path]) -> dict[str, dict]:
    """arm name -> {tok_s_b1, tok_s_b8, accept_b1, accept_b8, speedup_b1, speedup_b8} (medians
    over files) with the per-file values."""
    per: dict[str, dict[str, list[float]]] = {}
    for f in files:
        res = json.loads(f.read_text())
        base = {b: None for b in (1, 8)}
        for r in res:
            if r["arm"]["method"] == "none":
                base = {p["batch"]: p["tok_s"] for p in r["phases"]}
        for r in res:
            name = r["arm"]["name"]
            d = per.setdefault(name, {})
            for p in r["phases"]:
                b = p["batch"]
                d.setdefault(f"tok_s_b{b}", []).append(p["tok_s"])
                if p.get("acceptance_length"):
                    d.setdefault(f"accept_b{b}", []).append(p["acceptance_length"])
                if base.get(b):
                    d.setdefault(f"speedup_b{b}", []).append(p["tok_s"] / base[b])
    out = {}
    for name, d in per.items():
        out[name] = {k: round(statistics.median(v), 3) for k, v in d.items()}
        out[name].update({f"{k}_each": [round(x, 3) for x in v] for k, v in d.items()})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--walk", required=True, help="hybrid_ceiling.json of these drafters")
    ap.add_argument("--served", action="append", default=[], help="drafter_served.py results")
    ap.add_argument("--data", action="append", default=[], metavar="NAME=DIR",
                    help="a drafter's training data folder, to count its rows where its log has none")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--keep-old", action="store_true",
                    help="keep drafter.json's rows of drafters not given here (measured before)")
    args = ap.parse_args()

    walks = {Path(r["drafter"]).resolve(): r for r in json.loads(Path(args.walk).read_text())}
    served = served_table([Path(f) for f in args.served])
    rows = []
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        d = Path(path).resolve()
        meta = json.loads((d / "train_meta.json").read_text())
        cfg = json.loads((d / "config.json").read_text())
        data = dict(x.split("=", 1) for x in args.data).get(name)
        n_rows, est = rows_trained(d, meta, Path(data) if data else None)
        w = walks.get(d, {})
        # The drafter's served row: the recommended recipe (suffix tree), else the ngram one.
        arm = next((v for prefix in ("recipe-tree-k", "recipe-k") for k, v in served.items()
                    if k.startswith(prefix) and k.endswith(":" + d.name)), {})
        rows.append({
            "name": name, "path": path, "layers": cfg["num_hidden_layers"],
            "K": meta.get("num_speculative_tokens"), "rows_trained": n_rows,
            "rows_estimated": est, "train_tokens": meta.get("train_response_tokens"),
            "train_sequences": meta.get("train_sequences"),
            "draft_vocab_size": cfg.get("draft_vocab_size"),
            "walk_accept": w.get("dflash", {}).get("tokens_per_step"),
            "walk_accept_se": w.get("dflash", {}).get("tokens_per_step_se"),
            "hybrid_walk_accept": w.get("ngram-first", {}).get("tokens_per_step"),
            "hybrid_walk_accept_se": w.get("ngram-first", {}).get("tokens_per_step_se"),
            "first_token": w.get("first_token"),
            "accept_len_served": arm.get("accept_b8"), "accept_len_served_b1": arm.get("accept_b1"),
            "speedup_b1": arm.get("speedup_b1"), "speedup_b8": arm.get("speedup_b8"),
            "served": arm})
    out = Path(args.out)
    # Rows of drafters not re-measured here (an older recipe) stay as they were.
    if (out / "drafter.json").is_file():
        named = {r["name"] for r in rows}
        rows = [r for r in json.loads((out / "drafter.json").read_text()).get("drafters", [])
                if r["name"] not in named and args.keep_old] + rows
    (out / "drafter.json").write_text(json.dumps(
        {"drafters": rows, "served_arms": served,
         "sources": {"walk": args.walk, "served": args.served}}, indent=1) + "\n")
    lines = ["| drafter | layers | rows trained | train tokens | draft vocab | walk (± SE) | "
             "hybrid walk (± SE) | served accept b1 / b8 | vs nospec b1 / b8 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['layers']} | {r['rows_trained'] / 1e6:.2f} M"
            f"{' (est.)' if r['rows_estimated'] else ''} | {r['train_tokens']} | "
            f"{r['draft_vocab_size'] or 'full'} | {r['walk_accept']} ± {r['walk_accept_se']} | "
            f"{r['hybrid_walk_accept']} ± {r['hybrid_walk_accept_se']} | "
            f"{r['accept_len_served_b1']} / {r['accept_len_served']} | "
            f"{r['speedup_b1']} / {r['speedup_b8']} |")
    lines += ["", "| served arm | tok/s b1 | tok/s b8 | accept b1 | accept b8 | vs nospec b1 | "
              "vs nospec b8 |", "|---|---|---|---|---|---|---|"]
    for name, a in served.items():
        lines.append(f"| {name} | {a.get('tok_s_b1')} {a.get('tok_s_b1_each')} | "
                     f"{a.get('tok_s_b8')} {a.get('tok_s_b8_each')} | {a.get('accept_b1', '-')} | "
                     f"{a.get('accept_b8', '-')} | {a.get('speedup_b1')} {a.get('speedup_b1_each')} | "
                     f"{a.get('speedup_b8')} {a.get('speedup_b8_each')} |")
    (out / "drafter_tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
