"""`vllm-onlinespec train`: offline distillation of a DFlash drafter.

    prompts (jsonl / Spec-Bench / HumanEval) -> train / held-out split by prompt
      -> the target's own answers (vLLM, cached) -> trainer.train -> a vLLM-loadable drafter

Every flag but --recipe is generated from a field of training/settings.py's TrainSettings.
Settings resolve as: field defaults < --recipe < explicit flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Literal, get_args, get_origin

from .settings import RECIPES, SECTIONS, SPEC_BENCH_ENV, Command, TrainSettings

EXCLUSIVE = ("epochs", "steps")  # one or the other; an explicit one beats a recipe's other


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train", help="train a DFlash drafter offline for an HF target",
        description="Train a DFlash drafter on the target's own answers to prompts. Settings: "
                    "field defaults < --recipe < explicit flags; 'none' unsets an optional one.")
    t.add_argument("--recipe", choices=sorted(RECIPES), help="named settings; " + "; ".join(
        f"{name}: {r.why}" for name, r in RECIPES.items()))
    add_settings_flags(t)
    t.set_defaults(func=run_train)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per TrainSettings field, in its section's group. A flag not given stays out of
    the namespace (argparse.SUPPRESS), so a recipe's value stands."""
    groups = {sec: parser if sec is Command else parser.add_argument_group(sec.__doc__)
              for sec in SECTIONS}
    exclusive = None
    for name, field in TrainSettings.model_fields.items():
        where = groups[next(sec for sec in SECTIONS if name in sec.model_fields)]
        if name in EXCLUSIVE:
            exclusive = exclusive or where.add_mutually_exclusive_group()
            where = exclusive
        where.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                           help=_help(field), **_parsed_as(field))


def _parsed_as(field) -> dict:
    """argparse's action, type or choices for a field's annotation."""
    ann = field.annotation
    kw = {k: v for k, v in (field.json_schema_extra or {}).items() if k == "metavar"}
    if ann is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(ann) is list:
        return {**kw, "nargs": "+", "action": "extend"}
    if get_origin(ann) is Literal:
        return {"choices": list(get_args(ann))}
    members = [a for a in get_args(ann) if a is not type(None)] or [ann]
    kind = members[0] if len(members) == 1 else str  # int | 'auto': pydantic reads the text
    return {**kw, "type": _or_none(kind) if type(None) in get_args(ann) else kind}


def _or_none(kind: type):
    def parse(text: str):
        return None if text == "none" else kind(text)
    parse.__name__ = kind.__name__  # argparse's "invalid int value"
    return parse


def _help(field) -> str:
    text, d = field.description or "", field.default
    if "default" not in text and d != []:
        shown = "none" if d is None else ("on" if d else "off") if isinstance(d, bool) else d
        text += f" (default {shown})"
    return text.replace("%", "%%")


def resolve_settings(args: argparse.Namespace) -> TrainSettings:
    """Field defaults < --recipe < explicit flags, then what depends on the machine or other
    files: --out's default, --init-from's shape, --spec-bench auto, --threads auto."""
    given = {k: v for k, v in vars(args).items() if k in TrainSettings.model_fields}
    recipe = getattr(args, "recipe", None)
    values = {**(RECIPES[recipe] if recipe else {}), **given}
    if given.get("steps") is not None:
        values.pop("epochs", None)  # --steps wins over a recipe's epochs
    elif "epochs" in given:
        values.pop("steps", None)  # and --epochs over a recipe's steps
    if values.get("out") is None:
        if not recipe:
            raise ValueError("--out is required (or pick a --recipe)")
        from ..models import cache_dir

        values["out"] = str(cache_dir() / "drafters" / recipe)
    if values.get("init_from"):
        values.update(init_from_shape(values["init_from"]))
    s = TrainSettings.of(values)
    s = s.replace(spec_bench=spec_bench_path(s.spec_bench), threads=_threads(s.threads))
    if s.anchors == "tree-miss":
        from ..drafter.suffix_tree import require_suffix_decoding

        require_suffix_decoding("--anchors tree-miss")
    return s


def init_from_shape(path: str) -> dict:
    """--init-from: the run takes the checkpoint's shape, mask token and draft vocabulary; its
    fc already holds its feature scale."""
    from ..drafter.checkpoint import load_drafter_config

    icfg = load_drafter_config(path)
    return dict(layers=icfg.num_hidden_layers, block_size=icfg.block_size,
                target_layers=",".join(map(str, icfg.target_layer_ids)),
                num_target_features=len(icfg.target_layer_ids), mask_token_id=icfg.mask_token_id,
                normalize_features=False, draft_vocab_size=icfg.draft_vocab_size)


