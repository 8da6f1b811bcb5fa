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

    vllm-onlinespec bench --prompts my_traffic.jsonl --drafter DRAFTER --arms nospec,online-ogd \\
        --out results/mine

`--arrivals closed:C` or `--arrivals poisson:RATE` serves the stream as a server sees it: C
clients that each send their next request when the previous one finished, or Poisson arrivals
at RATE requests/s; requests join the running batch between engine steps, the learner trains
beside serving, nothing pauses and the wall time is the whole stream. The report's rows are
then windows of `--window-s` seconds (tok/s, acceptance, TPOT and drafter version per window).
`--seeds 0,1` serves every arm on each stream order and reports medians with min-max:

    vllm-onlinespec bench --prompts my_traffic.jsonl --drafter DRAFTER --arrivals closed:4 \\
        --seeds 0,1 --arms nospec,frozen,online-ogd --out results/mine
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from vllm_onlinespec.bench import prompts as P
from vllm_onlinespec.presets import PRESETS
from vllm_onlinespec.serving_dtype import resolve_dtype_arg

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
                 num_prompts: int | None, seed: int, in_order: bool = False) -> list:
    """The prompts not trained on, short enough, interleaved by category (seeded), or in their
    own order (`in_order`: a stream whose order is the experiment, e.g. domain A -> B -> A)."""
    kept = P.by_length(P.exclude(serve, train), tokenizer, max_prompt_tokens)
    stream = kept if in_order else P.interleave(kept, seed)
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
    a("--num-spec-tokens", type=int, help="K (default: the drafter's block_size - 1; 16 where "
      "the arm's settings turn the suffix tree on)")
    a("--num-prompts", type=int, default=96, help="prompts in the stream (default 96)")
    a("--wave", type=int, default=4, help="prompts served together per wave (default 4)")
    a("--max-tokens", type=int, default=128, help="answer length cap (default 128)")
    a("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples at "
      "this temperature (top-p 1), each request seeded by its place in the stream, the same "
      "seeds for every arm (wave protocol)")
    a("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (default 512)")
    a("--dtype", default="auto", type=resolve_dtype_arg,
      help="auto (default: bfloat16 where the hardware computes it natively, a GPU or an "
      "AVX512-BF16/AMX CPU, ~1.7x faster than float32 there; float32 elsewhere: an AVX2 CPU "
      "emulates bf16, 2.6x slower), bfloat16, or float32 (greedy output then identical across "
      "arms, token for token)")
    a("--preset", default="cpu", choices=[*sorted(PRESETS), "none"],
      help="the settings every arm of ours starts from: 'cpu' (default) = the recommended CPU "
      "configuration (vllm_onlinespec/presets.py: learner settings, budget verify policy, "
      "suffix-tree lookup at K = 16), so `frozen` is that recipe with learning off; 'none' = "
      "the learner's settings with the config's serving defaults (fixed K, no lookup)")
    a("--online", default="{}", help="JSON merged into the learning arms' onlinespec settings")
    a("--arrivals", default="", metavar="closed:C|poisson:RATE",
      help="continuous serving instead of waves: C clients that each send their next request "
      "when the previous one finished, or Poisson arrivals at RATE requests/s (open loop); the "
      "learner trains beside serving and the wall time is the whole stream (default: waves)")
    a("--window-s", type=float, default=20.0, help="continuous protocols: seconds per "
      "measurement window (tok/s, acceptance, TPOT, drafter version per window; default 20)")
    a("--seeds", help="comma-separated stream orders, e.g. 0,1: every arm serves each order, "
      "seed after seed (arms in --arms order on the 1st, 3rd, ... seed, reversed on the 2nd, "
      "4th, ...: the box's drift then weighs on every arm alike), and the report gives medians "
      "with min-max (default: --seed)")
    a("--in-order", action="store_true", help="serve --prompts in the file's order instead of "
      "interleaving categories (for streams whose order is the experiment; no --seeds)")
    a("--catch-up-s", type=float, default=0.0, help="after each wave, let the learner catch up "
      "for at most this many seconds (not counted as serving time; default 0)")
    a("--swap-to", metavar="MODEL", help="continuous protocols: replace the target's weights "
      "in place mid-stream by this model's (known name or HF folder of the same architecture "
      "and vocabulary), as an RL loop or a fine-tuning job does; every arm faces the swap")
    a("--swap-at", type=int, default=0, metavar="N", help="with --swap-to: swap before the N-th "
      "request is sent (1-based; requests in flight run on)")
    a("--seed", type=int, default=0, help="stream order")
    a("--out", required=True, help="output folder")
    a("--resume", action="store_true", help="with --seeds: keep every stream order whose "
      "report is already in --out with the same settings (a run cut off mid-way picks up at "
      "the first order not finished; an order is always served whole, all its arms in one "
      "sitting)")
    b.set_defaults(func=run_bench)


