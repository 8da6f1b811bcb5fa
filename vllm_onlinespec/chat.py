"""Answer a few chat prompts with vLLM on CPU: the smallest proof that serving works."""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "What is speculative decoding, in two sentences?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for a good night's sleep.",
]


def run_chat(args: argparse.Namespace) -> int:
    from vllm_onlinespec.models import resolve

    path = resolve(args.model)
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs

    llm = LLM(model=path, dtype=args.dtype, **engine_kwargs())
    prompts = args.prompts or DEFAULT_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for p, o in zip(prompts, outs):
        print(f"\n>>> {p}\n{o.outputs[0].text.strip()}")
    print(f"\n{n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s, {len(prompts)} prompts batched, greedy)")
    return 0
