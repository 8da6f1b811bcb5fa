"""Drafter training settings compared at equal wall time on a run's feature shards.

    python benchmarks/drafter_ablation.py --data runs/drafter/main/data --budget-s 300 \
        --variant vocab=seen,anchors=8 --variant vocab=full,anchors=16 ... \
        --out runs/drafter/ablation.json

Each variant trains a fresh drafter on the shards of `--data`/train (`--shards` of them) for
`--budget-s` seconds of wall time (the held-out evaluations excluded), then reports held-out
greedy acceptance (`--data`/heldout, whole vocabulary, as the trainer's evaluation) at three
checkpoints in that budget. On a 2-core CPU a setting that is better per step can be worse per
second, so settings are compared per second. Run variants one after another on an otherwise idle
box: two side by side corrupt each other's timings.

Variant keys (defaults = the trainer's): vocab (seen|full), anchors, bs (sequences per step),
lr, layers, block, init (rand|norm|layer: copy the target's final norm / also its last layers
into the drafter), alpha, mode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def parse_variant(spec: str) -> dict[str, str]:
    known = {"vocab", "anchors", "bs", "lr", "layers", "block", "init", "alpha", "mode"}
    out = {}
    for kv in filter(None, spec.split(",")):
        k, sep, v = kv.partition("=")
        if not sep or k not in known:
            raise SystemExit(f"--variant {spec!r}: expected key=value with key in {sorted(known)}")
        out[k] = v
    return out


def run_variant(spec: str, train, held, target: dict, tcfg, layer_ids: list[int], mask_id: int,
                budget_s: float) -> dict:
    from vllm_onlinespec.config import LossConfig
    from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter
    from vllm_onlinespec.training.blocks import LossVocab
    from vllm_onlinespec.training.trainer import (TrainConfig, collate, epoch_batches, evaluate,
                                                  make_optimizer, train_step)

    o = parse_variant(spec)
    layers, bs, anchors = int(o.get("layers", 1)), int(o.get("bs", 4)), int(o.get("anchors", 16))
    lr = float(o.get("lr", 1e-3))
    embed = target["model.embed_tokens.weight"]
    lm = target.get("lm_head.weight", embed)
    dcfg = DFlashConfig.for_target(tcfg, mask_token_id=mask_id, num_layers=layers,
                                   num_target_features=len(layer_ids),
                                   block_size=int(o.get("block", 5)), target_layer_ids=layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg).float()
    if o.get("init", "rand") in ("norm", "layer"):
        drafter.norm.weight.data.copy_(target["model.norm.weight"])
    if o.get("init") == "layer":
        n = tcfg.num_hidden_layers
        for j, layer in enumerate(drafter.layers):
            pre = f"model.layers.{n - layers + j}."
            layer.load_state_dict({k[len(pre):]: v for k, v in target.items() if k.startswith(pre)},
                                  strict=False)  # the target has no q/k norms: those stay 1
    loss_cfg = LossConfig(alpha=float(o.get("alpha", 0.8)), mode=o.get("mode", "reverse_kl"),
                          vocab=o.get("vocab", "seen"))
    cfg = TrainConfig(num_layers=layers, block_size=dcfg.block_size, batch_size=4,
                      eval_anchors=16, loss=loss_cfg, length_head=False)
    vocab = LossVocab.of(lm, torch.cat([e.ids for e in train])) if loss_cfg.vocab == "seen" else None
    params = list(drafter.parameters())
    opt = make_optimizer(params, lr, cfg.weight_decay)
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    lengths = [len(e.ids) for e in train]
    step, epoch, train_s, evals = 0, 0, 0.0, []
    while train_s < budget_s:
        for b in epoch_batches(lengths, bs, 0, epoch):
            t0 = time.perf_counter()
            train_step(drafter, collate([train[i] for i in b]), anchors, step, embed, lm, opt,
                       params, loss_cfg=loss_cfg, grad_clip=cfg.grad_clip, vocab=vocab)
            sched.step()
            step += 1
            train_s += time.perf_counter() - t0
            if train_s >= budget_s * (len(evals) + 1) / 3:
                ev = evaluate(drafter, None, held, embed, lm, cfg)
                evals.append({"step": step, "train_s": round(train_s, 1),
                              "accept_len_offline": round(ev["acceptance"], 3), "match": ev["match"]})
                print(f"  {spec}: step {step}, {train_s:.0f} s, held-out acceptance "
                      f"{ev['acceptance']:.3f}, match {ev['match']}", flush=True)
                if len(evals) == 3:
                    break
        epoch += 1
    return {"variant": spec, "settings": o, "steps_per_s": round(step / train_s, 2),
            "loss_vocab_size": len(vocab) if vocab is not None else int(lm.shape[0]),
            "evals": evals}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a training run's feature-shard folder")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--shards", type=int, default=None, help="training shards used (default all)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for v in args.variant:
        parse_variant(v)  # bad variants fail before minutes of loading

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from vllm_onlinespec.models import resolve
    from vllm_onlinespec.training.shards import iter_shards, read_manifest
    from vllm_onlinespec.training.trainer import Example

    torch.set_num_threads(args.threads)
    data = Path(args.data)
    header = read_manifest(data / "train").header
    man = read_manifest(data / "train")
    keys = [kk for s in man.shards[:args.shards] for kk in s.keys]
    train = [Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final)
             for r in iter_shards(data / "train", header, keys)]
    held = [Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final)
            for r in iter_shards(data / "heldout", header)]
    path = resolve(args.target)
    tcfg = AutoConfig.from_pretrained(path)
    target = {k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    # The mask token of the run the shards came from (its exported drafter sits beside them).
    run_cfg = data.parent / "config.json"
    mask_id = (json.loads(run_cfg.read_text())["dflash_config"]["mask_token_id"]
               if run_cfg.is_file() else 0)
    print(f"{len(train)} training sequences, {len(held)} held out; budget {args.budget_s:.0f} s "
          f"per variant")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else []
    for v in args.variant:
        results.append(run_variant(v, train, held, target, tcfg, list(header.layer_ids), mask_id,
                                   args.budget_s))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    for r in results:
        last = r["evals"][-1] if r["evals"] else {}
        print(f"{r['variant']:40s} {r['steps_per_s']:5.2f} steps/s  held-out acceptance "
              f"{last.get('accept_len_offline', float('nan')):.3f} after {last.get('train_s', 0):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
