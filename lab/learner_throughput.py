"""The online learner's throughput on this machine's CPU, per loss vocabulary and matmul
dtype.

    python lab/learner_throughput.py --data runs/drafter/main/data --updates 60 \
        --out runs/learner_throughput.json
    python lab/learner_throughput.py --prompts runs/domain_shift/streams/tune.jsonl ...

Builds the learner the serving layer builds (`learner.factory.build_learner`: the shipped
SmolLM2 drafter, the target's embedding and LM head in the served dtype, the default online
config with replay) and feeds its buffer, as verified steps of K + 1 tokens the way the
worker's feedback arrives, either the held-out answers of a training run's feature shards
(`--data`) or prompts whose features the HF target computes here (`--prompts`: each prompt's
first third as the prompt, the rest as verified steps; an update's cost depends on shapes,
not on which tokens they are). Then it times `--updates` synchronous updates (the learner
thread's work, without serving beside it) per setting (`loss.vocab` x
`learner_compute_dtype`) and prints update ms and updates/s (median and min-max), trained
draft positions per second (blocks x K per update) and publish ms (the snapshot copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from vllm_onlinespec.serving_dtype import resolve_dtype_arg


def feed(buffer, seqs, k: int, tag: str) -> None:
    """Each sequence as one request: its prompt as one record, then verify steps of K + 1."""
    from vllm_onlinespec.learner.buffer import sequence_records

    for i, (ids, start, aux, final) in enumerate(seqs):
        for rec in sequence_records(f"{tag}-r{i}", ids, start, aux, final, k):
            buffer.push(rec)


def prompt_features(path: str, target_path: str, drafter: Path, limit: int):
    """[(ids, start, aux, final)] of up to `limit` prompts of a prompt file, chat-templated, with
    the HF target's features (the drafter's target layers); and the target's embedding and head."""
    import torch
    from transformers import AutoTokenizer

    from vllm_onlinespec.bench.prompts import from_file
    from vllm_onlinespec.drafter.checkpoint import load_drafter
    from vllm_onlinespec.training.features import target_features
    from vllm_onlinespec.training.trainer import load_target

    layers = load_drafter(drafter)[0].target_layer_ids
    tok = AutoTokenizer.from_pretrained(target_path)
    target = load_target(target_path)
    seqs = []
    for p in from_file(path)[:limit]:
        text = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        aux, final = target_features(target, ids[None], None, layers)
        seqs.append((ids, len(ids) // 3, aux[0], final[0]))
    return (seqs, target.get_input_embeddings().weight.detach(),
            target.get_output_embeddings().weight.detach())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a training run's feature-shard folder")
    src.add_argument("--prompts", help="a prompt file (jsonl: prompt / messages / "
                     "conversations); features from the HF target here")
    ap.add_argument("--max-prompts", type=int, default=40)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head-dtype", default="auto", type=resolve_dtype_arg,
                    help="dtype of the target's embedding and LM head the learner reads in place "
                    "(what vLLM serves in; auto as `vllm-onlinespec bench`)")
    ap.add_argument("--settings", default="full:float32,seen:float32,seen:bfloat16",
                    help="comma-separated loss.vocab:learner_compute_dtype pairs")
    ap.add_argument("--updates", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the learner's core)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from vllm_onlinespec import models
    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.learner.factory import build_learner
    from vllm_onlinespec.training.trainer import heldout_inputs

    torch.set_num_threads(args.threads)
    drafter = models.shipped_drafter("smollm2-135m")
    k = 4
    if args.data:
        inp = heldout_inputs(args.data, models.resolve(args.target))
        seqs = [(r.ids, r.start, r.aux.float(), r.final.float()) for r in inp.examples]
        embed, lm = inp.embed_w, inp.lm_head_w
    else:
        seqs, embed, lm = prompt_features(args.prompts, models.resolve(args.target), drafter,
                                          args.max_prompts)
    head_dtype = getattr(torch, args.head_dtype)
    embed, lm = embed.to(head_dtype), lm.to(head_dtype)
    results = []
    for setting in args.settings.split(","):
        vocab, compute = setting.split(":")
        cfg = OnlineSpecConfig.from_any({"loss": {"vocab": vocab}, "replay": True,
                                         "learner_compute_dtype": compute})
        parts = build_learner(cfg, drafter, embed, lm, k, train_length_head=False)
        feed(parts.buffer, seqs, k, "pass0")
        learner = parts.learner
        ms, pub = [], []
        for i in range(args.updates + 3):
            learner.snapshot_ms = float("nan")
            if not learner.ready(parts.buffer):  # out of fresh tokens: the same answers again,
                feed(parts.buffer, seqs, k, f"pass{i + 1}")  # as new requests (untimed)
            t0 = time.perf_counter()
            status = learner.sync_step()
            dt = time.perf_counter() - t0
            if status != "updated":
                raise SystemExit(f"{setting}: update {status}: {learner.last_error}")
            ms.append(dt * 1e3)
            pub.append(learner.snapshot_ms)  # nan where this update did not publish
        ms, pub = ms[3:], [x for x in pub[3:] if x == x]  # warm-up updates left out
        med = statistics.median(ms)
        # Trained positions: each block of an update scores K draft positions.
        positions_per_s = cfg.batch_blocks * k * 1e3 / med
        row = {"loss_vocab": vocab, "learner_compute_dtype": compute,
               "head_dtype": args.head_dtype, "updates": len(ms), "update_ms_median": round(med, 1),
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
