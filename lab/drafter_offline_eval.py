"""Offline held-out acceptance of any DFlash drafter on a training run's held-out feature shards.

    python lab/drafter_offline_eval.py --data runs/drafter/main/data \
        --drafter runs/drafter/v2 [--drafter vllm_onlinespec/drafters/smollm2-135m ...]

Prints per drafter, greedy and over the whole vocabulary, two acceptance lengths: the trainer's
(16 blocks at uniformly drawn answer positions per sequence) and the walk (a block at every
position, then a greedy walk through each answer: what vLLM's mean acceptance length counts),
and the walk's share of steps that accepted all K drafts (the only steps a longer block could
extend: K' > K adds at most (K' - K) x that share tokens per step).
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a training run's feature-shard folder")
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from vllm_onlinespec.models import resolve
    from vllm_onlinespec.training.settings import TrainerSettings
    from vllm_onlinespec.training.trainer import evaluate, heldout_inputs, walk_eval

    torch.set_num_threads(args.threads)
    inp = heldout_inputs(args.data, resolve(args.target))
    held, embed, lm = inp.examples, inp.embed_w, inp.lm_head_w
    for path in args.drafter:
        cfg, drafter = inp.drafter(path)
        tc = TrainerSettings(layers=cfg.num_hidden_layers, block_size=cfg.block_size,
                             length_head=False)
        ev = evaluate(drafter, None, held, embed, lm, tc)
        ev.update(walk_eval(drafter, held, embed, lm))
        print(json.dumps({"drafter": path, "sequences": len(held),
                          "accept_len_uniform_anchors": round(ev["acceptance"], 3),
                          "accept_len_walk": round(ev["walk_acceptance"], 3),
                          "walk_steps": ev["walk_steps"],
                          "walk_full_block_share": round(ev["walk_full_block_share"], 4),
                          "match": ev["match"]}))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ValueError as e:  # a drafter that does not fit the shards: one line, not a trace
        raise SystemExit(f"error: {e}")
