"""`vllm-onlinespec bench`: arms on one prompt stream, a drafter trained on other prompts.

    vllm-onlinespec bench --spec-bench question.jsonl \\
        --train-categories qa,math_reasoning --serve-categories translation,writing,roleplay \\
        --arms nospec,frozen,online-ogd,online-optimistic,online-ensemble --out results/shift

Categories are Spec-Bench categories, plus two pseudo-categories usable on either side:
`humaneval` (the PyPI package's 164 problems) and `chat` (the built-in chat prompts).
`-coding,-math` means every Spec-Bench category except those.

`--prompts FILE` serves your own prompts instead of Spec-Bench categories: JSONL, one row per
request, each with 'prompt' (a string), 'messages' (OpenAI chat, [{"role", "content"}]) or
'conversations' (ShareGPT, [{"from": "human"|"gpt"|"system", "value"}]); chats are served up to
their last user/human turn. The drafter can still be trained on Spec-Bench categories.

    vllm-onlinespec bench --prompts my_traffic.jsonl --drafter DRAFTER --arms nospec,online-ogd \
        --out results/mine
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from vllm_onlinespec.bench import prompts as P

def recipe_flags(recipe: str = "smollm2-small") -> dict:
    """A `vllm-onlinespec train` recipe as {flag: value}, without its prompt sources (the
    default recipe turns on HumanEval, which a domain-shift run must be able to leave out).
    Default: the small epoch-based recipe the benchmarks' starting drafters are trained with
    (smollm2-default counts steps, which cannot be combined with a benchmark's --epochs)."""
    from vllm_onlinespec.training.cli import RECIPES

    return {k.replace("_", "-"): v for k, v in RECIPES[recipe].items()
            if not isinstance(v, bool) and k not in ("prompts", "spec_bench", "categories")}


def train_flags(categories: list[str], spec_bench: str | None, base: dict | None = None,
                extra: str = "") -> list[str]:
    """`vllm-onlinespec train` flags for a drafter trained on `categories` only."""
    flags: list[str] = []
    for k, v in (base or recipe_flags()).items():
        flags += [f"--{k}", str(v)]
    sb = [c for c in categories if c not in ("humaneval", "chat")]
    if "chat" in categories:
        raise ValueError("the built-in chat prompts are a serving stream only (too few to train)")
    if "humaneval" in categories:
        flags.append("--humaneval")
    if sb:
        if not spec_bench:
            raise ValueError(f"training categories {sb} need --spec-bench PATH")
        flags += ["--spec-bench", str(spec_bench), "--categories", ",".join(sb)]
    return flags + shlex.split(extra)


def load_categories(categories: list[str] | None, spec_bench: str | None) -> list:
    """Prompts of the given (pseudo-)categories; None = every Spec-Bench category."""
    cats = categories or list(P.SPEC_BENCH_CATEGORIES)
    out = []
    if "humaneval" in cats:
        out += P.humaneval()
    if "chat" in cats:
        out += P.builtin_chat()
    sb = [c for c in cats if c not in ("humaneval", "chat")]
    if sb:
        if not spec_bench:
            raise ValueError(f"categories {sb} need --spec-bench PATH")
        out += P.spec_bench(spec_bench, sb)
    return out


def serving_prompts(args: argparse.Namespace, serve_cats: list[str] | None) -> list:
    """The prompts the stream is drawn from: --prompts FILE, else the serving categories."""
    if getattr(args, "prompts", None):
        return P.from_file(args.prompts)
    return load_categories(serve_cats, args.spec_bench)


def check_stream_source(args: argparse.Namespace) -> None:
    """--prompts replaces the serving categories: giving both is ambiguous, so it is an error."""
    if getattr(args, "prompts", None) and args.serve_categories:
        raise ValueError("--prompts and --serve-categories both choose the serving stream; "
                         "give one")


def build_stream(serve: list, train: list, tokenizer, *, max_prompt_tokens: int,
                 num_prompts: int | None, seed: int) -> list:
    stream = P.interleave(P.by_length(P.exclude(serve, train), tokenizer, max_prompt_tokens), seed)
    if num_prompts:
        stream = stream[:num_prompts]
    if not stream:
        raise ValueError("the serving stream is empty (all prompts too long or trained on)")
    return stream


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmark arms (nospec, ngram, frozen, online-*, policies) "
                       "on one prompt stream", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a = b.add_argument
    a("--arms", default="nospec,ngram,frozen,online-ogd,online-optimistic,online-ensemble",
      help="comma-separated arms, run in this order (see vllm_onlinespec/bench/arm_catalog.py)")
    a("--spec-bench", metavar="PATH", help="Spec-Bench question.jsonl")
    a("--train-categories", help="what the starting drafter is trained on (ignored with --drafter)")
    a("--serve-categories", help="what the stream serves (default: every Spec-Bench category not "
      "trained on)")
    a("--prompts", metavar="FILE", help="serve the prompts of this JSONL file instead of "
      "--serve-categories; one row per request with 'prompt' (string), 'messages' (OpenAI chat "
      "list of {role, content}) or 'conversations' (ShareGPT list of {from: human|gpt|system, "
      "value}, served up to the last human turn); .jsonl.gz too")
    a("--drafter", help="start from this DFlash drafter folder instead of training one")
    a("--train-args", default="", help="extra `vllm-onlinespec train` flags, one string")
    a("--target", default="smollm2-135m", help="known model name or HF folder")
    a("--num-spec-tokens", type=int, help="K (default: the drafter's block_size - 1)")
    a("--num-prompts", type=int, default=96, help="prompts in the stream (default 96)")
    a("--wave", type=int, default=4, help="prompts served together per wave (default 4)")
    a("--max-tokens", type=int, default=128, help="answer length cap (default 128)")
    a("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (default 512)")
    a("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
      help="bfloat16 (default: the serving recipe; AVX512-BF16/AMX CPUs decode ~1.7x faster "
      "than float32) or float32 (greedy output then identical across arms, token for token)")
    a("--online", default="{}", help="JSON merged into the learning arms' onlinespec settings")
    a("--catch-up-s", type=float, default=0.0, help="after each wave, let the learner catch up "
      "for at most this many seconds (not counted as serving time; default 0)")
    a("--seed", type=int, default=0, help="stream order")
    a("--out", required=True, help="output folder")
    b.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench.arm_catalog import DEFAULT_ONLINE, _merge, make_arm
    from vllm_onlinespec.bench.drafters import cache_key, ensure_drafter
    from vllm_onlinespec.bench.report import summarize, text_table, write_report
    from vllm_onlinespec.bench.launch import run_arms
    from vllm_onlinespec.models import cache_dir, resolve

    check_stream_source(args)
    t0 = time.perf_counter()
    out = Path(args.out)
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    online = _merge(DEFAULT_ONLINE, json.loads(args.online))
    train_cats = P.parse_categories(args.train_categories)
    serve_cats = P.parse_categories(args.serve_categories)
    if serve_cats is None and train_cats is not None and not args.prompts:
        serve_cats = [c for c in P.SPEC_BENCH_CATEGORIES if c not in train_cats]
    # Read the serving prompts first: a bad prompt file must fail before a drafter is trained.
    serve_prompts = serving_prompts(args, serve_cats)
    target = resolve(args.target)
    tok = AutoTokenizer.from_pretrained(target)

    needs_drafter = any(a not in ("nospec", "ngram") for a in arms)
    drafter = args.drafter
    train_prompts = load_categories(train_cats, args.spec_bench) if train_cats else []
    if needs_drafter and drafter is None:
        if not train_cats:
            raise ValueError("give --drafter PATH or --train-categories")
        flags = train_flags(train_cats, args.spec_bench, extra=args.train_args)
        flags[flags.index("--target") + 1] = target
        drafter = str(ensure_drafter(cache_dir() / "drafters" / f"bench-{cache_key(flags)}", flags))
    stream = build_stream(serve_prompts, train_prompts, tok,
                          max_prompt_tokens=args.max_prompt_tokens, num_prompts=args.num_prompts,
                          seed=args.seed)
    stream_path = P.write_stream(stream, out / "stream.jsonl")
    print(f"stream: {len(stream)} prompts ({', '.join(sorted({p.category for p in stream}))}), "
          f"waves of {args.wave}, {args.max_tokens} tokens max, {args.dtype}")
    specs = [make_arm(a, target=target, prompts=str(stream_path), out_dir=out, drafter=drafter,
                      num_speculative_tokens=args.num_spec_tokens, online=online, dtype=args.dtype,
                      wave=args.wave, max_tokens=args.max_tokens, catch_up_s=args.catch_up_s)
             for a in arms]
    results = run_arms(specs, out)
    meta = {"arms": arms, "target": target, "drafter": drafter, "train_categories": train_cats,
            "serve_categories": serve_cats, "prompts_file": args.prompts, "prompts": len(stream),
            "wave": args.wave, "max_tokens": args.max_tokens, "dtype": args.dtype, "online": online,
            "catch_up_s": args.catch_up_s, "wall_s": round(time.perf_counter() - t0, 1)}
    paths = write_report(results, out, title="vllm-onlinespec bench", meta=meta)
    print("\n" + text_table(summarize(results)))
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 1 if any(r.error for r in results) else 0
