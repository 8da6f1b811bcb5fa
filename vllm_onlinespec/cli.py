"""`vllm-onlinespec` command line: model provisioning, training, the demo."""

from __future__ import annotations

import argparse
import sys

VARIANT_STEPS = 160  # the shipped terse-steps adapter's optimizer steps


def _model(args: argparse.Namespace) -> int:
    from vllm_onlinespec import models

    if args.action == "pull":
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
    """Fine-tune the base model into the terse-steps variant; write its LoRA adapter."""
    import os

    import torch

    from vllm_onlinespec import models
    from vllm_onlinespec.training.variant import VariantRecipe, describe, make_variant

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    recipe = VariantRecipe(steps=args.steps, r=args.rank, seed=args.seed)
    out = make_variant(models.pull(args.base), args.out, recipe, base_name=args.base,
                       cache_dir=models.cache_dir() / "generations")
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
    m.set_defaults(func=_model)

    v = sub.add_parser("variant", help="fine-tune the base model into the terse-steps variant "
                                       "(a changed target for the drafter; writes a LoRA adapter)")
    v.add_argument("--base", default="smollm2-135m", help="known base model")
    v.add_argument("--out", required=True, help="adapter folder to write (PEFT format)")
    v.add_argument("--steps", type=int, default=VARIANT_STEPS, help="optimizer steps")
    v.add_argument("--rank", type=int, default=8, help="LoRA rank")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
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

    from vllm_onlinespec.bench.cli import add_bench_parser
    from vllm_onlinespec.bench.concurrency import add_bench_serve_parser
    from vllm_onlinespec.bench.demo import add_demo_parser

    add_demo_parser(sub)
    add_bench_parser(sub)
    add_bench_serve_parser(sub)
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
