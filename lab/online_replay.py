"""The online learner replayed offline on a prompt stream: how much acceptance it can buy, per
setting and per update budget, without serving's timing noise.

    python lab/online_replay.py --prompts runs/domain_shift/streams/tune.jsonl \
        --out runs/online_replay/tune

Serving measures a learning arm's acceptance beside VM drift of +-30 % in tok/s; this replays
what the learner sees and does, deterministically, so settings can be compared on acceptance
alone. For each prompt of the stream, in order:
  1. the target's greedy answer (`--max-tokens`, generated once by vLLM in bf16 as served, and
     cached) and its features (the HF target, float32 math);
  2. prequential scoring: the drafter as last published walks the answer the way serving
     verifies it (a K-token block at every position, greedy acceptance: trainer.walk_eval);
     the request is scored before the learner has seen it;
  3. the request's feedback (prompt, then verify steps of K + 1) reaches the learner `--lag`
     requests later (C closed-loop clients: request i is served while i-1 ... i-C+1 are), and
     the learner then runs `updates_per_request` updates (fewer if its ready gate says the
     buffer holds too few fresh tokens), through the serving layer's own builder
     (`learner.factory.build_learner`), publishing as configured.
A variant is NAME=JSON: the online config over the demo's defaults (bench DEFAULT_ONLINE), plus
`updates_per_request` (serving on this box: 3.6, docs/results/domain_shift.json), `lag`, and
`lookup`: "none" (the drafter alone, default), "own" (serving's prompt lookup on the request's
own text beside the drafter) or "recent" (and on finished requests' text, which joins the pool
when the request's feedback reaches the learner).
Prints and writes per variant: acceptance (all, first 20, last quarter) and its ratio to the
frozen drafter's on the same answers with the same lookup rule, updates run, and the
per-request series.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

DEFAULT_VARIANTS = [
    "frozen={\"updates_per_request\": 0}",
    "served={\"updates_per_request\": 3.6}",
]


LOOKUPS = ("none", "own", "recent")


def parse_variant(text: str) -> tuple[str, dict, float, int | None, str]:
    name, sep, body = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: want NAME=JSON")
    try:
        over = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"--variant {name}: bad JSON: {e}") from None
    if not isinstance(over, dict):
        raise SystemExit(f"--variant {name}: JSON must be an object")
    upr = float(over.pop("updates_per_request", 3.6))
    lag = over.pop("lag", None)
    lookup = over.pop("lookup", "none")
    if lookup not in LOOKUPS:
        raise SystemExit(f"--variant {name}: lookup {lookup!r} is not one of {', '.join(LOOKUPS)}")
    return name, over, upr, None if lag is None else int(lag), lookup


def stream_examples(prompts_path: str, target_path: str, layer_ids: list[int], max_tokens: int,
                    cache: Path, limit: int | None):
    """The stream's prompts with the target's greedy answers and features, in stream order."""
    import torch
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench.prompts import from_file
    from vllm_onlinespec.training.generate import SamplingSpec, generate, vllm_generate_fn
    from vllm_onlinespec.training.trainer import extract_features, load_target

    prompts = from_file(prompts_path)[:limit]
    tok = AutoTokenizer.from_pretrained(target_path)
    gen = vllm_generate_fn(target_path, "bfloat16")  # started only if the cache lacks answers
    try:
        samples = generate(target_path, prompts, SamplingSpec(max_tokens=max_tokens),
                           tokenizer=tok, cache_dir=cache, generate_fn=gen, dtype="bfloat16")
    finally:
        gen.close()  # its worker processes would compete with the replay for the 2 cores
    target = load_target(target_path)
    examples = extract_features(target, samples, layer_ids, dtype=torch.bfloat16)
    return (examples, target.get_input_embeddings().weight.detach(),
            target.get_output_embeddings().weight.detach())


def load_published(eval_drafter, snapshot) -> None:
    """The learner's published tensors (TrainBundle names: 'drafter.*') into the eval copy."""
    import torch

    state = {n.removeprefix("drafter."): t for n, t in snapshot.items() if n.startswith("drafter.")}
    with torch.no_grad():
        for n, p in eval_drafter.named_parameters():
            p.copy_(state[n].to(p.dtype))


