"""Keep every markdown results table as data: docs/results/NAME.md -> NAME.json beside it.

    python lab/results_tables.py docs/results/concurrency.md [...]

For result pages whose benchmark run predates its JSON output (the tables were measured and
written as markdown): each table becomes {"header": [...], "rows": [{column: cell}]}, cells as
numbers where they parse, with the page's title and the command lines it quotes. A page that
already has a JSON written by its benchmark is left alone (pass --force to overwrite).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def _cell(text: str):
    t = text.strip().strip("*")
    try:
        return float(t) if re.fullmatch(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?", t) else t
    except ValueError:
        return t


def tables(md: str) -> list[dict]:
    out, lines = [], md.splitlines()
    i = 0
    while i < len(lines) - 1:
        head, sep = lines[i].strip(), lines[i + 1].strip()
        if head.startswith("|") and re.fullmatch(r"\|[\s:|-]+\|", sep):
            cols = [c.strip() for c in head.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = [c for c in lines[i].strip().strip("|").split("|")]
                rows.append({c: _cell(v) for c, v in zip(cols, cells)})
                i += 1
            out.append({"header": cols, "rows": rows})
        else:
            i += 1
    return out


def convert(path: Path, force: bool = False) -> Path | None:
    dst = path.with_suffix(".json")
    if dst.exists() and not force:
        return None
    md = path.read_text()
    title = next((l.lstrip("# ").strip() for l in md.splitlines() if l.startswith("#")), path.stem)
    commands = re.findall(r"`([^`]*(?:lab/|vllm-onlinespec|vllm bench)[^`]*)`", md)
    found = tables(md)
    if not found:
        raise ValueError(f"{path}: no markdown table found")
    dst.write_text(json.dumps({"source": path.name, "title": title, "commands": commands,
                               "tables": found}, indent=1))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    for p in args.pages:
        dst = convert(p, args.force)
        print(f"{p} -> {dst}" if dst else f"{p}: JSON already there, left alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
