"""A cold-start drafter: what serving starts from when no drafter was ever trained for a target.

    python lab/cold_drafter.py --like $(vllm-onlinespec model drafter) --out runs/cold --seed 0

The shape of `--like` (layers, the target layers it reads, block size) and its draft vocabulary
(the target's own LM-head rows and d2t: target-owned, nothing trained) with every trained weight
freshly initialised, as the trainer initialises a drafter before its first step. No length
head: the budget then prices drafts from measured acceptance alone. The target-shift
benchmark's cold-start scenario serves it frozen (the floor: the step gate should keep plain
decoding's speed) and learning from traffic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vllm_onlinespec.drafter.checkpoint import load_draft_vocab, load_drafter_config, save_drafter
from vllm_onlinespec.drafter.model import DFlashDrafter


def cold_drafter(like: str | Path, out: str | Path, seed: int = 0) -> Path:
    cfg = load_drafter_config(like)
    torch.manual_seed(seed)
    fresh = DFlashDrafter(cfg).float()  # the trainer's starting point (training/trainer.py)
    vocab = load_draft_vocab(like, dtype=torch.float32)
    return save_drafter(out, cfg, fresh, draft_vocab=vocab)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", required=True, help="a drafter folder: its shape and draft vocabulary")
    ap.add_argument("--out", required=True, help="the cold drafter's folder (replaced)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(cold_drafter(args.like, args.out, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
