"""What storing the drafter's training features in FP8 loses: a data run's held-out shards read
as stored (bf16) and after the fp8 round trip the shard writer applies
(training/shards.py: each token's features per target layer scaled by their own max).

    python lab/fp8_features.py --data DATA_DIR [--drafter DIR] [--limit N] --out docs/results

Measured on the same held-out answers: (1) the target's labels (argmax of the final hidden
state through the LM head) from fp8 against bf16; (2) the KL of the target's distribution
from fp8 to bf16 (what the reverse-KL loss would train toward); (3) a trained drafter's greedy
block acceptance with its input features fp8 against bf16, labels from bf16 in both (how much
of what the drafter reads survives). Writes OUT/fp8_features.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def round_trip(x, groups: int) -> torch.Tensor:
    from vllm_onlinespec.training.shards import ScaledFeatures, fp8_encode

    data, scale = fp8_encode(x.float(), groups)
    return ScaledFeatures(data, scale).float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a training run's data folder (DATA/heldout)")
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=0, help="held-out answers (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d", time.gmtime()))
    args = ap.parse_args()

    from vllm_onlinespec import models
    from vllm_onlinespec.config import LossConfig
    from vllm_onlinespec.drafter import load_draft_vocab
    from vllm_onlinespec.training.trainer import (Example, add_target_labels, block_accepts,
                                                  heldout_inputs)

    torch.set_num_threads(args.threads)
    t0 = time.time()
    drafter_path = args.drafter or str(models.shipped_drafter(args.target))
    inp = heldout_inputs(args.data, str(models.pull(args.target)))
    held = inp.examples[: args.limit] if args.limit else inp.examples
    groups = len(inp.layer_ids)
    _, drafter = inp.drafter(drafter_path)
    vocab = load_draft_vocab(drafter_path, dtype=torch.float32)
    w = inp.lm_head_w
    agree = total = 0
    kl_sum = 0.0
    acc = {"bf16": [0, 0], "fp8": [0, 0]}
    for e in held:
        ref = Example(ids=e.ids, start=e.start, aux=e.aux.float(), final=e.final.float())
        q = Example(ids=e.ids, start=e.start, aux=round_trip(e.aux, groups),
                    final=round_trip(e.final, 1))
        lo = max(0, e.start - 1)
        with torch.no_grad():
            lp_ref = torch.log_softmax(ref.final[lo:] @ w.T, -1)
            lp_q = torch.log_softmax(q.final[lo:] @ w.T, -1)
        agree += int((lp_ref.argmax(-1) == lp_q.argmax(-1)).sum())
        total += lp_ref.shape[0]
        kl_sum += float((lp_ref.exp() * (lp_ref - lp_q)).sum())
        add_target_labels([ref], w)
        q.tgt = ref.tgt  # the same labels: only the drafter's input differs
        for name, ex in (("bf16", ref), ("fp8", q)):
            a = block_accepts(drafter, ex, inp.embed_w, w, LossConfig(mode="ce"), draft_vocab=vocab)
            acc[name][0] += sum(a)
            acc[name][1] += len(a)
    summary = {
        "date": args.date, "answers": len(held), "positions": total,
        "label_agreement": round(agree / total, 5), "kl_nats_per_position": round(kl_sum / total, 6),
        "block_accept_bf16": round(acc["bf16"][0] / acc["bf16"][1], 4),
        "block_accept_fp8": round(acc["fp8"][0] / acc["fp8"][1], 4), "blocks": acc["bf16"][1],
        "bytes_per_token_bf16": 2 * (groups + 1) * inp.embed_w.shape[1],
        "bytes_per_token_fp8": (groups + 1) * inp.embed_w.shape[1] + 4 * (groups + 1),
        "K": drafter.config.num_draft_tokens, "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_features.json").write_text(json.dumps(summary, indent=1) + "\n")
        s = summary
        (out / "fp8_features.md").write_text(
            "# Drafter training features in FP8: what the round trip loses\n\n"
            f"{s['date']}. Made by `lab/fp8_features.py` (offline, no engine): {s['answers']} "
            f"held-out answers of the `smollm2-10m` data run ({s['positions']} positions), "
            "features as stored (bf16, from vLLM) and after the shard writer's fp8 round trip "
            "(each token's features per target layer scaled by their own max into float8_e4m3fn).\n\n"
            "```bash\npython lab/fp8_features.py --data DATA --out docs/results\n```\n\n"
            "| measure | bf16 | fp8 |\n|---|---|---|\n"
            f"| bytes per stored token (3 layers + final, H = 576) | {s['bytes_per_token_bf16']} | "
            f"{s['bytes_per_token_fp8']} |\n"
            f"| the target's label (argmax) equal to bf16's | 1 | {s['label_agreement']:.5f} |\n"
            f"| KL(target bf16 \\|\\| target fp8), nats per position | 0 | {s['kl_nats_per_position']:.6f} |\n"
            f"| shipped drafter's accepted drafts per block (greedy, K = {s['K']}, {s['blocks']} blocks) | "
            f"{s['block_accept_bf16']:.4f} | {s['block_accept_fp8']:.4f} |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