def spec_bench_path(spec: str | None) -> str | None:
    """--spec-bench: a path, none, or auto (a recipe's): ${SPEC_BENCH_ENV}."""
    if spec != "auto":
        return spec
    env = os.environ.get(SPEC_BENCH_ENV)
    if not env:
        raise ValueError(f"Spec-Bench: give --spec-bench PATH (its question.jsonl) or set "
                         f"${SPEC_BENCH_ENV}; --spec-bench none trains without it")
    if not Path(env).is_file():
        raise ValueError(f"{SPEC_BENCH_ENV}={env}: no such file")
    return env


def _threads(spec: int | str) -> int:
    """--threads auto: the cores minus the 1-min load average at start, at least 1."""
    if spec != "auto":
        return int(spec)
    ncpu = os.cpu_count() or 1
    return max(1, min(ncpu, ncpu - round(os.getloadavg()[0])))


def pick_mask_token(tokenizer, spec: int | str) -> int:
    """A token whose embedding row exists and that the data never needs as a real token."""
    if spec != "auto":
        return int(spec)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    for name in ("<empty_output>", "<|fim_pad|>", "<mask>"):  # SmolLM2, Qwen, BERT-likes
        if name in vocab:
            return int(vocab[name])
    raise ValueError("no mask token found in the tokenizer; pass --mask-token-id")


def _csv(text: str | None) -> list[str] | None:
    return [c.strip() for c in text.split(",") if c.strip()] if text else None


def load_prompts(s: TrainSettings) -> list:
    from . import data

    prompts = []
    for path in s.prompts:
        prompts += data.load_jsonl(path)
    if s.spec_bench:
        prompts += data.load_spec_bench(s.spec_bench, _csv(s.categories))
    if s.humaneval:
        prompts += data.load_humaneval()
    if s.exclude_categories:
        prompts = data.exclude_categories(prompts, _csv(s.exclude_categories))
    if not prompts:
        raise ValueError("no prompts: give --prompts JSONL, --spec-bench PATH or --humaneval")
    return data.dedupe(prompts)


def _gen_cache(s: TrainSettings) -> Path:
    from ..models import cache_dir

    return Path(s.gen_cache) if s.gen_cache else cache_dir() / "generations"


def self_prompts(target_path: str, tok, s: TrainSettings, public: list) -> list:
    """The target's own user turns (training/self_prompts.py), none equal to a loaded prompt or
    to one the shipped exclusion list names, within --max-prompt-tokens; generated by a plain
    engine that is closed again before the answers' engine starts (one engine at a time)."""
    from .generate import chat_ids, vllm_generate_fn
    from .prompt_sets import load_exclusions
    from .self_prompts import normalise, self_written_prompts

    fn = vllm_generate_fn(target_path, s.gen_dtype)
    try:
        got = self_written_prompts(target_path, tok, s.self_prompts, seed=s.seed,
                                   cache_dir=_gen_cache(s), generate_fn=fn,
                                   exclude={normalise(p.text) for p in public})
    finally:
        fn.close()
    served = load_exclusions()  # a self-written turn equal to a served-as-unseen prompt is dropped
    return [p for p in got if len(chat_ids(tok, p)) <= s.max_prompt_tokens
            and served.hit(p.text) is None]


def split_prompts(target_path: str, tok, s: TrainSettings, prompts: list):
    """(train / held-out PromptSet, prompts skipped as too long): the split by prompt hash,
    the seeded caps, then the self-written prompts (training only)."""
    from . import data
    from .generate import chat_ids

    kept = [p for p in prompts if len(chat_ids(tok, p)) <= s.max_prompt_tokens]
    split = data.PromptSet(*data.split_prompts(kept, s.heldout_fraction, seed=0))
    rng = random.Random(s.seed)
    if s.max_prompts and len(split.train) > s.max_prompts:
        split.train = sorted(rng.sample(split.train, s.max_prompts), key=lambda p: p.id)
    if len(split.heldout) > s.max_heldout:
        split.heldout = sorted(rng.sample(split.heldout, s.max_heldout), key=lambda p: p.id)
    if s.self_prompts:
        split.train += self_prompts(target_path, tok, s, kept)
    if not split.train:
        raise ValueError("no training prompts left after the split and filters")
    print(f"threads: {s.threads} (load average {os.getloadavg()[0]:.1f})")
    print(f"prompts: {len(prompts)} loaded, {len(prompts) - len(kept)} longer than "
          f"{s.max_prompt_tokens} tokens skipped; {split.summary()}")
    return split, len(prompts) - len(kept)


