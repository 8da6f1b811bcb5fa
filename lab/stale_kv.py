"""What `publish.kv_policy: tolerate` costs: drafting against stale context K/V.

vLLM precomputes each committed token's context keys/values into the drafter's KV cache once
(DFlashProposer -> precompute_and_store_context_kv) and keeps them when we publish new weights.
A request in flight at a publish therefore drafts with new queries against K/V that older
weights projected. This script measures, on prompts neither drafter has seen, the greedy
acceptance length of the newer weights (--learned) with

    fresh K/V            every context row projected by the newer weights (what re-projecting
                         the cache after each publish would buy)
    prompt K/V by older  the prompt's rows by the older weights (--start), the response's by
                         the newer ones: a request admitted before the update
    all K/V by older     every context row by the older weights (the bound: nothing re-projected)

next to the older weights themselves. Offline, on the PyTorch twin (parity with vLLM: tests).
The gap depends on how far the weights moved: compare the start drafter with the end of a run
(the worst case) and two checkpoints a request's lifetime apart (what serving sees).

    python lab/stale_kv.py --start DRAFTER --learned runs/domain_shift/checkpoints/online-ogd \\
        --spec-bench $SPEC_BENCH --category math_reasoning \\
        --exclude runs/domain_shift/stream.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def hf_greedy(target, tok):
    """A GenerateFn on the HF target (fp32 greedy = vLLM fp32 greedy, tested), so no engine."""
    def fn(prompt_ids, spec):
        out = []
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=spec.max_tokens,
                                do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id or tok.eos_token_id)
            out.append([y[0, len(ids):].tolist()])
        return out
    return fn


def drafter_folder(path: Path) -> Path:
    """A drafter folder, one learner checkpoint (its model/), or the newest complete checkpoint
    in a checkpoint directory."""
    from vllm_onlinespec.learner.checkpoint import MODEL_DIR, latest_complete

    if (path / "config.json").is_file():
        return path
    if (path / MODEL_DIR / "config.json").is_file():
        return path / MODEL_DIR
    ck = latest_complete(path)
    if ck is None or not (ck / MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no drafter folder and no complete checkpoint with "
                                f"{MODEL_DIR}/config.json")
    return ck / MODEL_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", required=True, help="older weights: drafter folder, checkpoint, "
                    "or checkpoint dir (newest)")
    ap.add_argument("--learned", required=True, help="newer weights: the same kinds")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--spec-bench", required=True)
    ap.add_argument("--category", default="math_reasoning")
    ap.add_argument("--exclude", help="a stream.jsonl whose prompts are left out (seen by the learner)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--cache", help="keep the target's generations here (default: a temp dir)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_onlinespec.drafter.checkpoint import load_drafter
    from vllm_onlinespec.models import resolve
    from vllm_onlinespec.training.data import load_spec_bench
    from vllm_onlinespec.training.generate import SamplingSpec, generate
    from vllm_onlinespec.training.settings import TrainerSettings
    from vllm_onlinespec.training.trainer import evaluate, extract_features, load_target

    target_path = resolve(args.target)
    tok = AutoTokenizer.from_pretrained(target_path)
    seen = set()
    if args.exclude:
        seen = {json.loads(x)["messages"][-1]["content"] for x in open(args.exclude) if x.strip()}
    prompts = [p for p in load_spec_bench(args.spec_bench, [args.category]) if p.text not in seen]
    prompts = prompts[:args.num_prompts]
    target = load_target(target_path, "float32")
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or tmp
        samples = generate(target_path, prompts, SamplingSpec(max_tokens=args.max_tokens),
                           tokenizer=tok, cache_dir=cache, generate_fn=hf_greedy(target, tok))
    dcfg, start, _ = load_drafter(drafter_folder(Path(args.start)), dtype=torch.float32)
    _, learned, _ = load_drafter(drafter_folder(Path(args.learned)), dtype=torch.float32)
    examples = extract_features(target, samples, list(dcfg.target_layer_ids), dtype=torch.float32)
    embed_w = target.get_input_embeddings().weight.detach().float()
    lm_head_w = target.get_output_embeddings().weight.detach().float()
    cfg = TrainerSettings(eval_anchors=32)

    def spliced(stale_rows):
        def fn(batch):
            t = batch["ids"].shape[1]
            pos = torch.arange(t).expand(batch["ids"].shape[0], t)
            old = start.context_kv(batch["aux"], pos)
            new = learned.context_kv(batch["aux"], pos)
            stale = stale_rows(batch, t).view(*pos.shape, 1, 1)
            return [(torch.where(stale, ko, kn), torch.where(stale, vo, vn))
                    for (ko, vo), (kn, vn) in zip(old, new, strict=True)]
        return fn

    prompt_rows = lambda b, t: torch.arange(t).view(1, -1) < b["starts"].view(-1, 1)  # noqa: E731
    all_rows = lambda b, t: torch.ones(b["ids"].shape[0], t, dtype=torch.bool)  # noqa: E731
    with torch.no_grad():
        rows = {
            "older weights": evaluate(start, None, examples, embed_w, lm_head_w, cfg),
            "newer, fresh K/V": evaluate(learned, None, examples, embed_w, lm_head_w, cfg),
            "newer, prompt K/V by older": evaluate(learned, None, examples, embed_w, lm_head_w, cfg,
                                                   spliced(prompt_rows)),
            "newer, all K/V by older": evaluate(learned, None, examples, embed_w, lm_head_w, cfg,
                                                spliced(all_rows)),
        }
    print(f"{len(examples)} unseen {args.category} prompts, {rows['older weights']['blocks']} "
          f"blocks with all K labels\n")
    print("| drafter / context K/V | acceptance length | first-token match |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['acceptance']:.3f} | {r['match'][0]:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
