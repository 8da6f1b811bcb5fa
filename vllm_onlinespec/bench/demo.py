"""`vllm-onlinespec demo`: online learning where the served target has moved away from the
drafter, end to end, on the CPU.

The `rl` scenario (the default) is RL rollouts as frameworks drive vLLM (bench/rl.py, `bench-rl`):
each round samples n answers per prompt (temperature 1, seeded) from the current policy, the
trainer's new policy is pushed into the engine in place, and while the trainer works (the gap)
the learner trains at full share on what the last round verified. Version 0 is SmolLM2-135M-
Instruct, the drafter's own target; from the second round on the policy is its fine-tune to
terse numbered steps (the package's LoRA adapter, merged on first use): the frozen drafter falls
behind it.
Two arms, the `cpu` preset frozen and learning, on the same prompts, seeds and versions, two
orders (the second reversed); the verdict compares the drafter's own acceptance (accepted draft
tokens per step it drafted) over the last half of the rounds in every order, and a plot shows
acceptance and tok/s per round. Tokens per verify step are printed beside it but do not decide:
they move with how often the budget runs the suffix tree instead of the drafter.

The learner trains only in idle time (pacing.idle_only: the gaps), so a rollout step never
shares the cores with an update.

The other scenarios, `finetuned` and `domain`, serve a stream of new prompts to one fixed
target:

    1. provision the served target: with `--scenario finetuned` SmolLM2-135M-Instruct
       fine-tuned to answer in terse numbered steps (the package's LoRA adapter, merged on first
       use); `--scenario domain`: the base model itself
    2. the starting DFlash drafter: the one shipped for the base model (trained on the base's
       answers to Spec-Bench without math_reasoning + HumanEval and self-written prompts)
    3. serve a stream of NEW prompts (Spec-Bench's math word problems when a path is given,
       else built-in chat prompts) through vLLM, three times on the same stream: no
       speculation, the start weights frozen, the start weights learning online
    4. a table (acceptance length early vs late, tok/s per arm: median and min-max over the
       stream orders), a PNG, an honest verdict

Twice, on two orders of the stream, the arms as listed on the first and reversed on the second
(bench/launch.counterbalanced): one arm's tok/s moves by up to 27 % between runs on this box
(docs/results/domain_shift.md), and the box's drift then weighs on every arm alike.

Served as a server is: 4 clients in a closed loop, each sending its next request as soon as its
previous one finished, the learner training beside serving, nothing paused and nothing left out
of the wall time (bench/engine_loop.py). Every prompt is served once and measured while it is
served, so whatever the online arm gains comes from earlier prompts of the stream, not from
memory of the same prompt. The frozen and the learning arm serve the same way, with the
recommended CPU configuration, the `cpu` preset (vllm_onlinespec/presets.py: the budget verify
policy and the suffix tree beside the drafter, vLLM's K = 16 for tree drafts, the drafter its
own 4).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_onlinespec.bench import prompts as P


@dataclass(frozen=True)
class Scenario:
    """What changed between the drafter's training and the served traffic."""
    name: str
    target: str  # the served model (a known name)
    drafter_of: str  # whose shipped drafter starts: the base model's in both scenarios
    change: str  # what the drafter has to catch up with, as printed


# `finetuned`: the target users serve after fine-tuning the base (here its terse numbered-steps
# variant, `vllm-onlinespec variant`), with the drafter trained for the base: the gap online
# learning exists for (docs/results/variant_gap.md). `domain`: the base target on a domain the
# drafter never saw, where the drafter already matches every domain about equally.
SCENARIOS = {
    "rl": Scenario("rl", "smollm2-135m", "smollm2-135m",
                   "RL rollouts: the policy changes between rounds (version 0 the base model, "
                   "then its terse-steps fine-tune pushed in place) while the drafter was "
                   "trained for version 0"),
    "finetuned": Scenario("finetuned", "smollm2-135m-terse", "smollm2-135m",
                          "a fine-tuned target (smollm2-135m-terse: the base fine-tuned to answer "
                          "in terse numbered steps) served with the base model's drafter"),
    "domain": Scenario("domain", "smollm2-135m", "smollm2-135m",
                       "a domain the drafter never saw, on the target it was trained for"),
}


@dataclass
class DemoPlan:
    name: str
    stream_prompts: int
    max_tokens: int
    arrivals: str  # bench/arrivals.py: closed:C clients
    window_s: float  # measurement windows