def generate_answers(target_path: str, tok, cfg: TrainSettings, split, data_dir: Path):
    """(train samples, held-out samples, seconds): the target's answers (cached), their
    features logged in the same pass (--features vllm; else the HF target's pass) and written
    into DATA/train and DATA/heldout chunk by chunk (dataset.StreamedFeatures: resumable,
    DATA/progress.jsonl, the DATA/PAUSE file)."""
    from .dataset import GenerationPlan, StreamedFeatures, generate_dataset, response_tokens
    from .generate import vllm_generate_fn
    from .trainer import load_target

    plan = GenerationPlan(max_new_tokens=cfg.max_new_tokens, samples=cfg.sampled_answers,
                          temperature=cfg.temperature or 1.0, top_p=cfg.top_p,
                          followups=cfg.followups, followup_temperature=cfg.temperature,
                          seed=cfg.seed, chunk_prompts=cfg.chunk_prompts)
    log_spec = feature_log_spec(target_path, cfg, data_dir) if cfg.features == "vllm" else None
    fn = vllm_generate_fn(target_path, cfg.gen_dtype, feature_log=log_spec)
    stream = StreamedFeatures(data_dir, shard_header(target_path, cfg),
                              load_target=lambda: load_target(target_path, cfg.target_dtype),
                              feature_log=log_spec.dir if log_spec else None,
                              batch_tokens=cfg.feature_batch_tokens, pause=fn.close)
    t0 = time.perf_counter()
    try:
        train_samples, held_samples = generate_dataset(
            target_path, split.train, split.heldout, plan, tokenizer=tok,
            cache_dir=_gen_cache(cfg), generate_fn=fn, dtype=cfg.gen_dtype,
            token_budget=cfg.token_budget, on_chunk=stream)
    finally:
        fn.close()  # the engine's processes would otherwise compete with training for the CPUs
        stream.close()
    gen_s = time.perf_counter() - t0
    print(f"generation: {len(train_samples)} train answers ({response_tokens(train_samples)} "
          f"tokens), {len(held_samples)} held-out answers ({response_tokens(held_samples)} "
          f"tokens), {gen_s:.0f} s")
    return train_samples, held_samples, gen_s


def run_train(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..models import resolve
    from .trainer import train

    t_start = time.perf_counter()
    s = resolve_settings(args)
    torch.set_num_threads(s.threads)
    prompts = load_prompts(s)  # before the target: bad input should fail in a second
    target_path = resolve(s.target)
    out = Path(s.out)
    tok = AutoTokenizer.from_pretrained(target_path)
    cfg = s.replace(mask_token_id=pick_mask_token(tok, s.mask_token_id))
    split, skipped = split_prompts(target_path, tok, cfg, prompts)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "heldout_prompts.jsonl", "w", encoding="utf-8") as f:
        for p in split.heldout:
            f.write(json.dumps(p.to_json()) + "\n")
    data_dir = Path(s.data) if s.data else out / "data"
    train_samples, held_samples, gen_s = generate_answers(
        target_path, tok, cfg, split, data_dir)
    if cfg.data_only:
        from .dataset import progress_summary

        got = progress_summary(data_dir)
        print(f"data: {got['train_response_tokens']} training response tokens in {data_dir}; "
              f"this run's chunks made {got['generated_tokens']} tokens at {got['tok_s']} "
              f"tokens/s (generation + features); the same command without --data-only trains")
        return 0
    t0 = time.perf_counter()
    examples = build_features(target_path, cfg, train_samples, held_samples, data_dir)
    feat_s = time.perf_counter() - t0
    meta = {"recipe": getattr(args, "recipe", None), "settings": s.model_dump(),
            "target": target_path, "mask_token": tok.convert_ids_to_tokens(cfg.mask_token_id),
            "command": "vllm-onlinespec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "excluded_categories": s.exclude_categories,
            "prompts": {"train": len(split.train), "heldout": len(split.heldout),
                        "skipped_long": skipped, "sources": split.summary()},
            "timings": {"generate_s": round(gen_s, 1), "features_s": round(feat_s, 1)}}
    res = train(target_path, train_samples, held_samples, out, cfg, meta=meta, examples=examples)
    report(out, res, gen_s, feat_s, time.perf_counter() - t_start)
    return 0


