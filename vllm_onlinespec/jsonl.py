"""JSON Lines files (.jsonl, .jsonl.gz) read row by row, every error naming FILE:LINE."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | os.PathLike, error: type[Exception] = ValueError,
               what: str = "prompt file", bad_json: Any = None) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed row) for every non-blank line. A missing file, bad JSON,
    or bytes that are not UTF-8 (or a broken .gz) raise `error` in one line; with `bad_json`
    given, a line that is not JSON yields it instead (the caller counts and skips it)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such {what}")
    opener = gzip.open if p.suffix == ".gz" else open
    n = 0
    with opener(p, "rt", encoding="utf-8") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    if bad_json is not None:
                        yield n, bad_json
                        continue
                    raise error(f"{p}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
                yield n, row
        except (UnicodeDecodeError, OSError, EOFError) as e:
            raise error(f"{p}:{n + 1}: unreadable ({e})") from None