# Sized for the 2-core CPU box: ~9 min full over both stream orders with the shipped drafter
# (8.9 min on a 2-vCPU Zen 5, docs/results/demo_finetuned.md), a few minutes quick.
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
DEMO_PRESET = "cpu"
ORDERS = (0, 1)  # stream orders (interleaving seeds); the arms run reversed on the second
DEFAULT_SCENARIO = "rl"  # the headline use: a policy that changes every round


@dataclass(frozen=True)
class RLPlan:
    """The rollout scenario's size: rounds of prompts x n samples, a trainer gap after each."""
    rounds: int
    prompts_per_round: int
    n: int
    max_tokens: int
    gap_s: float


# Sized for a 2-vCPU box: 2 arms x 2 orders, each run an engine start (~40 s) and 4 rounds
# (~10-13 s of rollouts each; the learning arm also idles the gap); 7.8-11.4 min on 2-vCPU
# Zen 3 boxes.
RL_PLANS = {"full": RLPlan(rounds=4, prompts_per_round=4, n=4, max_tokens=48, gap_s=12.0),
            "quick": RLPlan(rounds=2, prompts_per_round=2, n=2, max_tokens=16, gap_s=3.0)}
RL_VERSIONS = ("smollm2-135m", "smollm2-135m-terse")
RL_ARMS = "frozen,online"
# A gain smaller than this (tokens per verify step; in the rl scenario, accepted draft tokens per
# step the drafter drafted) is within what timing alone can move.
MIN_GAIN = 0.03
# The rl verdict's floor on the drafter's request-steps per arm and order: below it one accepted
# token more or less moves the rate by more than MIN_GAIN.
MIN_DRAFTER_STEPS = math.ceil(1 / MIN_GAIN)
# Where the budget served the drafter on too few steps, the rl verdict reads the learner's own
# paired estimate instead (current minus start weights on fresh verified text, scored before
# it trains on it): its mean must clear MIN_GAIN at this t-statistic (~2 SE, a window of 32).
MIN_GAIN_T = 2.0


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="the main job: online learning where the target moved away "
                       "from the drafter (a fine-tune, or RL rollouts of a changing policy), on CPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--quick", action="store_true", help="a few-minute version")
    d.add_argument("--spec-bench", metavar="PATH", help="Spec-Bench question.jsonl: serve its "
                   "math_reasoning prompts (default: built-in chat prompts)")
    d.add_argument("--out", default="runs/demo", help="output folder (default runs/demo); "
                   "must be empty or absent unless --force")
    d.add_argument("--force", action="store_true",
                   help="empty a non-empty --out first (an earlier demo's results are deleted)")
    d.add_argument("--scenario", choices=sorted(SCENARIOS), default=DEFAULT_SCENARIO,
                   help="what changed since the drafter was trained: " + "; ".join(
                       f"{s.name}: {s.change}" for s in SCENARIOS.values())
                   + f" (default {DEFAULT_SCENARIO})")
    d.set_defaults(func=run_demo)


def _stream(args, plan: DemoPlan, tok, seed: int) -> tuple[list, str]:
    if args.spec_bench:
        serve = P.spec_bench(args.spec_bench, SERVE_CATEGORIES)
        what = "Spec-Bench " + "+".join(SERVE_CATEGORIES)
    else:
        serve = P.builtin_chat()
        what = "built-in chat prompts"
    stream = P.interleave(P.by_length(serve, tok, 384), seed=seed)[:plan.stream_prompts]
    return stream, what


def learning_gain(results) -> tuple[float, dict, dict] | None:
    """(online - frozen acceptance over the second half of the stream, online's halves, frozen's
    halves) of one stream order; None when an arm failed."""
    by = {r.name: r for r in results}
    fr, on = by.get("frozen"), by.get("online-ogd")
    if not fr or not on or fr.error or on.error or not fr.waves or not on.waves:
        return None
    fh, oh = fr.halves(), on.halves()
    # Rounded as printed (+ 0.0: a -0.0004 gain prints as +0.000, not -0.000).
    return round(oh[1]["acceptance_length"] - fh[1]["acceptance_length"], 3) + 0.0, oh, fh