def walk(drafter, e, embed32, lm32, k: int, lookup: str = "none",
         recent=None) -> tuple[int, int]:
    """(steps, tokens) of serving's greedy walk through answer `e` with K-token blocks; with
    `lookup`, serving's hybrid rule: prompt lookup's K tokens where the request's own text
    ("own"), or else finished requests' text ("recent": `recent`, a RecentText), proposes
    them, the drafter's block elsewhere (session._prompt_lookup, default settings)."""
    import numpy as np

    from vllm_onlinespec.drafter.prompt_lookup import propose
    from vllm_onlinespec.training.blocks import walk_steps
    from vllm_onlinespec.training.trainer import block_accepts

    accepted_at = block_accepts(drafter, e, embed32, lm32)
    if lookup == "none":
        walked = walk_steps(accepted_at, k)
        return len(walked), sum(walked) + len(walked)
    ids = e.ids.numpy()
    steps = tokens = i = 0
    while i < len(accepted_at) and accepted_at[i] >= 0:
        end = e.start + i + 1  # the committed text: prompt + answer up to the block's anchor
        a = min(int(accepted_at[i]), k)
        p = propose(ids[:end], k)
        if len(p) < k and recent is not None:
            p = recent.propose(ids[:end], k)
        if len(p) == k:
            truth = ids[end:end + k].tolist()
            a = next((j for j, (x, y) in enumerate(zip(p, truth)) if x != y), len(truth))
        steps, tokens, i = steps + 1, tokens + a + 1, i + a + 1
    return steps, tokens


def replay(examples, embed, lm, drafter_path, online: dict, upr: float, lag: int, k: int,
           head_dtype, passes: int = 1, heldout=(), lookup: str = "none") -> dict:
    import torch

    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.learner.buffer import sequence_records
    from vllm_onlinespec.learner.factory import build_learner
    from vllm_onlinespec.drafter.prompt_lookup import RecentText
    cfg = OnlineSpecConfig.from_any(online)
    lk = cfg.prompt_lookup
    recent = (RecentText(lk.recent_tokens, lk.recent_min_n, lk.recent_max_n)
              if lookup == "recent" else None)
    parts = build_learner(cfg, drafter_path, embed.to(head_dtype), lm.to(head_dtype), k,
                          train_length_head=False)
    learner = parts.learner
    eval_drafter = copy.deepcopy(parts.bundle.drafter).float().eval()
    embed32, lm32 = embed.float(), lm.float()
    version, credit, statuses = 0, 0.0, {}
    per_request, t0 = [], time.perf_counter()
    # Later passes serve the same answers again as new requests (scored, but no longer unseen).
    stream = [(f"p{p}-r{i}", e) for p in range(passes) for i, e in enumerate(examples)]
    for i, (_, e) in enumerate(stream):
        j = i - lag
        if j >= 0 and recent is not None:  # request j has finished: its text joins the pool
            recent.add(stream[j][1].ids.numpy())
        if j >= 0 and upr > 0:  # request j's feedback arrives, the learner runs its share
            rid, ej = stream[j]
            for rec in sequence_records(rid, ej.ids, ej.start, ej.aux, ej.final, k):
                parts.buffer.push(rec)
            parts.buffer.finish(rid)
            credit += upr
            while credit >= 1:
                credit -= 1
                status = learner.sync_step()
                statuses[status] = statuses.get(status, 0) + 1
                if status != "updated":
                    credit = 0.0  # data-bound: serving's learner would wait for fresh tokens
                    break
        v, snap = learner.latest()
        if v != version:
            load_published(eval_drafter, snap)
            version = v
        steps, tokens = walk(eval_drafter, e, embed32, lm32, k, lookup, recent)
        per_request.append({"request": i, "steps": steps, "tokens": tokens,
                            "version": version, "updates": learner.updates})
    held = [dict(zip(("steps", "tokens"), walk(eval_drafter, e, embed32, lm32, k, lookup,
                                               recent))) for e in heldout]
    return {"per_request": per_request, "heldout": held, "updates": learner.updates,
            "statuses": statuses,
            "seconds": round(time.perf_counter() - t0, 1)}


def acceptance(rows) -> float:
    steps = sum(r["steps"] for r in rows)
    return sum(r["tokens"] for r in rows) / steps if steps else math.nan


