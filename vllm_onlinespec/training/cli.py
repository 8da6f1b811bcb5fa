"""`vllm-onlinespec train`: offline distillation of a DFlash drafter."""

from __future__ import annotations

import argparse


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a DFlash drafter offline for an HF target")
    t.set_defaults(func=lambda a: (_ for _ in ()).throw(NotImplementedError("train: not yet")))