def verdict(per_order: list[list]) -> list[str]:
    """LEARNED only when the online arm's second half beats frozen's by MIN_GAIN in every
    stream order: one order's gain is within what the budget's modes move (domain_shift.md)."""
    gains = [learning_gain(results) for results in per_order]
    if not gains or any(g is None for g in gains):
        return ["verdict: an arm failed; see the logs under the output folder"]
    lines = [f"second half of the stream, order {k}: online {oh[1]['acceptance_length']:.3f} vs "
             f"frozen {fh[1]['acceptance_length']:.3f} tokens per verify step ({gain:+.3f}); "
             f"first half {oh[0]['acceptance_length']:.3f} vs {fh[0]['acceptance_length']:.3f}"
             for k, (gain, oh, fh) in enumerate(gains)]
    low = min(g[0] for g in gains)
    if low >= MIN_GAIN:
        versions = ", ".join(str(next(r for r in results if r.name == "online-ogd")
                                 .stats.published_version) for results in per_order)
        lines.append(f"verdict: the drafter LEARNED what it serves while serving it: at least "
                     f"+{low:.3f} accepted tokens per verify step over the same start weights "
                     f"frozen in every stream order, on prompts it had never seen (drafter "
                     f"versions {versions})")
    else:
        lines.append(f"verdict: NO measurable learning in this budget (smallest gain {low:+.3f} "
                     f"< {MIN_GAIN} over {len(gains)} stream orders); a longer stream "
                     f"(`vllm-onlinespec bench`) gives the learner more feedback")
    from vllm_onlinespec.bench.report import median_spread

    tok_s = {a: median_spread(r.totals()["tok_s"] for results in per_order for r in results
                              if r.name == a and r.waves) for a in ARMS}
    if all(tok_s.values()):
        lines.append("throughput, median (min-max) over the orders: " + ", ".join(
            f"{a} {m:.1f} ({lo:.1f}-{hi:.1f})" for a, (m, lo, hi, _) in tok_s.items())
            + " tok/s (whole stream, nothing left out; speculative arms: budget verify policy + "
            "suffix-tree lookup, K = 16; on this CPU a verified token costs nearly a plain token at 4 "
            "requests, and the learner shares the 2 cores with serving)")
    return lines


def demo_arms(plan: DemoPlan, target: str, stream_path, out: Path, drafter: str):
    """(online settings, the three arms' specs) of the demo."""
    from vllm_onlinespec.bench.arm_catalog import base_settings, make_arm

    # The recommended CPU configuration (vllm_onlinespec/presets.py) for the frozen and the
    # learning arm alike: what a user copies from the README is what the demo measures.
    online = base_settings(DEMO_PRESET)
    return online, [make_arm(a, target=target, prompts=str(stream_path), out_dir=out,
                             drafter=drafter, online=online, max_tokens=plan.max_tokens,
                             arrivals=plan.arrivals, window_s=plan.window_s) for a in ARMS]


