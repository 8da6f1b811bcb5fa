"""Offline trainer throughput: supervised draft rows per second per recipe setting, same data.

    python lab/trainer_throughput.py --data RUN/data --steps 12 \
        --out docs/results/trainer_throughput.json

Times `--steps` optimizer steps (after 2 untimed warm-up steps) of the trainer's own
`train_step` on the same batches of a training run's feature shards for each setting: the
shipped recipe's (reverse-KL distillation that runs the target's head over every row each
step, 8 anchors per sequence, float32) and the dense ones (CE to the target's argmax cached
once per sequence, up to N anchors per sequence, float32 or bf16 autocast), at 1 and 2
drafter layers. A row is one labelled draft position (a block's K rows); the figure is rows
per second of wall time, the context projection and the optimizer step included. Settings run
interleaved in rounds (the second in reverse order) and the median over rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

SETTINGS = {
    # name: (loss mode, anchors per sequence, compute dtype)
    "shipped: reverse-KL, 8 anchors, fp32": ("reverse_kl", 8, "float32"),
    "CE cached, 8 anchors, fp32": ("ce", 8, "float32"),
    "CE cached, 128 anchors, fp32": ("ce", 128, "float32"),
    "CE cached, 128 anchors, bf16": ("ce", 128, "bfloat16"),
    "CE cached, 256 anchors, bf16": ("ce", 256, "bfloat16"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a training run's data folder (train/ shards)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--sequences", type=int, default=64, help="shard sequences to draw batches from")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig

    from vllm_onlinespec.config import LossConfig
    from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter
    from vllm_onlinespec.models import resolve
    from vllm_onlinespec.training.blocks import LossVocab
    from vllm_onlinespec.training.shards import iter_shards, read_manifest
    from vllm_onlinespec.training.trainer import (Example, add_target_labels, collate,
                                                  load_target, make_optimizer, train_step)

    torch.set_num_threads(args.threads)
    target_path = resolve(args.target)
    folder = Path(args.data) / "train"
    header = read_manifest(folder).header
    ex = []
    for r in iter_shards(folder, header):
        ex.append(Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final))
        if len(ex) >= args.sequences:
            break
    target = load_target(target_path)
    embed_w = target.get_input_embeddings().weight.detach().float()
    lm_head_w = target.get_output_embeddings().weight.detach().float()
    add_target_labels(ex, lm_head_w)
    vocab = LossVocab.of(lm_head_w, torch.cat([e.ids for e in ex] + [e.tgt for e in ex]))
    batches = [collate(ex[i:i + args.batch_size]) for i in range(0, len(ex), args.batch_size)]
    plain = [{k: v for k, v in b.items() if k != "target_ids"} for b in batches]
    tcfg = AutoConfig.from_pretrained(target_path)

    def run(layers: int, name: str) -> dict:
        mode, anchors, dtype = SETTINGS[name]
        dcfg = DFlashConfig.for_target(tcfg, mask_token_id=0, num_layers=layers,
                                       target_layer_ids=list(header.layer_ids), block_size=5)
        torch.manual_seed(0)
        drafter = DFlashDrafter(dcfg).float()
        params = list(drafter.parameters())
        opt = make_optimizer(params, 1e-3, 0.01)
        loss_cfg = LossConfig(mode=mode, gamma=7.0 if mode != "ce" else 2.5)
        data = batches if mode == "ce" else plain
        rows, t_total = 0, 0.0
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            st, _ = train_step(drafter, data[i % len(data)], anchors, i, embed_w, lm_head_w, opt,
                               params, loss_cfg=loss_cfg, grad_clip=1.0, vocab=vocab,
                               compute_dtype=getattr(torch, dtype))
            if i >= 2:
                t_total += time.perf_counter() - t0
                rows += st.rows
        return {"rows": rows, "seconds": t_total, "rows_per_s": rows / t_total}

    results: dict[str, list[dict]] = {}
    names = list(SETTINGS)
    layer_list = [int(x) for x in args.layers.split(",")]
    for rnd in range(args.rounds):
        order = [(lay, n) for lay in layer_list for n in names]
        for lay, n in (order if rnd % 2 == 0 else order[::-1]):
            r = run(lay, n)
            results.setdefault(f"{lay}|{n}", []).append(r)
            print(f"round {rnd} layers {lay} {n}: {r['rows_per_s']:.0f} rows/s", flush=True)
    rows = []
    for key, rs in results.items():
        lay, name = key.split("|")
        rates = [r["rows_per_s"] for r in rs]
        rows.append({"layers": int(lay), "setting": name, "rows_per_s": statistics.median(rates),
                     "min": min(rates), "max": max(rates), "rounds": len(rs)})
    meta = {"box": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                   f"threads", "steps": args.steps, "batch_size": args.batch_size,
            "sequences": len(ex), "loss_vocab": len(vocab), "data": str(args.data),
            "command": "python lab/trainer_throughput.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    base = {r["layers"]: r["rows_per_s"] for r in rows if r["setting"].startswith("shipped")}
    md = ["| layers | setting | draft rows/s (median, min-max) | vs shipped |", "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['layers']} | {r['setting']} | {r['rows_per_s']:.0f} ({r['min']:.0f}-"
                  f"{r['max']:.0f}) | {r['rows_per_s'] / base[r['layers']]:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