def parse_seeds(args: argparse.Namespace) -> list[int]:
    if not args.seeds:
        return [args.seed]
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds {args.seeds!r}: expected comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {args.seeds!r}: expected distinct integers")
    return seeds


def check_protocol(args: argparse.Namespace) -> None:
    """The continuous protocols count everything: a learner pause would be left out."""
    if (args.swap_to is None) != (args.swap_at == 0):
        raise ValueError("--swap-to MODEL and --swap-at N (>= 1) go together")
    if args.swap_at < 0:
        raise ValueError(f"--swap-at must be >= 1 (got {args.swap_at})")
    if args.swap_to and not args.arrivals:
        raise ValueError("--swap-to swaps mid-stream in the continuous protocols: give --arrivals")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (got {args.temperature})")
    if args.temperature > 0 and args.arrivals:
        raise ValueError("--temperature samples in the wave protocol; the continuous protocols "
                         "serve greedy: drop --arrivals or --temperature")
    if not args.arrivals:
        return
    from vllm_onlinespec.bench.arrivals import parse_arrivals

    parse_arrivals(args.arrivals)
    if args.catch_up_s > 0:
        raise ValueError("--catch-up-s pauses between waves; with --arrivals the learner trains "
                         "beside serving and nothing is left out of the wall time: drop one")
    if not args.window_s > 0:
        raise ValueError(f"--window-s must be > 0 seconds (got {args.window_s})")


# What decides an order's figures: a report kept by --resume must match on all of them.
RESUME_KEYS = ("arms", "run_order", "target", "drafter", "serve_categories", "train_categories",
               "prompts_file", "prompts", "seed", "protocol", "wave", "max_tokens",
               "temperature", "dtype", "online", "swap_to", "swap_at")


def finished_order(sub: Path, specs: list, meta: dict) -> list | None:
    """The arms' results of a stream order an earlier run finished with the same settings
    (its report.json, every arm's result file without an error), else None: serve it again."""
    from vllm_onlinespec.bench.results import ArmResult

    report = sub / "report.json"
    if not report.is_file():
        return None
    old = json.loads(report.read_text()).get("meta", {})
    if any(json.dumps(old.get(k), sort_keys=True, default=str)
           != json.dumps(meta.get(k), sort_keys=True, default=str) for k in RESUME_KEYS):
        return None
    if not all(Path(s.out).is_file() for s in specs):
        return None
    results = [ArmResult.load(s.out) for s in specs]
    return None if any(r.error or not r.waves for r in results) else results