def fresh_output(out: Path, force: bool) -> Path:
    """An empty `out`: the demo's figures never mix with an earlier run's files (its report
    reads every seed folder it finds). A non-empty one is refused, or emptied with `force`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"--out {out}: not empty (an earlier demo?); pass --force to empty "
                             f"it, or another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def rl_verdict(rows: list[dict]) -> list[str]:
    """LEARNED only when, in every order, the learning drafter beat its start weights by
    MIN_GAIN over the last half of the rounds. Served first: the learning drafter's own
    acceptance (accepted draft tokens per step it drafted, the suffix tree's drafts left out)
    against the frozen drafter's. Not tokens per verify step: those move with the budget's
    option mix (a tree step accepts more than a drafter step), which differs between arms and
    orders for reasons other than learning. Where the budget ran the drafter on fewer than
    MIN_DRAFTER_STEPS request-steps of an arm (plain and tree steps paid more), the served rate
    says nothing and the order is judged by the learner's paired estimate after the last round
    (current minus start weights on the same fresh verified text, scored before training on it):
    its mean over the window >= MIN_GAIN at t >= MIN_GAIN_T. NOT MEASURED where neither exists."""
    from vllm_onlinespec.bench.rl import last_half, pooled

    online = next((r["label"] for r in rows if r["arm"] in ("online", "online-ogd")), None)
    orders = sorted({r["order"] for r in rows})
    gains, short, by_estimate, weak, lines = [], [], [], [], []
    for o in orders:
        arms = {"frozen": [r for r in rows if r["label"] == "frozen" and r["order"] == o],
                "online": [r for r in rows if r["label"] == online and r["order"] == o]}
        if not all(arms.values()):
            return ["verdict: an arm failed; see the logs under the output folder"]
        fr, on = pooled(last_half(arms["frozen"])), pooled(last_half(arms["online"]))
        steps = {a: sum(r["drafts"] - (r.get("lookup_rows") or 0) for r in last_half(rs)
                        if r.get("drafter_accept") is not None) for a, rs in arms.items()}
        last = arms["online"][-1]
        own, own_t = last.get("learner_gain"), last.get("learner_gain_t")
        own_text = (f"; the learner's own paired estimate after the last round: "
                    f"{own:+.3f} accepted draft tokens per block over its start weights"
                    + (f" (t {own_t:.1f})" if own_t is not None else "")
                    if own is not None else "")
        verify = (f"tokens per verify step {on['accept_len']:.3f} vs {fr['accept_len']:.3f}; "
                  if on["accept_len"] is not None and fr["accept_len"] is not None else "")
        speed = (f"{on['tok_s']:.1f} vs {fr['tok_s']:.1f} tok/s"
                 if on["tok_s"] is not None and fr["tok_s"] is not None else "")
        if min(steps.values()) < MIN_DRAFTER_STEPS:
            lines.append(f"last half of the rounds, order {o}: the drafter drafted "
                         f"{steps['online']} request-steps online and {steps['frozen']} frozen "
                         f"(too few for a rate); {verify}{speed}{own_text}")
            if own is None or own_t is None:
                short.append(o)
                continue
            by_estimate.append(o)
            gains.append(round(own, 3) + 0.0)
            if own_t < MIN_GAIN_T:
                weak.append(o)
            continue
        gain = round(on["drafter_accept"] - fr["drafter_accept"], 3) + 0.0
        gains.append(gain)
        lines.append(f"last half of the rounds, order {o}: the drafter's accepted tokens per "
                     f"drafted step online {on['drafter_accept']:.3f} vs frozen "
                     f"{fr['drafter_accept']:.3f} ({gain:+.3f}); {verify}{speed}{own_text}")
    if not orders:
        return ["verdict: no rounds were served; see the logs under the output folder"]
    if short:
        lines.append(f"verdict: NOT MEASURED: in order(s) {', '.join(map(str, short))} the budget "
                     f"ran the drafter on fewer than {MIN_DRAFTER_STEPS} request-steps of an arm "
                     f"over the last half (plain and tree steps instead) and the learner scored "
                     f"no paired estimate: too few to rate it")
        return lines
    how = ("" if not by_estimate else
           f" (order(s) {', '.join(map(str, by_estimate))} by the learner's paired estimate on "
           f"fresh verified text, t >= {MIN_GAIN_T:g}: the budget served the drafter there on too "
           f"few steps for a served rate)")
    low = min(gains)
    if weak:
        lines.append(f"verdict: NOT LEARNED: in order(s) {', '.join(map(str, weak))} the "
                     f"learner's paired estimate is below t {MIN_GAIN_T:g}{how}")
    elif low >= MIN_GAIN:
        lines.append(f"verdict: LEARNED: the drafter kept up with the new policy, at least "
                     f"{low:+.3f} accepted draft tokens per drafted step over the same start "
                     f"weights, in every order{how}")
    else:
        lines.append(f"verdict: NOT LEARNED: the smallest gain over the start weights is "
                     f"{low:+.3f} < {MIN_GAIN} accepted draft tokens per drafted step over "
                     f"{len(gains)} orders{how}")
    return lines


def run_rl_demo(args: argparse.Namespace, out: Path) -> int:
    from vllm_onlinespec.bench.rl import run_bench_rl, write_report

    plan = RL_PLANS["quick" if args.quick else "full"]
    count = plan.rounds * plan.prompts_per_round
    if args.spec_bench:
        prompts = P.spec_bench(args.spec_bench, SERVE_CATEGORIES)
        what = "Spec-Bench " + "+".join(SERVE_CATEGORIES)
    else:
        prompts, what = P.builtin_chat(), "built-in chat prompts"
    msgs = [p.messages for p in prompts[:count]]
    print(f"scenario rl: {SCENARIOS['rl'].change}; {plan.rounds} rounds of "
          f"{plan.prompts_per_round} {what} x n = {plan.n} samples x {plan.max_tokens} tokens, "
          f"temperature 1, seeded; a {plan.gap_s:g} s trainer gap after each round; arms "
          f"{RL_ARMS} (the cpu preset), 2 orders", flush=True)
    ns = argparse.Namespace(
        prompts=None, tail=0, skip=0, versions=",".join(RL_VERSIONS), rounds=plan.rounds,
        arms=RL_ARMS, prompts_per_round=plan.prompts_per_round, n=plan.n,
        max_tokens=plan.max_tokens, gap_s=f"{plan.gap_s:g}", push="state_dict", orders=2, seed=0,
        preset=DEMO_PRESET, drafter=None, dtype="auto", engine_lock=None, publish=None, date=None,
        learn_while_rolling=False,
        quick=False, out=str(out),
        command="vllm-onlinespec demo" + (" --quick" if args.quick else ""))
    rc = run_bench_rl(ns, msgs)
    data = json.loads((out / "rl_rollouts.json").read_text())
    lines = rl_verdict(data["rows"])
    meta = {**data["meta"], "verdict": lines, "title": (
        f"vllm-onlinespec demo: RL rollouts, policy pushed after the first round "
        f"({RL_VERSIONS[0]} -> {RL_VERSIONS[1]})")}
    paths, _ = write_report(data["rows"], out, meta, name="demo")
    print()
    for line in lines:
        print(line)
    print(f"\nplot: {paths.get('png', '-')}\ntable: {paths['markdown']}\n"
          f"wall time: {data['meta']['wall_s'] / 60:.1f} min")
    return rc


def run_demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench.launch import counterbalanced, run_arms
    from vllm_onlinespec.bench.report import (seeds_markdown, summarize, summarize_seeds,
                                              text_table, write_report, write_seed_report)
    from vllm_onlinespec.models import resolve, shipped_drafter

    t0 = time.perf_counter()
    out = fresh_output(Path(args.out), args.force)
    if args.scenario == "rl":
        return run_rl_demo(args, out)
    plan = PLANS["quick" if args.quick else "full"]
    timings: dict[str, float] = {}

    scenario = SCENARIOS[args.scenario]
    print(f"[1/4] scenario {scenario.name}: {scenario.change}; target model {scenario.target}",
          flush=True)
    target = resolve(scenario.target)  # a fine-tuned variant is merged on first use
    tok = AutoTokenizer.from_pretrained(target)

    t = time.perf_counter()
    drafter = shipped_drafter(scenario.drafter_of)  # ships with the package: no training wait
    print(f"[2/4] starting drafter: the one shipped for {scenario.drafter_of} ({drafter}; "
          f"trained on its answers, without Spec-Bench's math_reasoning, the domain served here)",
          flush=True)
    timings["drafter_s"] = time.perf_counter() - t

    t = time.perf_counter()
    per_order, title = [], ""
    for repeat, seed in enumerate(ORDERS):
        sub = out / f"seed-{seed}"
        stream, what = _stream(args, plan, tok, seed)
        stream_path = P.write_stream(stream, sub / "stream.jsonl")
        online, specs = demo_arms(plan, target, stream_path, sub, str(drafter))
        order = [ARMS[i] for i in counterbalanced(len(ARMS), repeat)]
        print(f"[3/4] order {repeat + 1} of {len(ORDERS)}: serving {len(stream)} new prompts "
              f"({what}) to {scenario.target}, {plan.arrivals.replace('closed:', '')} clients in a "
              f"closed loop, greedy, up to {plan.max_tokens} tokens, {specs[0].dtype}; arms: "
              + ", ".join(order) + " (speculative arms: budget verify policy + suffix-tree lookup, K = 16)",
              flush=True)
        results = run_arms(specs, sub, repeat)
        title = (f"vllm-onlinespec demo ({plan.name}, scenario {scenario.name}): {scenario.target} "
                 f"serving {what}, the drafter shipped for {scenario.drafter_of}")
        write_report(results, sub, title=f"{title}, stream order {seed}",
                     meta={"run_order": order, "seed": seed})
        print("\n" + text_table(summarize(results)) + "\n", flush=True)
        per_order.append(results)
    timings["serve_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0

    print("[4/4] report", flush=True)
    notes = verdict(per_order)
    meta = {"plan": asdict(plan), "scenario": asdict(scenario), "target": target,
            "drafter": str(drafter), "stream": what,
            "orders": list(ORDERS), "online": online,
            "timings": {k: round(v, 1) for k, v in timings.items()}}
    rows = summarize_seeds([summarize(r) for r in per_order],
                           [{r.name: len(r.failed) for r in results} for results in per_order])
    paths = write_seed_report(rows, out, seeds=ORDERS, meta=meta, title=title, notes=notes,
                              results=per_order)
    print("\n" + seeds_markdown(rows))
    for line in notes:
        print(line)
    print(f"\nplot: {paths.get('acceptance_requests', '-')}\ntable: {paths['markdown']}\n"
          f"wall time: {timings['total_s'] / 60:.1f} min (drafter {timings['drafter_s']:.0f} s, "
          f"serving {timings['serve_s']:.0f} s)")
    return 1 if any(r.error for results in per_order for r in results) else 0