def report(out: Path, res, gen_s: float, feat_s: float, total: float) -> None:
    """The CLI's timings into train_meta.json; the held-out acceptance per epoch, the timings
    and how to serve the drafter on stdout."""
    meta_path = out / "train_meta.json"
    full = json.loads(meta_path.read_text())
    full["timings"]["total_s"] = round(total, 1)
    full["timings"]["features_s"] = round(feat_s, 1)
    meta_path.write_text(json.dumps(full, indent=2) + "\n")
    k = res.config.num_draft_tokens
    print("held-out acceptance (tokens per target step, greedy blocks): " + ", ".join(
        f"epoch {e['epoch']}: {e['acceptance']:.3f}" for e in res.evals if e["epoch"] == int(e["epoch"])))
    print(f"timings: generate {gen_s:.0f} s, features {feat_s:.0f} s, " + ", ".join(
        f"{key.removesuffix('_s')} {v:.0f} s" for key, v in res.timings.items()
        if key != "features_s") + f", total {total:.0f} s")
    print(f"drafter: {out}\nserve: --speculative-config "
          + json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": k}))


def target_and_drafter_config(target_path: str, cfg: TrainSettings):
    """(the target's HF config, the DFlashConfig the settings give for it)."""
    from transformers import AutoConfig

    from .trainer import drafter_config

    tcfg = AutoConfig.from_pretrained(target_path)
    return tcfg, drafter_config(tcfg, cfg)


def feature_log_spec(target_path: str, cfg: TrainSettings, data_dir: Path):
    """Where the generation engine logs features (DATA/feature_log) and the drafter it loads
    for the layer ids: an untrained one of the run's shape (it never drafts)."""
    import torch

    from ..drafter import DFlashDrafter
    from ..drafter.checkpoint import save_drafter
    from .generate import FeatureLogSpec

    _, dcfg = target_and_drafter_config(target_path, cfg)
    drafter = save_drafter(data_dir / "feature_log_drafter", dcfg, DFlashDrafter(dcfg),
                           dtype=torch.bfloat16)
    return FeatureLogSpec(dir=str(data_dir / "feature_log"), drafter=str(drafter))


def shard_header(target_path: str, cfg: TrainSettings):
    """What every feature shard of this run must agree on (target, layers, sizes, dtype)."""
    from .generate import model_fingerprint
    from .shards import ShardHeader, target_fingerprint

    tcfg, dcfg = target_and_drafter_config(target_path, cfg)
    return ShardHeader(target=target_fingerprint(model_fingerprint(target_path)),
                       layer_ids=tuple(dcfg.target_layer_ids), hidden_size=int(tcfg.hidden_size),
                       feature_dtype=cfg.feature_dtype)


def build_features(target_path: str, cfg: TrainSettings, train_samples, held_samples,
                   folder: Path):
    """The trainer's Examples for exactly these samples, in their order, from the shards that
    generate_answers streamed into FOLDER/train and FOLDER/heldout (with the CE labels cached
    beside them)."""
    from .shards import load_rows
    from .trainer import Example, load_target

    header = shard_header(target_path, cfg)
    target = None
    out = []
    for name, samples in (("train", train_samples), ("heldout", held_samples)):
        rows = load_rows(folder / name, header, [x.key for x in samples])
        examples = [Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final) for r in rows]
        if cfg.loss_mode == "ce":
            if target is None:
                target = load_target(target_path, cfg.target_dtype)
            cached_labels(folder / name / f"labels-{header.target}.pt", [x.key for x in samples],
                          examples, target.get_output_embeddings().weight.detach().float())
        out.append(examples)
        print(f"features {name}: {len(rows)} sequences from {folder / name}")
    return out[0], out[1]


def cached_labels(path: Path, keys, examples, lm_head_w) -> None:
    """Example.tgt for every example: read from `path` (one file per shard folder and target,
    keyed by sample key) where present, computed with trainer.add_target_labels and saved
    where not. Runs on the same shards (a capacity or seed study) then skip the ~5-minute
    label pass."""
    import torch

    from .trainer import add_target_labels

    saved = torch.load(path, weights_only=True) if path.is_file() else {}
    for key, e in zip(keys, examples):
        t = saved.get(key)
        if t is not None and len(t) == len(e.ids):  # a rewritten sample gets new labels
            e.tgt = t
    missing = [(k, e) for k, e in zip(keys, examples) if e.tgt is None]
    if not missing:
        return
    add_target_labels([e for _, e in missing], lm_head_w)
    saved.update({k: e.tgt for k, e in missing})
    tmp = path.with_suffix(".tmp")
    torch.save(saved, tmp)
    tmp.replace(path)  # a run stopped mid-write keeps the previous file
