"""Training data at scale: prompts -> several answers each + follow-up turns -> feature shards.

    train prompts --(greedy answers, then follow-up turns, then n sampled answers)-->
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

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

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


# (part "train" / "heldout", round name, the chunk's samples, seconds it took) -> None
ChunkHook = Callable[[str, str, list[Sample], float], None]


def generate_dataset(model_path: str, train: Sequence[Prompt], heldout: Sequence[Prompt],
                     plan: GenerationPlan, *, tokenizer, cache_dir, generate_fn: GenerateFn,
                     dtype: str, token_budget: int | None = None,
                     log: Callable[[str], None] = print,
                     on_chunk: ChunkHook | None = None) -> tuple[list[Sample], list[Sample]]:
    """(train samples, held-out samples). Training samples stop once `token_budget` response
    tokens are in (checked per chunk of prompts); the prompt order is a seeded shuffle, so a
    smaller budget takes a prefix of a larger one's prompts and the cache serves both.
    `on_chunk` sees every chunk's samples as soon as they exist (StreamedFeatures writes their
    features there, so nothing waits for the whole run)."""
    kw = dict(tokenizer=tokenizer, cache_dir=cache_dir, generate_fn=generate_fn, dtype=dtype,
              log=log)
    hook = on_chunk or (lambda part, name, got, seconds: None)
    t0 = time.perf_counter()
    held = generate(model_path, list(heldout), plan.greedy(), **kw) if heldout else []
    if held:
        hook("heldout", "greedy", held, time.perf_counter() - t0)
    order = list(train)
    random.Random(plan.seed).shuffle(order)
    out: list[Sample] = []

    def full() -> bool:
        return token_budget is not None and response_tokens(out) >= token_budget

    # Follow-up turns before the sampled answers: under a budget, multi-turn text (a kind of
    # traffic of its own) comes before a second answer to a prompt already answered.
    rounds: list[tuple[str, SamplingSpec | None]] = [("greedy", plan.greedy())]
    rounds += [(f"follow-up {i + 2}", None) for i in range(plan.followups)]
    if plan.samples:
        rounds.append((f"{plan.samples} sampled", plan.sampled()))
    greedy_text: dict[str, str] = {}
    for name, spec in rounds:
        for s in range(0, len(order), plan.chunk_prompts):
            if full():
                break
            chunk = order[s:s + plan.chunk_prompts]
            t0 = time.perf_counter()
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
            hook("train", name, got, time.perf_counter() - t0)
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
    from .shards import FeatureRow, row_dtype
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
    fdtype = row_dtype(writer.manifest.header.feature_dtype)
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
    from .shards import FeatureRow, row_dtype

    fdtype = row_dtype(writer.manifest.header.feature_dtype)
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


class StreamedFeatures:
    """generate_dataset's `on_chunk`: each chunk's features into its shard folder as soon as the
    chunk exists, so a run of millions of tokens never holds more than one chunk and an
    interrupted run loses at most the chunk it was in.

    Per chunk: the rows vLLM logged while generating it (the feature-log files are read, then
    deleted), the HF target's pass for the rest (answers the generation cache already held),
    then one shard flush. A run stopped between chunks and rerun with the same command writes
    the same shards as one never stopped. Between chunks: a progress line (FOLDER/progress.jsonl:
    response tokens, generation and feature seconds, tokens per second) and the pause file:
    while FOLDER/PAUSE exists, `pause()` is called once (it closes the engine, freeing the cores
    and memory for something else) and the run waits; deleting the file resumes it.
    """

    def __init__(self, folder: str | os.PathLike, header, *, load_target: Callable[[], object],
                 feature_log: str | os.PathLike | None = None, batch_tokens: int = 8192,
                 pause: Callable[[], None] | None = None, poll_s: float = 5.0,
                 log: Callable[[str], None] = print) -> None:
        from .shards import ShardWriter

        self.folder = Path(folder)
        self.header = header
        self.feature_log = Path(feature_log) if feature_log is not None else None
        self._load_target, self._target = load_target, None
        self.batch_tokens, self.pause, self.poll_s, self.log = batch_tokens, pause, poll_s, log
        self.writers = {part: ShardWriter(self.folder / part, header) for part in ("train", "heldout")}
        self.pause_file = self.folder / "PAUSE"

    def __call__(self, part: str, name: str, got: list[Sample], gen_s: float) -> None:
        from .feature_log import read_feature_log

        w = self.writers[part]
        todo = [x for x in got if x.key not in w.done]
        t0 = time.perf_counter()
        logged = 0
        if todo and self.feature_log is not None and self.feature_log.is_dir():
            files = sorted(self.feature_log.glob("log-*.safetensors"))
            if files:
                log = read_feature_log(self.feature_log, list(self.header.layer_ids),
                                       self.header.hidden_size)
                logged = from_feature_log(todo, log, w)
                for f in files:  # consumed: the engine is idle between chunks
                    f.unlink()
        rest = [x for x in todo if x.key not in w.done]
        if rest:
            if self._target is None:
                self._target = self._load_target()
            featurize(self._target, rest, self.header.layer_ids, w, batch_tokens=self.batch_tokens,
                      desc=f"features {part}")
        w.flush()
        feat_s = time.perf_counter() - t0
        tokens = response_tokens(got)
        row = {"part": part, "round": name, "samples": len(got), "new": len(todo),
               "logged": logged, "hf": len(rest), "response_tokens": tokens,
               "gen_s": round(gen_s, 4), "features_s": round(feat_s, 4),  # 0.1 ms: a tiny target's chunk takes ~5 ms
               "tok_s": round(tokens / max(gen_s + feat_s, 1e-9), 1) if todo else None,
               "shard_response_tokens": w.manifest.response_tokens, "time": round(time.time(), 1)}
        with open(self.folder / "progress.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.wait_while_paused()

    def wait_while_paused(self) -> None:
        if not self.pause_file.exists():
            return
        self.log(f"data: paused ({self.pause_file} exists; delete it to resume)")
        if self.pause is not None:
            self.pause()
        while self.pause_file.exists():
            time.sleep(self.poll_s)
        self.log("data: resumed")

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def progress_summary(folder: str | os.PathLike) -> dict:
    """What FOLDER/progress.jsonl says: response tokens in the training shards, samples, and the
    rate of the chunks that generated something (tokens per second of generation + features)."""
    path = Path(folder) / "progress.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    made = [r for r in rows if r["new"]]
    secs = sum(r["gen_s"] + r["features_s"] for r in made)
    tokens = sum(r["response_tokens"] for r in made)
    train = [r for r in rows if r["part"] == "train"]
    return {"chunks": len(rows), "train_response_tokens": train[-1]["shard_response_tokens"] if train else 0,
            "generated_tokens": tokens, "seconds": round(secs, 1),
            "tok_s": round(tokens / secs, 1) if secs else None}
