"""The online learner's throughput on this machine's CPU, per loss vocabulary (issue #14, item 2).

    python benchmarks/learner_throughput.py --data runs/drafter/main/data --updates 60 \
        --out runs/learner_throughput.json

Builds the learner the serving layer builds (`learner.factory.build_learner`: the shipped
SmolLM2 drafter, the target's embedding and LM head, the default online config) and feeds its
buffer the held-out answers of a training run's feature shards as verified steps of K + 1
tokens, the way the worker's feedback arrives. Then it times `--updates` synchronous updates
(the learner thread's work, without serving beside it) for each `loss.vocab` setting and
prints update ms and updates/s (median and min-max over the updates), trained draft positions
per second (blocks x K per update) and publish ms (the snapshot copy each publish makes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a training run's feature-shard folder")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--updates", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the learner's core)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from vllm_onlinespec import models
    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.learner.buffer import FeedbackRecord
    from vllm_onlinespec.learner.factory import build_learner
    from vllm_onlinespec.training.trainer import heldout_inputs

    torch.set_num_threads(args.threads)
    inp = heldout_inputs(args.data, models.resolve(args.target))
    rows, embed, lm = inp.examples, inp.embed_w, inp.lm_head_w
    drafter = models.shipped_drafter("smollm2-135m")
    k = 4
    results = []
    for vocab in ("full", "seen"):
        cfg = OnlineSpecConfig.from_any({"loss": {"vocab": vocab}})
        parts = build_learner(cfg, drafter, embed, lm, k, train_length_head=False)
        for i, r in enumerate(rows):  # prompt as one record, then the answer in verify steps
            rid = f"r{i}"
            parts.buffer.push(FeedbackRecord(rid, r.ids[:r.start], 0, r.aux[:r.start].float(),
                                             r.final[:r.start].float(), 0, 0,
                                             prompt_len=r.start))
            for s in range(r.start, len(r.ids), k + 1):
                e = min(s + k + 1, len(r.ids))
                parts.buffer.push(FeedbackRecord(rid, r.ids[s:e], s, r.aux[s:e].float(),
                                                 r.final[s:e].float(), k, 0, prompt_len=r.start))
        learner = parts.learner
        ms, pub = [], []
        for _ in range(args.updates + 3):
            learner.snapshot_ms = float("nan")
            t0 = time.perf_counter()
            status = learner.sync_step()
            dt = time.perf_counter() - t0
            if status != "updated":
                raise SystemExit(f"loss.vocab {vocab}: update {status}: {learner.last_error}")
            ms.append(dt * 1e3)
            pub.append(learner.snapshot_ms)  # nan where this update did not publish
        ms, pub = ms[3:], [x for x in pub[3:] if x == x]  # warm-up updates left out
        med = statistics.median(ms)
        # Trained positions: each block of an update scores K draft positions.
        positions_per_s = cfg.batch_blocks * k * 1e3 / med
        row = {"loss_vocab": vocab, "updates": len(ms), "update_ms_median": round(med, 1),
               "update_ms_min_max": [round(min(ms), 1), round(max(ms), 1)],
               "updates_per_s": round(1e3 / med, 2),
               "trained_positions_per_s": round(positions_per_s, 1),
               "publish_ms_median": round(statistics.median(pub), 2) if pub else None,
               "threads": args.threads,
               "batch_blocks": cfg.batch_blocks, "vocab_size": (
                   len(learner.loss_fn._vocab) if learner.loss_fn._vocab is not None
                   else int(lm.shape[0]))}
        results.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
