"""Training data at scale: prompts -> several answers each + follow-up turns -> feature shards.

    train prompts --(greedy answers, then n sampled answers, then follow-up turns)-->
        Samples (generation cache, resumable per batch)
    Samples --(HF target, one prompt pass shared by all of its answers)--> shards + manifest

A few hundred prompts give 500 k+ training tokens this way: every prompt is answered greedily
(what serving decodes), `samples` more times at a temperature with per-prompt seeds, and
continued for `followups` more turns on the target's own greedy answer (multi-turn traffic).
Held-out prompts get one greedy answer each and are never part of a training round.

The token budget (response tokens of the training samples) is checked after every chunk of
prompts, so generation stops close to it instead of after a whole round.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .data import Prompt, follow_up
from .generate import GenerateFn, Sample, SamplingSpec, generate


@dataclass(frozen=True)
class GenerationPlan:
    max_new_tokens: int = 192
    samples: int = 0  # sampled answers per training prompt, besides the greedy one
    temperature: float = 0.8
    # No nucleus cut: vLLM's CPU top-p sorts the whole vocabulary of every sequence at every
    # step (1.0 s for 128 x 49 152 logits on this 2-core box, more than the model's forward).
    # A sampled round made 63 response tokens/s with top-p 0.95 (288 sequences in flight) and
    # 112 without it (128 in flight); greedy rounds 180. The temperature alone keeps the
    # answers the target's own, at T = 0.8.
    top_p: float = 1.0
    followups: int = 0  # follow-up turns per training prompt (on its greedy answer)
    followup_temperature: float = 0.8
    seed: int = 0
    chunk_prompts: int = 96  # prompts per generate() call: the budget is checked between them

    def __post_init__(self) -> None:
        checks = {"max_new_tokens": self.max_new_tokens >= 1, "samples": self.samples >= 0,
                  "temperature": self.temperature > 0, "top_p": 0 < self.top_p <= 1,
                  "followups": self.followups >= 0, "followup_temperature": self.followup_temperature >= 0,
                  "chunk_prompts": self.chunk_prompts >= 1}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid generation setting {bad[0]}={getattr(self, bad[0])!r}")

    def greedy(self) -> SamplingSpec:
        return SamplingSpec(temperature=0.0, n=1, max_tokens=self.max_new_tokens)

    def sampled(self) -> SamplingSpec:
        return SamplingSpec(temperature=self.temperature, n=self.samples, top_p=self.top_p,
                            max_tokens=self.max_new_tokens, seed=self.seed)

    def followup(self) -> SamplingSpec:
        t = self.followup_temperature
        return SamplingSpec(temperature=t, n=1, top_p=self.top_p if t > 0 else 1.0,
                            max_tokens=self.max_new_tokens, seed=self.seed + 1)


def response_tokens(samples: Sequence[Sample]) -> int:
    return sum(s.response_tokens for s in samples)


def generate_dataset(model_path: str, train: Sequence[Prompt], heldout: Sequence[Prompt],
                     plan: GenerationPlan, *, tokenizer, cache_dir, generate_fn: GenerateFn,
                     dtype: str, token_budget: int | None = None,
                     log: Callable[[str], None] = print) -> tuple[list[Sample], list[Sample]]:
    """(train samples, held-out samples). Training samples stop once `token_budget` response
    tokens are in (checked per chunk of prompts); the prompt order is a seeded shuffle, so a
    smaller budget takes a prefix of a larger one's prompts and the cache serves both."""
    kw = dict(tokenizer=tokenizer, cache_dir=cache_dir, generate_fn=generate_fn, dtype=dtype,
              log=log)
    held = generate(model_path, list(heldout), plan.greedy(), **kw) if heldout else []
    order = list(train)
    random.Random(plan.seed).shuffle(order)
    out: list[Sample] = []

    def full() -> bool:
        return token_budget is not None and response_tokens(out) >= token_budget

    rounds: list[tuple[str, SamplingSpec | None]] = [("greedy", plan.greedy())]
    if plan.samples:
        rounds.append((f"{plan.samples} sampled", plan.sampled()))
    rounds += [(f"follow-up {i + 2}", None) for i in range(plan.followups)]
    greedy_text: dict[str, str] = {}
    for name, spec in rounds:
        for s in range(0, len(order), plan.chunk_prompts):
            if full():
                break
            chunk = order[s:s + plan.chunk_prompts]
            if spec is None:  # a follow-up turn on each prompt's greedy answer
                idx = int(name.rsplit(" ", 1)[1]) - 2
                chunk = [follow_up(p, greedy_text[p.id], idx) for p in chunk if p.id in greedy_text]
                got = generate(model_path, chunk, plan.followup(), **kw)
            else:
                got = generate(model_path, chunk, spec, **kw)
            if name == "greedy":
                for x in got:
                    greedy_text[x.prompt_id] = tokenizer.decode(x.ids[x.start:],
                                                                skip_special_tokens=True)
            out += got
            log(f"data: {name}: {min(s + plan.chunk_prompts, len(order))}/{len(order)} prompts, "
                f"{response_tokens(out)} training response tokens so far")
        if full():
            break
    if token_budget is not None:
        out = _cut_to_budget(out, token_budget)
    return out, held