def summary(rows, heldout) -> dict:
    n = len(rows)
    out = {"accept_len": acceptance(rows), "accept_len_first_20": acceptance(rows[:20]),
           "accept_len_last_quarter": acceptance(rows[n - max(1, n // 4):])}
    if heldout:  # the final published drafter on prompts the learner never saw
        out["heldout_accept_len"] = acceptance(heldout)
    return out


def table(replay_json: Path) -> str:
    """One replay.json as a markdown table (ratios: to the frozen drafter, same lookup rule)."""
    r = json.loads(replay_json.read_text())
    keys = ("accept_len", "accept_len_first_20", "accept_len_last_quarter", "heldout_accept_len")
    lines = [f"`{r['prompts']}` ({r['requests']} requests, {r['max_tokens']} tokens; held out: "
             f"`{r['heldout']}`; passes {r['passes']})", "",
             "| variant | lookup | settings | updates/request | updates | accept len | "
             "vs frozen | first 20 vs frozen | last quarter vs frozen | held out | vs frozen |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in r["variants"]:
        ratio = [f"{v.get(key + '_vs_frozen', math.nan):.3f}x" for key in keys]
        lines.append(f"| {v['variant']} | {v.get('lookup', 'none')} | `{json.dumps(v['online'])}` "
                     f"| {v['updates_per_request']:g} | {v['updates']} | {v[keys[0]]:.3f} | "
                     f"{ratio[0]} | {ratio[1]} | {ratio[2]} | "
                     f"{v.get(keys[3], math.nan):.3f} | {ratio[3]} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", nargs="+", metavar="DIR", help="print the markdown tables of "
                    "earlier runs' DIR/replay.json and exit")
    ap.add_argument("--prompts", help="prompt file (jsonl: prompt / messages / "
                    "conversations), served in file order")
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=96, help="answer tokens (the bench's)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME=JSON (repeatable); default: " + " ".join(DEFAULT_VARIANTS))
    ap.add_argument("--lag", type=int, default=4, help="requests between a request's scoring "
                    "and its feedback reaching the learner (closed-loop clients)")
    ap.add_argument("--passes", type=int, default=1, help="serve the stream this many times "
                    "(later passes repeat answers the learner has trained on: a ceiling probe)")
    ap.add_argument("--heldout", default=None, help="a prompt file of the same domain the learner "
                    "never sees: the final drafter's acceptance there (does it learn the domain "
                    "or the answers?)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen-cache", default="runs/online_replay/gen")
    ap.add_argument("--out", default=None, help="folder for replay.json")
    args = ap.parse_args()
    if args.tables:
        print("\n".join(table(Path(d) / "replay.json") for d in args.tables))
        return 0
    if not args.prompts:
        ap.error("--prompts is required (or --tables)")

    import torch

    from vllm_onlinespec import models
    from vllm_onlinespec.bench.arm_catalog import DEFAULT_ONLINE, SERVING_RECIPE, merge_sections
    from vllm_onlinespec.drafter.checkpoint import load_drafter_config
    from vllm_onlinespec.serving_dtype import resolve_dtype_arg

    torch.set_num_threads(args.threads)
    drafter = Path(args.drafter) if args.drafter else models.shipped_drafter("smollm2-135m")
    dcfg = load_drafter_config(drafter)
    k = dcfg.num_draft_tokens
    target = models.resolve(args.target)
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    examples, embed, lm = stream_examples(args.prompts, target, list(dcfg.target_layer_ids),
                                          args.max_tokens, Path(args.gen_cache), args.max_prompts)
    heldout = stream_examples(args.heldout, target, list(dcfg.target_layer_ids), args.max_tokens,
                              Path(args.gen_cache), None)[0] if args.heldout else []
    head_dtype = getattr(torch, resolve_dtype_arg("auto"))  # what vLLM serves the head in
    base = merge_sections(DEFAULT_ONLINE, {k2: v for k2, v in SERVING_RECIPE.items()
                                   if k2 != "length_head"})
    results, frozen = [], {}  # per lookup rule: the first variant that never updates
    for name, over, upr, lag, lookup in variants:
        online = merge_sections(base, over)
        r = replay(examples, embed, lm, drafter, online, upr, args.lag if lag is None else lag,
                   k, head_dtype, args.passes, heldout, lookup)
        s = summary(r["per_request"], r["heldout"])
        if upr == 0 and lookup not in frozen:
            frozen[lookup] = s
        ref = frozen.get(lookup)
        row = {"variant": name, "online": over, "updates_per_request": upr, "lookup": lookup,
               "lag": args.lag if lag is None else lag, **s,
               **({f"{key}_vs_frozen": s[key] / ref[key] for key in s} if ref else {}),
               "updates": r["updates"], "statuses": r["statuses"], "seconds": r["seconds"],
               "per_request": r["per_request"]}
        results.append(row)
        print(json.dumps({key: (round(v, 4) if isinstance(v, float) else v)
                          for key, v in row.items() if key != "per_request"}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(
            {"prompts": args.prompts, "heldout": args.heldout, "passes": args.passes,
             "requests": len(examples), "max_tokens": args.max_tokens,
             "drafter": str(drafter), "k": k, "variants": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
