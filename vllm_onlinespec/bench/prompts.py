"""Prompt streams for benchmarks and the demo.

A stream is a list of `training.data.Prompt`s in serving order, written as jsonl
(`Prompt.to_json()` rows) for the arm subprocesses. Sources: Spec-Bench categories (path given
by the caller: the installed package never assumes where data lives), HumanEval (PyPI package),
a built-in set of varied chat prompts, so the demo runs without any data file, and any prompt
file a user has (`from_file`: JSONL rows with `prompt`, OpenAI `messages` or ShareGPT
`conversations`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_onlinespec.training.data import Prompt, dedupe, load_humaneval, load_spec_bench

SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                         "humanities", "translation", "summarization", "qa", "math_reasoning", "rag")

# Everyday chat traffic that is not code: the demo's serving domain when no Spec-Bench file is
# given. Varied on purpose (advice, explanation, writing, lists, rewriting, planning).
BUILTIN_CHAT = [
    "Give me three tips for a good night's sleep.",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato pasta sauce?",
    "What is the difference between weather and climate?",
    "Write a polite email asking my manager for a day off next Friday.",
    "List five healthy breakfast ideas.",
    "Explain how vaccines train the immune system.",
    "What should I pack for a weekend hiking trip?",
    "Describe the water cycle step by step.",
    "Write a short story opening about a lighthouse keeper.",
    "What are the benefits of learning a second language?",
    "How does a bill become a law in the United States?",
    "Give me a simple weekly workout plan for a beginner.",
    "Explain the greenhouse effect in plain words.",
    "What are some good ways to save money on groceries?",
    "Write a thank-you note to a teacher.",
    "Why do cats purr?",
    "Explain what a black hole is.",
    "How can I improve my public speaking skills?",
    "Describe the main features of Gothic architecture.",
    "What is photosynthesis and why does it matter?",
    "Write a limerick about a forgetful robot.",
    "What were the main causes of World War I?",
    "How do I care for a houseplant that is losing its leaves?",
    "Explain supply and demand with an everyday example.",
    "Write a product description for a reusable water bottle.",
    "What are the planets of the solar system, in order?",
    "Give me advice for my first job interview.",
    "Explain how the heart pumps blood through the body.",
    "Write a short dialogue between a customer and a barista.",
    "What is the history of the Olympic Games?",
    "How do bees make honey?",
    "Suggest a three-day itinerary for a first visit to Paris.",
    "Explain the difference between a virus and a bacterium.",
    "What are good habits for studying effectively?",
    "Write a haiku about the ocean.",
    "Why is biodiversity important?",
    "Describe how a rainbow forms.",
    "What are the pros and cons of working from home?",
    "Explain what the stock market is.",
    "Write a birthday message for my grandmother.",
    "How do airplanes stay in the air?",
    "Give me ideas for a rainy-day activity with kids.",
    "What is mindfulness meditation and how do I start?",
    "Explain how recycling works.",
    "Write a short motivational speech for a sports team.",
    "What causes earthquakes?",
    "Describe the life cycle of a butterfly.",
    "How can I reduce stress during exams?",
    "What is the role of the United Nations?",
    "Write a review of an imaginary restaurant.",
    "Explain why we have seasons.",
    "What are some tips for taking better photos with a phone?",
    "Describe the taste of chocolate to someone who has never had it.",
    "How does the internet work, in simple terms?",
    "Write a short fable with a moral about patience.",
    "What is the difference between a democracy and a monarchy?",
    "Explain how to plant a vegetable garden.",
    "Why do leaves change color in the fall?",
    "Give me five conversation starters for a party.",
    "Explain what renewable energy is and give examples.",
]


def builtin_chat() -> list[Prompt]:
    return [Prompt(id=f"chat:{i}", source="builtin", text=t, category="chat")
            for i, t in enumerate(BUILTIN_CHAT)]


def parse_categories(spec: str | Sequence[str] | None) -> list[str] | None:
    """'a,b' / ['a', 'b'] -> list; 'all' or None -> None; '-coding' = every category but coding."""
    if spec is None:
        return None
    items = [c.strip() for c in (spec.split(",") if isinstance(spec, str) else spec) if c.strip()]
    if not items or items == ["all"]:
        return None
    if all(c.startswith("-") for c in items):
        drop = {c[1:] for c in items}
        return [c for c in SPEC_BENCH_CATEGORIES if c not in drop]
    return items


def spec_bench(path: str | Path, categories: Sequence[str] | None) -> list[Prompt]:
    return load_spec_bench(path, list(categories) if categories else None)


def humaneval() -> list[Prompt]:
    return load_humaneval()


def by_length(prompts: Sequence[Prompt], tokenizer, max_prompt_tokens: int) -> list[Prompt]:
    """Drop prompts longer than max_prompt_tokens once chat-formatted: long RAG/summarisation
    contexts cost prefill time without telling us anything about drafting."""
    from vllm_onlinespec.training.generate import chat_ids

    return [p for p in prompts if len(chat_ids(tokenizer, p)) <= max_prompt_tokens]


def interleave(prompts: Sequence[Prompt], seed: int = 0) -> list[Prompt]:
    """A mixed stream in which every stretch holds the categories in their overall proportions
    (item i of a category with n items sits at (i + u) / n, u random): so an early/late
    difference is learning, not a change of topic, and the first N prompts are a fair sample."""
    rng = random.Random(seed)
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    keyed = []
    for cat in sorted(groups):
        g = groups[cat]
        rng.shuffle(g)
        keyed += [((i + rng.random()) / len(g), p.id, p) for i, p in enumerate(g)]
    return [p for _, _, p in sorted(keyed, key=lambda t: (t[0], t[1]))]


def exclude(prompts: Sequence[Prompt], seen: Sequence[Prompt]) -> list[Prompt]:
    texts = {p.text for p in seen}
    return [p for p in prompts if p.text not in texts]


def write_stream(prompts: Sequence[Prompt], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for x in dedupe(prompts):
            f.write(json.dumps(x.to_json()) + "\n")
    return p


def read_stream(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- prompt files ---------------------------------------------------------------------------------

PROMPT_FILE_FORMATS = ("'prompt' (a string), 'messages' (OpenAI chat: [{role, content}]) or "
                       "ShareGPT 'conversations' ([{from: human|gpt|system, value}])")
CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


class PromptFileError(ValueError):
    """One bad row of a prompt file: the message is `FILE:LINE: what is wrong`."""


def _chat_from_messages(msgs: list[dict[str, str]], what: str) -> tuple[str | None, str, tuple]:
    """(system, first user turn, later turns) of a chat, cut after its last user turn: the
    target answers that turn (a dataset's own answer to it, if any, is not what we serve).
    Turns before the first user turn other than one system prompt are dropped: chat templates
    want the conversation to open with the user, and ShareGPT rows sometimes open with a gpt
    greeting."""
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError(f"'{what}' has no {'human' if what == 'conversations' else 'user'} turn")
    msgs = msgs[:last_user + 1]
    first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    systems = [m["content"] for m in msgs[:first_user] if m["role"] == "system"]
    if len(systems) > 1:
        raise ValueError(f"'{what}' has {len(systems)} system turns before the first user turn")
    history = tuple((m["role"], m["content"]) for m in msgs[first_user + 1:])
    return (systems[0] if systems else None), msgs[first_user]["content"], history


def _turns(row: dict[str, Any], field: str, role_key: str, text_key: str,
           roles: dict[str, str]) -> list[dict[str, str]]:
    turns = row[field]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{field}' must be a non-empty list")
    out = []
    for i, t in enumerate(turns, 1):
        if not isinstance(t, dict):
            raise ValueError(f"{field}[{i}] is not an object")
        role, text = t.get(role_key), t.get(text_key)
        if role not in roles:
            raise ValueError(f"{field}[{i}].{role_key} is {role!r}, "
                             f"expected one of {sorted(roles)}")
        if not isinstance(text, str):
            raise ValueError(f"{field}[{i}].{text_key} must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"{field}[{i}].{text_key} is empty")
        out.append({"role": roles[role], "content": text})
    return out


def prompt_from_row(row: Any, key: str, default_category: str = "") -> Prompt:
    """One prompt-file row as a Prompt; ValueError (without the file position) when it is not
    one. `id` and `category` are used when they are strings or numbers."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    rid = row.get("id", row.get("question_id", key))
    cat = row.get("category", default_category)
    cat = str(cat) if isinstance(cat, (str, int, float)) else default_category
    # The first of the three fields present decides the format: a row with both 'prompt' and
    # 'messages' is read as 'prompt', as load_jsonl does.
    if "prompt" in row:
        text = row["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("'prompt' is empty")
        system, history = None, ()
    elif "messages" in row:
        msgs = _turns(row, "messages", "role", "content", {r: r for r in CHAT_ROLES})
        system, text, history = _chat_from_messages(msgs, "messages")
    elif "conversations" in row:
        msgs = _turns(row, "conversations", "from", "value", SHAREGPT_ROLES)
        system, text, history = _chat_from_messages(msgs, "conversations")
    else:
        raise ValueError(f"none of 'prompt', 'messages', 'conversations' (keys: "
                         f"{', '.join(sorted(map(str, row))) or 'none'})")
    return Prompt(id=f"file:{rid}", source="file", text=text, category=cat, system=system,
                  history=history)


def from_file(path: str | Path) -> list[Prompt]:
    """Every row of a JSONL prompt file (.gz too) as a Prompt, in file order. Each row has
    'prompt', 'messages' or ShareGPT 'conversations'; blank lines are skipped; the first bad row
    raises PromptFileError `FILE:LINE: reason`. Rows without a 'category' get the file's name
    (so a stream's category list says where it came from)."""
    from vllm_onlinespec.jsonl import iter_jsonl

    p = Path(path)
    default_cat = p.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".json")
    out = []
    for n, row in iter_jsonl(p, PromptFileError):
        try:
            out.append(prompt_from_row(row, str(n), default_cat))
        except ValueError as e:
            raise PromptFileError(f"{p}:{n}: {e}") from None
    if not out:
        raise PromptFileError(f"{p}: no prompts (the file is empty)")
    return out
