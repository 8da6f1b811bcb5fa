"""Prompts the target writes itself (Magpie: Xu et al., 2024), for more distinct training text.

Prompts are the scarce part of distillation data: a few hundred public prompts give a few
hundred thousand answer tokens however often each is answered. An instruct model fed only its
chat template's user prefix (`<|im_start|>user\\n`, after the template's default system turn)
continues with a user turn of the kind it was tuned on; sampled at temperature 1 with per-prompt
seeds, a few thousand such turns, deduplicated and filtered, widen the prompt pool with text
in the target's own distribution.

Math word problems are dropped (`looks_like_math`): the project keeps that domain unseen, so the
demo and benchmarks serve a domain the drafter never trained on.

Cache: one jsonl file per (model, count, seed, filter version) beside the generation cache; a
finished file is reused as is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from .data import Prompt
from .generate import GenerateFn, SamplingSpec, _sha, model_fingerprint

# Bump when the filter changes: the cache key includes it.
FILTER_VERSION = 1
MIN_CHARS, MAX_CHARS, MIN_WORDS, MIN_WORDY = 12, 1200, 3, 0.8
_MATH = re.compile(r"\b(how (many|much)|calculate|solve|total|cost|percent|sum of|product of|"
                   r"average|equation|remainder|probability)\b", re.I)
_PLACEHOLDER = re.compile(r"<\|[^>]*\|>|\[insert|\{[a-z_]+\}", re.I)


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user turn's text starts."""
    marker = "\u2063MAGPIE\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=False)
    if marker not in text:
        raise ValueError("the chat template does not place the user's text verbatim; "
                         "self-written prompts need a plain user turn")
    return list(tokenizer(text[:text.index(marker)], add_special_tokens=False)["input_ids"])


def looks_like_math(text: str) -> bool:
    """A numeric question (a GSM8K-like word problem): numbers and a quantity question."""
    return bool(re.search(r"\d", text)) and bool(_MATH.search(text))


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def keep_prompt(text: str) -> bool:
    """A usable user turn: not empty or cut short, no template tokens or placeholders, no math."""
    t = text.strip()
    # Mostly letters and spaces: drops symbol/emoji soup and number lists the sampler wanders into.
    wordy = sum(c.isalpha() or c.isspace() for c in t) >= MIN_WORDY * max(1, len(t))
    return (MIN_CHARS <= len(t) <= MAX_CHARS and len(t.split()) >= MIN_WORDS and wordy
            and not _PLACEHOLDER.search(t) and not looks_like_math(t))


def filter_prompts(texts: list[str], exclude: set[str] = frozenset()) -> list[str]:
    """Kept texts in order, first occurrence of each normalised text only; `exclude` holds
    normalised texts already used elsewhere (public prompts, held-out ones)."""
    seen, out = set(exclude), []
    for t in texts:
        key = normalise(t)
        if keep_prompt(t) and key not in seen:
            seen.add(key)
            out.append(t.strip())
    return out


def self_written_prompts(model_path: str, tokenizer, count: int, *, cache_dir: str | Path,
                         generate_fn: GenerateFn, seed: int = 0, exclude: set[str] = frozenset(),
                         max_tokens: int = 128, temperature: float = 1.0,
                         log: Callable[[str], None] = print) -> list[Prompt]:
    """`count` requested user turns written by the target (fewer survive the filter), as
    Prompts with source "self". Cached; `generate_fn` is only called on a cache miss."""
    key = _sha({"model": model_fingerprint(model_path), "count": count, "seed": seed,
                "max_tokens": max_tokens, "temperature": temperature, "filter": FILTER_VERSION})
    path = Path(cache_dir) / f"self-prompts-{Path(model_path).name}-{key[:16]}.jsonl"
    if path.is_file():
        texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
        log(f"self-written prompts: {len(texts)} cached in {path}")
    else:
        prefix = user_prefix_ids(tokenizer)
        spec = SamplingSpec(temperature=temperature, n=count, max_tokens=max_tokens, seed=seed)
        ids = generate_fn([prefix], spec)[0]
        raw = [tokenizer.decode(x, skip_special_tokens=True) for x in ids]
        texts = filter_prompts(raw, exclude)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        tmp.replace(path)
        log(f"self-written prompts: {len(texts)} kept of {len(raw)} written ({path})")
    return [Prompt(id=f"self:{_sha(t)[:12]}", source="self", text=t, category="self")
            for t in texts]