def _cut_to_budget(samples: list[Sample], budget: int) -> list[Sample]:
    keep, n = [], 0
    for x in samples:
        if n >= budget:
            break
        keep.append(x)
        n += x.response_tokens
    return keep


# -- features into shards ---------------------------------------------------------------------------

def featurize(target, samples: Sequence[Sample], layer_ids: Sequence[int], writer, *,
              batch_tokens: int = 8192, desc: str = "features") -> None:
    """Target features of every sample not yet in `writer` (a shards.ShardWriter), written
    shard by shard. Samples that share a prompt run the prompt once (shared_prefix_features);
    single samples run batched by length. Progress: a bar over tokens computed."""
    import torch
    from tqdm.auto import tqdm

    from .features import shared_prefix_features
    from .shards import FeatureRow
    from .trainer import extract_features

    todo = [s for s in samples if s.key not in writer.done]
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for s in todo:
        groups.setdefault(tuple(s.ids[:s.start]), []).append(s)
    singles = [g[0] for g in groups.values() if len(g) == 1]
    shared = [g for g in groups.values() if len(g) > 1]
    total = sum(len(g[0].ids[:g[0].start]) + sum(x.response_tokens for x in g) for g in shared)
    total += sum(len(s.ids) for s in singles)
    bar = tqdm(total=total, desc=desc, unit="tok", leave=False)
    fdtype = getattr(torch, writer.manifest.header.feature_dtype)
    for g in shared:
        # Bound the continuation batch: n x longest answer tokens per forward.
        per = max(1, batch_tokens // max(x.response_tokens for x in g))
        for c in range(0, len(g), per):
            part = g[c:c + per]
            feats = shared_prefix_features(target, part[0].ids[:part[0].start],
                                           [x.ids[x.start:] for x in part], layer_ids)
            for x, (aux, final) in zip(part, feats):
                writer.add(FeatureRow(key=x.key, ids=torch.tensor(x.ids), start=x.start,
                                      aux=aux.to(fdtype), final=final.to(fdtype)))
            bar.update((part[0].start if c == 0 else 0) + sum(x.response_tokens for x in part))
    for s in range(0, len(singles), 64):
        part = singles[s:s + 64]
        for x, ex in zip(part, extract_features(target, part, list(layer_ids), dtype=fdtype,
                                                batch_tokens=batch_tokens, desc=desc)):
            writer.add(FeatureRow(key=x.key, ids=ex.ids, start=ex.start, aux=ex.aux,
                                  final=ex.final))
        bar.update(sum(len(x.ids) for x in part))
    bar.close()
    writer.flush()


def from_feature_log(samples: Sequence[Sample], logged, writer) -> int:
    """Write the samples the vLLM feature log holds (training/feature_log.py) into `writer`;
    the number written. vLLM never computes the last sampled token, so a sample's row is its
    ids without the last token (whose features nothing in training reads: a block needs the
    target's distribution after each of its positions)."""
    import torch

    from .feature_log import ids_key
    from .shards import FeatureRow

    fdtype = getattr(torch, writer.manifest.header.feature_dtype)
    n = 0
    for x in samples:
        if x.key in writer.done or len(x.ids) - 1 <= x.start:
            continue
        seq = logged.sequences.get(ids_key(x.ids[:-1]))
        if seq is None:
            continue
        writer.add(FeatureRow(key=x.key, ids=seq.ids, start=x.start, aux=seq.aux.to(fdtype),
                              final=seq.final.to(fdtype)))
        n += 1
    writer.flush()
    return n
