"""Where training features should come from: logged by vLLM while it
generates (`vllm-onlinespec train --features vllm`) or a second pass of the HF target over the
generated answers (`--features hf`). Same prompts, same engine settings, one engine at a time.

    python benchmarks/feature_source.py --spec-bench ../shared/data/spec_bench/question.jsonl \
        --prompts 96 --repeats 2 --out runs/feature_source

Per repeat and source, wall time from nothing to feature shards on disk, engine start-up
included: generation (vLLM bf16, the recipe's batch, fresh generation cache), then features
(hf: load the fp32 HF target and run the trainer's featurize; vllm: read the feature log into
shards). Sources alternate in order across repeats. Prints a table and writes
OUT/feature_source.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path


def run_source(source: str, target: str, prompts, tok, out: Path, max_tokens: int, cfg) -> dict:
    import torch

    from vllm_onlinespec.training.cli import drafter_config, feature_log_spec
    from vllm_onlinespec.training.dataset import featurize, from_feature_log
    from vllm_onlinespec.training.feature_log import read_feature_log
    from vllm_onlinespec.training.generate import (SamplingSpec, generate, model_fingerprint,
                                                   vllm_generate_fn)
    from vllm_onlinespec.training.shards import ShardHeader, ShardWriter, target_fingerprint
    from vllm_onlinespec.training.trainer import load_target

    shutil.rmtree(out, ignore_errors=True)
    tcfg, dcfg = drafter_config(target, cfg)
    layers = list(dcfg.target_layer_ids)
    header = ShardHeader(target=target_fingerprint(model_fingerprint(target)),
                         layer_ids=tuple(layers), hidden_size=int(tcfg.hidden_size))
    t0 = time.perf_counter()
    log_spec = feature_log_spec(target, cfg, out) if source == "vllm" else None
    fn = vllm_generate_fn(target, "bfloat16", feature_log=log_spec)
    try:
        samples = generate(target, prompts, SamplingSpec(max_tokens=max_tokens), tokenizer=tok,
                           cache_dir=out / "gen", generate_fn=fn, log=lambda m: None)
    finally:
        fn.close()
    t1 = time.perf_counter()
    writer = ShardWriter(out / "shards", header)
    from_log = 0
    if log_spec is not None:
        logged = read_feature_log(log_spec.dir, layers, int(tcfg.hidden_size))
        from_log = from_feature_log(samples, logged, writer)
    hf_rows = [s for s in samples if s.key not in writer.done]
    if hf_rows:
        torch.set_num_threads(2)
        featurize(load_target(target, "float32"), hf_rows, layers, writer, desc=f"{source} hf")
    writer.close()
    t2 = time.perf_counter()
    resp = sum(s.response_tokens for s in samples)
    return {"source": source, "samples": len(samples), "response_tokens": resp,
            "sequence_tokens": sum(len(s.ids) for s in samples), "from_log": from_log,
            "hf_pass": len(hf_rows), "generate_s": round(t1 - t0, 1),
            "features_s": round(t2 - t1, 1), "total_s": round(t2 - t0, 1),
            "response_tok_per_s": round(resp / (t2 - t0), 1),
            "answers": {s.key: s.ids[s.start:] for s in samples}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec-bench", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="runs/feature_source")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_onlinespec import models
    from vllm_onlinespec.training.data import exclude_categories, load_spec_bench
    from vllm_onlinespec.training.generate import chat_ids
    from vllm_onlinespec.training.trainer import TrainConfig

    target = models.resolve(args.target)
    tok = AutoTokenizer.from_pretrained(target)
    pool = [p for p in exclude_categories(load_spec_bench(args.spec_bench), ["math_reasoning"])
            if len(chat_ids(tok, p)) <= 512]
    prompts = pool[:args.prompts]
    # The shipped recipe's drafter shape: its layers are the ones logged / computed.
    cfg = TrainConfig(num_layers=1, block_size=5, num_target_features=3, mask_token_id=0)
    out = Path(args.out)
    runs = []
    for r in range(args.repeats):
        order = ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")
        for source in order:
            row = run_source(source, target, prompts, tok, out / f"{source}-{r}", args.max_tokens,
                             cfg)
            row["repeat"] = r
            runs.append(row)
            print(f"repeat {r} {source}: generate {row['generate_s']} s, features "
                  f"{row['features_s']} s, total {row['total_s']} s, "
                  f"{row['response_tok_per_s']} response tok/s ({row['from_log']} from the log, "
                  f"{row['hf_pass']} by the HF pass)", flush=True)
    # Greedy answers of the two engines (plain vLLM; the logging engine decodes at K = 0)
    same = [a["answers"] == b["answers"] for a in runs if a["source"] == "hf"
            for b in runs if b["source"] == "vllm" and b["repeat"] == a["repeat"]]
    summary = {}
    for source in ("hf", "vllm"):
        rs = [x for x in runs if x["source"] == source]
        summary[source] = {k: {"median": statistics.median(x[k] for x in rs),
                               "min": min(x[k] for x in rs), "max": max(x[k] for x in rs)}
                           for k in ("generate_s", "features_s", "total_s", "response_tok_per_s")}
    for x in runs:
        x.pop("answers")
    out.mkdir(parents=True, exist_ok=True)
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
              "same_greedy_answers": same, "summary": summary, "runs": runs}
    (out / "feature_source.json").write_text(json.dumps(result, indent=1))
    lines = ["| source | generate s | features s | total s | response tok/s (end to end) |",
             "|---|---|---|---|---|"]
    for source, s in summary.items():
        lines.append(f"| {source} | " + " | ".join(
            f"{s[k]['median']:.1f} ({s[k]['min']:.1f}-{s[k]['max']:.1f})"
            for k in ("generate_s", "features_s", "total_s", "response_tok_per_s")) + " |")
    md = "\n".join(lines) + "\n"
    (out / "feature_source.md").write_text(md)
    print(md + f"greedy answers identical between the two engines, per repeat: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
