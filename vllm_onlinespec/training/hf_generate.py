"""A GenerateFn backed by HF transformers on CPU: no vLLM engine, for boxes and tests where one
cannot or should not start (the variant and drift recipes' `--generator hf`).

Same contract as generate.vllm_generate_fn: (prompt token ids per prompt, SamplingSpec) -> n
response id lists per prompt, each ending with the end-of-turn token where the model stopped
there. Greedy (temperature 0) answers are the float32 model's argmax continuations; they are
not token-for-token vLLM's bf16 answers, so the callers keep them in their own cache folder.
Sampling (temperature > 0) seeds torch once per batch from (spec.seed, the batch's prompts, its
index): reproducible for the same prompts, batch size and machine, unlike vLLM's per-request
seeds independent of batching.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .generate import GenerateFn, SamplingSpec, _sha


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for v in (model.generation_config.eos_token_id, tokenizer.eos_token_id,
              tokenizer.convert_tokens_to_ids("<|im_end|>")):
        if isinstance(v, int) and v >= 0:
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    unk = tokenizer.unk_token_id
    return ids - ({unk} if unk is not None else set())


def trim_response(tokens: list[int], eos: set[int]) -> list[int]:
    """A generated row cut after its first end token (kept, as vLLM keeps it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def prepare(model, tokenizer) -> tuple[set[int], int]:
    """(end tokens, pad id) of an HF causal LM, with a fresh generation config: the
    checkpoint's defaults (top_k, a repetition penalty, a default temperature) must not change
    what a SamplingSpec asks for."""
    from transformers import GenerationConfig

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    model.generation_config = GenerationConfig(eos_token_id=sorted(eos), pad_token_id=pad)
    return eos, pad


def hf_generate(model, eos: set[int], pad: int, prompt_ids: list[list[int]], spec: SamplingSpec,
                batch_size: int = 32, log: Callable[[str], None] | None = None
                ) -> list[list[list[int]]]:
    """`spec.n` responses per prompt from an HF causal LM (see `prepare`), `batch_size`
    sequences at a time, left-padded, prompts sorted by length so a batch pads little."""
    jobs = sorted(((i, j) for i in range(len(prompt_ids)) for j in range(spec.n)),
                  key=lambda ij: (len(prompt_ids[ij[0]]), ij))
    out: list[list[list[int]]] = [[[] for _ in range(spec.n)] for _ in prompt_ids]
    for b in range(0, len(jobs), batch_size):
        chunk = jobs[b:b + batch_size]
        rows = [prompt_ids[i] for i, _ in chunk]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, p in enumerate(rows):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        kw: dict = {"do_sample": False}
        if spec.temperature > 0:
            torch.manual_seed(int(_sha([spec.seed, rows, b])[:8], 16))
            kw = {"do_sample": True, "temperature": spec.temperature, "top_p": spec.top_p,
                  "top_k": 0}
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=spec.max_tokens, **kw)
        for (i, j), row in zip(chunk, gen[:, width:].tolist()):
            out[i][j] = trim_response(row, eos)
        if log is not None:
            log(f"hf generate: {min(b + batch_size, len(jobs))}/{len(jobs)} sequences")
    return out


def hf_generate_fn(model_path: str, batch_size: int = 32, dtype: str = "float32",
                   log: Callable[[str], None] | None = None) -> GenerateFn:
    """A GenerateFn on one lazily loaded HF causal LM at `model_path` (CPU)."""
    state: dict = {}

    def fn(prompt_ids: list[list[int]], spec: SamplingSpec) -> list[list[list[int]]]:
        if "model" not in state:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
            model.eval().requires_grad_(False)
            eos, pad = prepare(model, AutoTokenizer.from_pretrained(model_path))
            state.update(model=model, eos=eos, pad=pad)
        return hf_generate(state["model"], state["eos"], state["pad"], prompt_ids, spec,
                           batch_size, log)

    return fn