def run_bench(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench.arm_catalog import base_settings, make_arm, merge_sections
    from vllm_onlinespec.bench.arm_catalog import needs_drafter as arm_needs_drafter
    from vllm_onlinespec.bench.drafters import cache_key, ensure_drafter
    from vllm_onlinespec.bench.launch import counterbalanced, run_arms
    from vllm_onlinespec.bench import report as R
    from vllm_onlinespec.models import cache_dir, resolve

    check_stream_source(args)
    check_protocol(args)
    seeds = parse_seeds(args)
    if args.in_order and (len(seeds) > 1 or not args.prompts):
        raise ValueError("--in-order serves a --prompts file in its own order: give --prompts, "
                         "and one order (no --seeds)")
    t0 = time.perf_counter()
    out = Path(args.out)
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    online = merge_sections(base_settings(args.preset), json.loads(args.online))
    train_cats = P.parse_categories(args.train_categories)
    serve_cats = P.parse_categories(args.serve_categories)
    if serve_cats is None and train_cats is not None and not args.prompts:
        serve_cats = [c for c in P.SPEC_BENCH_CATEGORIES if c not in train_cats]
    # Read the serving prompts first: a bad prompt file must fail before a drafter is trained.
    serve_prompts = serving_prompts(args, serve_cats)
    target = resolve(args.target)
    swap_to = None
    if args.swap_to:
        from vllm_onlinespec.serving.target_swap import check_swap

        swap_to = resolve(args.swap_to)  # a known variant is merged on first use
        check_swap(json.loads((Path(target) / "config.json").read_text()), swap_to)
    tok = AutoTokenizer.from_pretrained(target)

    needs_drafter = any(arm_needs_drafter(a) for a in arms)
    drafter = args.drafter
    train_prompts = load_categories(train_cats, args.spec_bench) if train_cats else []
    if needs_drafter and drafter is None:
        if not train_cats:
            raise ValueError("give --drafter PATH or --train-categories")
        flags = train_flags(train_cats, args.spec_bench, extra=args.train_args)
        flags[flags.index("--target") + 1] = target
        drafter = str(ensure_drafter(cache_dir() / "drafters" / f"bench-{cache_key(flags)}", flags))
    protocol = (f"continuous ({args.arrivals}, windows of {args.window_s:g} s)" if args.arrivals
                else f"waves of {args.wave}")
    per_seed, failed, bad = [], [], False
    for repeat, seed in enumerate(seeds):
        sub = out if len(seeds) == 1 else out / f"seed-{seed}"
        stream = build_stream(serve_prompts, train_prompts, tok,
                              max_prompt_tokens=args.max_prompt_tokens,
                              num_prompts=args.num_prompts, seed=seed, in_order=args.in_order)
        stream_path = P.write_stream(stream, sub / "stream.jsonl")
        print(f"stream (seed {seed}): {len(stream)} prompts "
              f"({', '.join(sorted({p.category for p in stream}))}), {protocol}, "
              f"{args.max_tokens} tokens max, {args.dtype}")
        specs = [make_arm(a, target=target, prompts=str(stream_path), out_dir=sub,
                          drafter=drafter, num_speculative_tokens=args.num_spec_tokens,
                          online=online, dtype=args.dtype, wave=args.wave,
                          max_tokens=args.max_tokens, temperature=args.temperature,
                          catch_up_s=args.catch_up_s,
                          arrivals=args.arrivals, window_s=args.window_s,
                          swap_at=args.swap_at, swap_to=swap_to)
                 for a in arms]
        meta = {"arms": arms, "run_order": [arms[i] for i in counterbalanced(len(arms), repeat)],
                "target": target, "drafter": drafter,
                "train_categories": train_cats, "serve_categories": serve_cats,
                "prompts_file": args.prompts, "prompts": len(stream), "seed": seed,
                "protocol": protocol, "arrivals": args.arrivals or None,
                "window_s": args.window_s if args.arrivals else None, "wave": args.wave,
                "max_tokens": args.max_tokens, "temperature": args.temperature,
                "dtype": args.dtype, "online": online,
                "catch_up_s": args.catch_up_s, "swap_to": swap_to, "swap_at": args.swap_at or None,
                "wall_s": round(time.perf_counter() - t0, 1)}
        results = finished_order(sub, specs, meta) if args.resume else None
        if results is not None:
            print(f"stream (seed {seed}): finished in an earlier run, kept ({sub / 'report.json'})")
            meta = json.loads((sub / "report.json").read_text())["meta"]
        else:
            results = run_arms(specs, sub, repeat)
            meta["wall_s"] = round(time.perf_counter() - t0, 1)
        paths = R.write_report(results, sub, title="vllm-onlinespec bench", meta=meta)
        rows = R.summarize(results)
        print("\n" + R.text_table(rows))
        for k, p in paths.items():
            print(f"{k}: {p}")
        per_seed.append(rows)
        failed.append({r.name: len(r.failed) for r in results})
        bad |= any(r.error or r.failed for r in results)
    if len(seeds) > 1:
        seed_rows = R.summarize_seeds(per_seed, failed)
        paths = R.write_seed_report(seed_rows, out, seeds=seeds, meta={
            "arms": arms, "drafter": drafter, "protocol": protocol, "seeds": seeds,
            "wall_s": round(time.perf_counter() - t0, 1)})
        print("\n" + R.seeds_markdown(seed_rows) + f"\nover seeds: {paths['markdown']}")
    return 1 if bad else 0
