"""Self-written prompts (Magpie): the user prefix, the filter, the cache; no vLLM engine."""

from __future__ import annotations

import json

import pytest

from vllm_onlinespec.training.self_prompts import (filter_prompts, keep_prompt, looks_like_math,
                                                   normalise, self_written_prompts,
                                                   user_prefix_ids)


class _ChatTok:
    """A character tokenizer with a ChatML template (SmolLM2's shape, default system turn)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_user_prefix_ends_where_the_user_text_starts():
    tok = _ChatTok()
    prefix = tok.decode(user_prefix_ids(tok))
    assert prefix == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"


def test_filter_drops_math_junk_and_duplicates():
    assert looks_like_math("Tom has 3 apples and buys 5 more. How many apples does he have?")
    assert not looks_like_math("How many planets are in the solar system?")  # no number
    assert not looks_like_math("Write a haiku about 2 cats.")
    texts = ["Write a short poem about the sea.",
             "write a short   poem about the sea.",  # the same text, normalised
             "Tom has 3 apples and buys 5 more. How many apples does he have?",
             "🌪 £3 15 cans of 1 $9.90 + 22$",  # symbol soup
             "hi",  # too short
             "Please fill in [insert name] for the letter to my boss.",
             "Explain how a <|im_start|> token works.",
             "Give me three tips for a job interview."]
    assert filter_prompts(texts, exclude={normalise("Give me three tips for a job interview.")}) \
        == ["Write a short poem about the sea."]
    assert keep_prompt("Give me three tips for a job interview.")


def test_self_written_prompts_are_cached_and_seeded(tmp_path):
    calls = []

    def fake_generate(prompt_ids, spec):
        calls.append((prompt_ids, spec))
        assert spec.n == 4 and spec.temperature > 0 and spec.seed == 7
        words = ["Write a poem about autumn leaves.", "Write a poem about autumn leaves.",
                 "What is 3 + 5? Calculate the sum of them.", "Describe a rainy day in Paris."]
        return [[[ord(c) for c in w] for w in words]]

    kw = dict(cache_dir=tmp_path, generate_fn=fake_generate, seed=7, log=lambda m: None)
    model = tmp_path / "model"
    model.mkdir()
    got = self_written_prompts(str(model), _ChatTok(), 4, **kw)
    assert [p.text for p in got] == ["Write a poem about autumn leaves.",
                                     "Describe a rainy day in Paris."]
    assert all(p.source == "self" and p.id.startswith("self:") for p in got)
    assert calls[0][0] == [user_prefix_ids(_ChatTok())]
    again = self_written_prompts(str(model), _ChatTok(), 4, **kw)
    assert [p.text for p in again] == [p.text for p in got] and len(calls) == 1  # cached
    cached = list(tmp_path.glob("self-prompts-*.jsonl"))
    assert len(cached) == 1 and json.loads(cached[0].read_text().splitlines()[0])["prompt"]


def test_template_without_a_verbatim_user_turn_is_refused():
    class Odd(_ChatTok):
        def apply_chat_template(self, messages, **kw):
            return "<s>" + messages[0]["content"][::-1]

    with pytest.raises(ValueError, match="user's text verbatim"):
        user_prefix_ids(Odd())
