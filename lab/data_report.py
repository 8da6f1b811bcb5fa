"""docs/results/drafter_data.{json,md}: how far a drafter data run has got and what it costs.

    python lab/data_report.py --prompts PROMPTS_DIR --data RUN/data --budget 10000000 \
        --box "2-vCPU AMD EPYC Zen 3" --out docs/results

Reads the prompt set's manifest (`vllm-onlinespec prompts build`: per source its licence and
counts), the run's DATA/progress.jsonl (one line per generated chunk: response tokens, seconds
generating and writing features) and its shard manifests (tokens stored per response token),
and writes per source and kind what the set holds, per chunk the rate, and the projection to
the budget: hours of this box and disk at the shards' layout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def shard_totals(folder: Path) -> dict:
    """Samples, stored tokens, response tokens and bytes of a shard folder."""
    man = json.loads((folder / "manifest.json").read_text())
    shards = man["shards"]
    return {"samples": sum(s["samples"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "response_tokens": sum(s["response_tokens"] for s in shards),
            "bytes": sum((folder / s["file"]).stat().st_size for s in shards)}


def summarize(prompts_manifest: dict, progress: list[dict], train: dict, heldout: dict,
              budget: int) -> dict:
    made = [r for r in progress if r["new"]]
    secs = sum(r["gen_s"] + r["features_s"] for r in made)
    tokens = sum(r["response_tokens"] for r in made)
    rate = tokens / secs if secs else None
    per_resp = train["bytes"] / train["response_tokens"] if train["response_tokens"] else None
    left = max(0, budget - train["response_tokens"])
    return {"prompts": prompts_manifest["total"], "kinds": prompts_manifest["kinds"],
            "chunks": len(progress), "train": train, "heldout": heldout,
            "generated_tokens": tokens, "generated_s": round(secs, 1),
            "tok_s": round(rate, 1) if rate else None,
            "stored_per_response_token": round(train["tokens"] / train["response_tokens"], 2)
            if train["response_tokens"] else None,
            "bytes_per_response_token": round(per_resp) if per_resp else None,
            "budget": budget, "hours_left": round(left / rate / 3600, 1) if rate else None,
            "disk_gb_at_budget": round(per_resp * budget / 1e9, 1) if per_resp else None}


def markdown(s: dict, prompts_manifest: dict, progress: list[dict], box: str, date: str) -> str:
    lines = ["# Drafter data at scale: the prompt set and the generation run", "",
             f"{date}, {box}. `vllm-onlinespec prompts build`, then `vllm-onlinespec train --recipe "
             f"smollm2-10m --prompts PROMPTS --data-only` (resumable; docs/training.md, "
             f"\"Data at scale\").", "", "## Prompts", "",
             f"{s['prompts']} distinct prompts: " + ", ".join(
                 f"{k} {v}" for k, v in sorted(s["kinds"].items(), key=lambda kv: -kv[1])) + ".",
             "", "| source | licence | read | kept | deduplicated | excluded | bad |",
             "|---|---|---|---|---|---|---|"]
    for name, c in prompts_manifest["sources"].items():
        bad = c.get("empty", 0) + c.get("too_long", 0) + c.get("bad_format", 0)
        lines.append(f"| {name} | {c['licence']} | {c['read']} | {c['kept']} | {c['deduped']} | "
                     f"{c['excluded']} | {bad} |")
    lines += ["", "## Generation", "",
              "| part | round | samples | response tokens | generation s | features s | tok/s |",
              "|---|---|---|---|---|---|---|"]
    for r in progress:
        lines.append(f"| {r['part']} | {r['round']} | {r['samples']} | {r['response_tokens']} | "
                     f"{r['gen_s']} | {r['features_s']} | {r['tok_s']} |")
    t = s["train"]
    lines += ["", f"- In the training shards: {t['response_tokens']} response tokens, "
              f"{t['samples']} samples; held out: {s['heldout']['response_tokens']} tokens.",
              f"- Rate over the chunks generated: {s['tok_s']} response tokens/s (generation and "
              f"features, each chunk's engine start included).",
              f"- Stored: {s['stored_per_response_token']} tokens of features per response token "
              f"(each sample keeps its prompt's), {s['bytes_per_response_token']} bytes per "
              f"response token.",
              f"- At the budget of {s['budget']} response tokens: {s['hours_left']} more hours "
              f"of this box, {s['disk_gb_at_budget']} GB of shards in this layout."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="the prompts build folder (manifest.json)")
    ap.add_argument("--data", required=True, help="the run's DATA folder")
    ap.add_argument("--budget", type=int, default=10_000_000)
    ap.add_argument("--box", required=True, help="the machine, in words")
    ap.add_argument("--date", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    data = Path(a.data)
    pm = json.loads((Path(a.prompts) / "manifest.json").read_text())
    progress = [json.loads(x) for x in (data / "progress.jsonl").read_text().splitlines() if x]
    # A resumed run lists its finished chunks again with nothing new generated: not a rate.
    progress = [r for r in progress if r.get("new", 1) != 0]
    s = summarize(pm, progress, shard_totals(data / "train"), shard_totals(data / "heldout"),
                  a.budget)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # Sources' origins name local folders: the report keeps the licence and the counts only.
    sources = {k: {x: v for x, v in c.items() if x != "origin"} for k, c in pm["sources"].items()}
    (out / "drafter_data.json").write_text(json.dumps(
        {"date": a.date, "box": a.box, "summary": s, "sources": sources, "chunks": progress},
        indent=2) + "\n")
    (out / "drafter_data.md").write_text(markdown(s, pm, progress, a.box, a.date))
    print(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
