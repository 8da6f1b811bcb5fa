"""`vllm-onlinespec` command line: model provisioning, training, the demo."""

from __future__ import annotations

import argparse
import sys

VARIANT_STEPS = 160  # the shipped terse-steps adapter's optimizer steps


def _model(args: argparse.Namespace) -> int:
    from vllm_onlinespec import models

    if args.name in models.SERIES and args.action in ("pull", "path"):
        for name in models.series_members(args.name, args.version):  # version 0: the base
            print(models.pull(name, force=args.force) if args.action == "pull"
                  else models.model_dir(name))
    elif args.version is not None:
        raise SystemExit(f"--version picks a member of a series ({', '.join(models.SERIES)})")
    elif args.action == "pull":
        print(models.pull(args.name, force=args.force))
    elif args.action == "path":
        print(models.model_dir(args.name))
    elif args.action == "drafter":  # the trained default drafter shipped in the package
        print(models.shipped_drafter(args.name))
    elif args.action == "list":
        for m in models.KNOWN_MODELS.values():
            print(f"{m.name}\t{m.description}\t(from PyPI package {m.package})")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from vllm_onlinespec.chat import run_chat

    return run_chat(args)


def _variant(args: argparse.Namespace) -> int:
    """Fine-tune the base model into a variant (terse steps, or a file's answers); write its
    LoRA adapter (or a trajectory of them)."""
    import os

    import torch

    from vllm_onlinespec import models
    from vllm_onlinespec.training.variant import VariantRecipe, describe, make_variant

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    defaults = VariantRecipe()
    if (args.answers == "reference") != (args.data is not None):
        raise SystemExit("--answers reference takes its answers from --data FILE (and only it "
                         "reads one)")
    from pathlib import Path

    recipe = VariantRecipe(
        steps=args.steps, r=args.rank, seed=args.seed, prompts=args.prompts or defaults.prompts,
        max_answer_tokens=args.max_answer_tokens or defaults.max_answer_tokens,
        lr=args.lr or defaults.lr, compute_dtype=args.compute_dtype, answers=args.answers,
        data=Path(args.data).name if args.data else "", hold_tail=args.hold_tail,
        layers_from=defaults.layers_from if args.layers_from is None else args.layers_from)
    common = dict(base_name=args.base, cache_dir=models.cache_dir() / "generations",
                  generator=args.generator, data=args.data)
    if args.trajectory:  # a policy that drifts: one adapter per checkpoint (training/drift.py)
        from vllm_onlinespec.training.drift import make_trajectory, read_trajectory

        out = make_trajectory(models.pull(args.base), args.out, recipe,
                              versions=args.trajectory, **common)
        for row in read_trajectory(out)["rows"]:
            print(f"version {row['version']}: step {row['train_step']}, held-out loss "
                  f"{row['heldout_loss']:.3f}, adapter {row['adapter'] or '(the base)'}")
        return 0
    out = make_variant(models.pull(args.base), args.out, recipe, **common)
    print(f"adapter: {out} ({describe(out)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-onlinespec", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)

    m = sub.add_parser("model", help="provision target models (no hub downloads)")
    m.add_argument("action", choices=["pull", "path", "list", "drafter"],
                   help="drafter: print the folder of the DFlash drafter shipped for the model")
    m.add_argument("name", nargs="?", default="smollm2-135m")
    m.add_argument("--force", action="store_true", help="rebuild even if a valid folder exists")
    m.add_argument("--version", type=int, default=None, help="a series (smollm2-135m-drift): "
                   "only version k (0: the base); default every version")
    m.set_defaults(func=_model)

    v = sub.add_parser("variant", help="fine-tune the base model into a variant (the terse-steps "
                       "style, or a data file's answers): a changed target for the drafter; "
                       "writes a LoRA adapter")
    v.add_argument("--base", default="smollm2-135m", help="known base model")
    v.add_argument("--out", required=True, help="adapter folder to write (PEFT format)")
    v.add_argument("--steps", type=int, default=VARIANT_STEPS, help="optimizer steps")
    v.add_argument("--rank", type=int, default=8, help="LoRA rank")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    v.add_argument("--trajectory", type=int, default=0, metavar="N",
                   help="save the adapter at N evenly spaced steps as OUT/v1..vN (a policy that "
                   "drifts, training/drift.py); 0: one adapter at OUT")
    v.add_argument("--generator", choices=["vllm", "hf"], default="vllm",
                   help="what writes the prompts and answers: a vLLM engine, or HF transformers "
                   "on CPU (its own cache; no engine)")
    v.add_argument("--prompts", type=int, default=0, help="self-written prompts asked for "
                   "(0: the recipe's 2400)")
    v.add_argument("--max-answer-tokens", type=int, default=0,
                   help="the base's answer length (0: the recipe's 256)")
    v.add_argument("--lr", type=float, default=0.0, help="peak learning rate (0: the recipe's)")
    v.add_argument("--answers", choices=["terse", "reference"], default="terse",
                   help="what it learns: terse = the base's own answers restyled into terse "
                   "numbered steps; reference = the reference_answer of each --data row (e.g. "
                   "GSM8K's worked solutions: an SFT toward a dataset's format)")
    v.add_argument("--data", default=None, metavar="FILE", help="--answers reference: a JSONL "
                   "file of rows with a user turn (prompt / messages) and a reference_answer")
    v.add_argument("--hold-tail", type=int, default=0, metavar="N", help="--answers reference: "
                   "never train on the file's last N rows (1000 for GSM8K train: its served slice)")
    v.add_argument("--layers-from", type=float, default=None, help="adapt layers from this "
                   "fraction of the depth up (default 0.5: the upper half)")
    v.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="CPU autocast dtype of training (float32 where the CPU lacks native bf16)")
    v.set_defaults(func=_variant)

    from vllm_onlinespec.serving_dtype import resolve_dtype_arg

    c = sub.add_parser("chat", help="answer a few chat prompts with vLLM on the default model")
    c.add_argument("--model", default="smollm2-135m", help="known name or HF folder")
    c.add_argument("--max-tokens", type=int, default=96)
    c.add_argument("--dtype", default="auto", type=resolve_dtype_arg, help="auto (bfloat16 where the hardware computes "
                   "it natively, else float32), bfloat16 or float32")
    c.add_argument("prompts", nargs="*", help="prompts (default: three built-in ones)")
    c.set_defaults(func=_chat)

    from vllm_onlinespec.training.cli import add_train_parser

    add_train_parser(sub)

    from vllm_onlinespec.training.prompt_sets import add_prompts_parser

    add_prompts_parser(sub)

    from vllm_onlinespec.bench.cli import add_bench_parser
    from vllm_onlinespec.bench.concurrency import add_bench_serve_parser
    from vllm_onlinespec.bench.demo import add_demo_parser
    from vllm_onlinespec.bench.rl import add_bench_rl_parser
    from vllm_onlinespec.bench.soak import add_bench_soak_parser

    add_demo_parser(sub)
    add_bench_parser(sub)
    add_bench_serve_parser(sub)
    add_bench_rl_parser(sub)
    add_bench_soak_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:  # one clear line for the user's mistakes, traceback for ours
        from vllm_onlinespec.models import ModelError

        if isinstance(e, (ModelError, ValueError, FileNotFoundError)):
            print(f"vllm-onlinespec: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
