"""A changed target: the base model fine-tuned (LoRA) to answer in a terse, numbered-step style.

Why it exists: online drafter learning pays where the served target differs from the one the
drafter was trained on (a fine-tuned or RL-updated model). This recipe makes such a target from
data the project generates itself, reproducibly and small enough to ship:

  1. prompts the base model writes itself (training/self_prompts.py, cached), answered greedily
     by the base model (training/generate.py, cached);
  2. each prose answer restyled deterministically (`terse_steps`): split into sentences, each
     a numbered line, articles and filler words dropped. The style is pervasive (it changes
     which token follows which almost everywhere) and learnable;
  3. a rank-r LoRA on every attention and MLP projection trained on (prompt, restyled answer),
     loss on the answer tokens only; saved in PEFT's format (training/lora.py).

`answers="reference"` replaces steps 1-2 with a data file's own answers (`reference_answer`,
e.g. GSM8K's worked solutions): an SFT toward a dataset's format, nothing generated.

The same training loop (`train_adapter`) also runs as a trajectory that saves the adapter at
evenly spaced steps (training/drift.py): a policy that drifts, one version per checkpoint.
Prompts in the shipped drafter's held-out list are never trained on (`heldout_texts`), so the
drafter's held-out acceptance on any version measures prompts neither model saw.

`vllm-onlinespec model pull smollm2-135m-terse` merges the shipped adapter into the base
weights (models.py): an ordinary HF folder vLLM serves like any other model.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from vllm_onlinespec.training import lora

STYLE = "terse-steps/1"  # bump when `terse_steps` changes: adapters record what they learned
REFERENCE_STYLE = "reference-answers/1"  # a data file's own answers, unchanged
ANSWERS = ("terse", "reference")
DROP_WORDS = frozenset({"a", "an", "the", "very", "really", "just", "actually", "basically",
                        "simply", "quite"})
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_WORD = re.compile(r"\b([A-Za-z]+)\b(\s*)")


def _drop_words(sentence: str) -> str:
    out = _WORD.sub(lambda m: "" if m.group(1).lower() in DROP_WORDS else m.group(0), sentence)
    out = re.sub(r"\s{2,}", " ", out).strip()
    return out[:1].upper() + out[1:]


def terse_steps(answer: str, max_steps: int = 8) -> str | None:
    """The answer as numbered terse steps, or None where the style does not apply (code, too
    few sentences): one sentence per line, list markers and articles/fillers dropped."""
    if "```" in answer or "def " in answer or "    " in answer:
        return None
    text = re.sub(r"^\s*(?:\d+[.)]|[-*\u2022])\s+", "", answer.strip(), flags=re.M)
    text = re.sub(r"[#*]+", "", text)
    sentences = [s.strip() for part in text.split("\n") for s in _SENTENCE.split(part) if s.strip()]
    sentences = [_drop_words(s) for s in sentences]
    sentences = [s for s in sentences if len(s.split()) >= 3][:max_steps]
    if len(sentences) < 2:
        return None
    return "\n".join(f"{n}. {s.rstrip('.')}" for n, s in enumerate(sentences, 1))


@dataclass(frozen=True)
class VariantRecipe:
    """Settings of the fine-tune (recorded in the adapter's config)."""
    prompts: int = 2400  # self-written prompts asked for (fewer survive filtering); the
    # drafter recipe asks for the same 2400 (seed 0), so on one machine both share one cache
    seed: int = 0
    max_answer_tokens: int = 256  # the base model's greedy answers
    r: int = 8
    alpha: float = 16.0
    # Adapt the upper half of the layers only: the style is a surface change, and the backward
    # pass stops at the first adapted layer (about half the cost of adapting all of them).
    layers_from: float = 0.5
    steps: int = 160
    batch_size: int = 8
    lr: float = 1e-3  # AdamW, cosine to 10 % after 20 warm-up steps
    max_seq: int = 384  # tokens per training sequence (prompt + answer), longer ones truncated
    heldout: int = 48  # restyled answers kept out of training, for the loss reported at the end
    # CPU autocast dtype of the training forward ("float32": none). bfloat16 is fast only where
    # the CPU computes it natively (AVX512-BF16, AMX); elsewhere float32 is ~3x faster.
    compute_dtype: str = "bfloat16"
    # What the adapter learns: "terse" = the base's own answers restyled (`terse_steps`);
    # "reference" = the answers a data file ships (`reference_answer`), e.g. GSM8K's worked
    # solutions with their <<a*b=c>> calculator notes: an SFT toward a dataset's format.
    answers: str = "terse"
    data: str = ""  # "reference": the file's name (recorded; the path is given at run time)
    # "reference": rows kept out at the end of the file (GSM8K train's last 1000 are served only)
    hold_tail: int = 0

    def __post_init__(self) -> None:
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"compute_dtype must be bfloat16 or float32, not {self.compute_dtype!r}")
        if self.answers not in ANSWERS:
            raise ValueError(f"answers must be one of {', '.join(ANSWERS)}, not {self.answers!r}")

    @property
    def style(self) -> str:
        return STYLE if self.answers == "terse" else REFERENCE_STYLE


@dataclass
class Example:
    ids: list[int]
    start: int  # first answer token


def build_examples(tokenizer, prompts: Sequence, answers: Sequence[str], max_seq: int,
                   restyle: Callable[[str], str | None] | None = terse_steps,
                   kept: list | None = None) -> list[Example]:
    """(prompt, answer) pairs as chat-formatted token ids, each answer through `restyle` first
    (the terse style by default; None keeps it as it is); answers the style does not apply to,
    or with fewer than 8 tokens left under max_seq, are skipped. `kept`, when given, receives
    the prompts of the examples made."""
    from vllm_onlinespec.training.generate import chat_ids

    out = []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for p, a in zip(prompts, answers):
        styled = restyle(a) if restyle is not None else a
        if styled is None:
            continue
        head = chat_ids(tokenizer, p)
        body = list(tokenizer(styled, add_special_tokens=False)["input_ids"]) + [eos]
        ids = (head + body)[:max_seq]
        if len(ids) - len(head) >= 8:
            out.append(Example(ids, len(head)))
            if kept is not None:
                kept.append(p)
    return out


def answer_loss(model: torch.nn.Module, batch: Sequence[Example], pad_id: int) -> torch.Tensor:
    """Mean next-token cross entropy over the answer tokens of a right-padded batch. The LM
    head (a third of a small model's weights) runs on the answer positions only."""
    L = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    pick = torch.zeros((len(batch), L), dtype=torch.bool)  # positions that predict an answer token
    for i, e in enumerate(batch):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.ids)] = 1
        pick[i, e.start - 1: len(e.ids) - 1] = True
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    labels = ids[:, 1:][pick[:, :-1]]
    logits = model.get_output_embeddings()(hidden[pick]).float()
    return torch.nn.functional.cross_entropy(logits, labels)


# Called at each checkpoint step (1-based, after that step's update) with the model's wrappers
# and its held-out loss; the model is in eval mode meanwhile.
OnCheckpoint = Callable[[int, dict[str, lora.LoRALinear], float], None]


def train_adapter(model: torch.nn.Module, examples: list[Example], recipe: VariantRecipe, *,
                  pad_id: int, log: Callable[[str], None] = print,
                  checkpoints: Sequence[int] = (), on_checkpoint: OnCheckpoint | None = None,
                  state_path: Path | None = None) -> tuple[dict[str, lora.LoRALinear], dict]:
    """Attach a LoRA to `model` and train it on the examples; returns (wrappers, report).
    After each step in `checkpoints` (1-based), the held-out loss is measured and passed with
    the wrappers to `on_checkpoint` (training/drift.py saves a version there). With
    `state_path`, the training state (factors, optimizer, batch order) is saved there at each
    checkpoint, and a run that finds one for the same recipe and examples resumes from it:
    the same result as an uninterrupted run, on the same machine."""
    bad = [c for c in checkpoints if not 1 <= c <= recipe.steps]
    if bad:
        raise ValueError(f"checkpoint steps {bad} outside 1..{recipe.steps}")
    cfg = lora.LoRAConfig(r=recipe.r, alpha=recipe.alpha)
    layers = model.base_model.layers
    first = int(len(layers) * recipe.layers_from)
    wrappers = lora.attach(model, cfg, under=[f"model.layers.{i}" for i in range(first, len(layers))])
    params = [p for w in wrappers.values() for p in (w.lora_A.weight, w.lora_B.weight)]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    rng = random.Random(recipe.seed)
    held, train = examples[: recipe.heldout], examples[recipe.heldout:]
    if not train:
        raise ValueError(f"no training examples left after holding out {recipe.heldout}")
    autocast = recipe.compute_dtype == "bfloat16" and not torch.cuda.is_available()

    def lr_at(step: int) -> float:
        if step < 20:
            return recipe.lr * (step + 1) / 20
        t = (step - 20) / max(1, recipe.steps - 20)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def held_loss() -> float:
        if not held:
            return float("nan")
        mode = model.training
        model.eval()
        with torch.no_grad():
            losses = [answer_loss(model, held[i:i + recipe.batch_size], pad_id).item()
                      for i in range(0, len(held), recipe.batch_size)]
        model.train(mode)
        return sum(losses) / len(losses)

    before = held_loss()
    log(f"variant: {len(train)} training / {len(held)} held-out examples, "
        f"{sum(p.numel() for p in params) / 1e6:.2f} M adapter parameters; held-out loss "
        f"before {before:.3f}")
    t0, order, last = time.time(), [], None
    key = {"recipe": asdict(recipe), "examples": _examples_key(examples)}
    first_step = _resume(state_path, key, wrappers, opt, rng, order, log)
    model.train()
    for step in range(first_step, recipe.steps):
        if len(order) < recipe.batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch = [train[i] for i in order[: recipe.batch_size]]
        del order[: recipe.batch_size]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = answer_loss(model, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == recipe.steps - 1:
            log(f"variant: step {step + 1}/{recipe.steps} loss {loss.item():.3f} "
                f"({time.time() - t0:.0f} s)")
        if step + 1 in checkpoints:
            last = (step + 1, held_loss())
            log(f"variant: checkpoint at step {step + 1}: held-out loss {last[1]:.3f}")
            if on_checkpoint is not None:
                model.eval()
                on_checkpoint(step + 1, wrappers, last[1])
                model.train()
            if state_path is not None:
                _save_state(state_path, key, step + 1, wrappers, opt, rng, order)
    model.eval()
    after = last[1] if last is not None and last[0] == recipe.steps else held_loss()
    log(f"variant: held-out loss {before:.3f} -> {after:.3f} in {time.time() - t0:.0f} s")
    return wrappers, {"heldout_loss_before": before, "heldout_loss_after": after,
                      "train_examples": len(train), "heldout_examples": len(held),
                      "train_s": round(time.time() - t0, 1), "resumed_at_step": first_step}


def _examples_key(examples: Sequence[Example]) -> str:
    import hashlib

    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.ids, e.start]).encode())
    return h.hexdigest()[:16]


def _save_state(path: Path, key: dict, step: int, wrappers: dict[str, lora.LoRALinear],
                opt: torch.optim.Optimizer, rng: random.Random, order: list[int]) -> None:
    """Written beside and moved in place: a crash leaves the previous state or this one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"key": key, "step": step, "factors": lora.state_dict(wrappers),
                "opt": opt.state_dict(), "rng": rng.getstate(), "order": list(order)}, tmp)
    tmp.replace(path)


def _resume(path: Path | None, key: dict, wrappers: dict[str, lora.LoRALinear],
            opt: torch.optim.Optimizer, rng: random.Random, order: list[int],
            log: Callable[[str], None]) -> int:
    """The step to start from: 0, or the saved state's step once it is loaded in place."""
    if path is None or not Path(path).is_file():
        return 0
    state = torch.load(path, weights_only=False)
    if state.get("key") != key:
        log(f"variant: {path} is another recipe's or data's training state; starting over")
        return 0
    factors = state["factors"]
    with torch.no_grad():
        for name, w in wrappers.items():
            w.lora_A.weight.copy_(factors[f"{lora.PEFT_PREFIX}{name}.lora_A.weight"])
            w.lora_B.weight.copy_(factors[f"{lora.PEFT_PREFIX}{name}.lora_B.weight"])
    opt.load_state_dict(state["opt"])
    rng.setstate(state["rng"])
    order[:] = state["order"]
    log(f"variant: resumed at step {state['step']} from {path}")
    return int(state["step"])


def heldout_texts(base_name: str) -> set[str]:
    """Normalised texts of the prompts the shipped drafter for `base_name` holds out (its
    heldout_prompts.jsonl; empty when none ships): no variant trains on them."""
    from vllm_onlinespec import models
    from vllm_onlinespec.training.self_prompts import normalise

    try:
        path = models.shipped_drafter(base_name) / "heldout_prompts.jsonl"
    except models.ModelError:
        return set()
    if not path.is_file():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {normalise(m["content"]) for r in rows for m in r["messages"] if m["role"] == "user"}


GENERATORS = ("vllm", "hf")


def variant_examples(base_path: str, recipe: VariantRecipe, *, cache_dir: str | Path,
                     generate_fn=None, generator: str = "vllm", exclude: set[str] = frozenset(),
                     log: Callable[[str], None] = print) -> tuple[object, list[Example], list]:
    """The recipe's data step: self-written prompts -> the base's greedy answers -> restyled
    examples, as (tokenizer, examples, the prompts answered). Prompts whose normalised text is in `exclude` are
    dropped. `generator` picks the GenerateFn when none is given: "vllm" (an engine, cached in
    cache_dir) or "hf" (transformers on CPU, cached in cache_dir/hf: its answers are not vLLM's)."""
    from transformers import AutoTokenizer

    from vllm_onlinespec.training.generate import SamplingSpec, generate, vllm_generate_fn
    from vllm_onlinespec.training.self_prompts import normalise, self_written_prompts

    if generator not in GENERATORS:
        raise ValueError(f"generator must be one of {', '.join(GENERATORS)}, not {generator!r}")
    base_path = str(base_path)
    tok = AutoTokenizer.from_pretrained(base_path)
    fn, close = generate_fn, None
    if generator == "hf":
        from vllm_onlinespec.training.hf_generate import hf_generate_fn

        cache_dir = Path(cache_dir) / "hf"
        fn = fn or hf_generate_fn(base_path, log=log)
    elif fn is None:
        fn = vllm_generate_fn(base_path, "bfloat16")
        close = getattr(fn, "close", None)
    try:
        prompts = self_written_prompts(base_path, tok, recipe.prompts, cache_dir=cache_dir,
                                       generate_fn=fn, seed=recipe.seed, log=log)
        kept = [p for p in prompts if normalise(p.text) not in exclude]
        if len(kept) < len(prompts):
            log(f"variant: {len(prompts) - len(kept)} self-written prompts dropped "
                f"(held out by the shipped drafter)")
        samples = generate(base_path, kept, SamplingSpec(max_tokens=recipe.max_answer_tokens),
                           tokenizer=tok, cache_dir=cache_dir, generate_fn=fn, log=log)
    finally:
        if close is not None:
            close()
    by_id = {p.id: p for p in kept}
    answers = [tok.decode(s.ids[s.start:], skip_special_tokens=True) for s in samples]
    examples = build_examples(tok, [by_id[s.prompt_id] for s in samples], answers, recipe.max_seq)
    log(f"variant: {len(examples)} of {len(samples)} base answers restyled ({STYLE})")
    return tok, examples, kept


def reference_examples(base_path: str, recipe: VariantRecipe, data: str | Path, *,
                       exclude: set[str] = frozenset(), log: Callable[[str], None] = print
                       ) -> tuple[object, list[Example], list]:
    """The "reference" recipe's data step: rows of a JSONL file with a user turn and a
    `reference_answer` -> (tokenizer, examples, the prompts trained on), in a shuffled order
    fixed by the seed (the held-out examples are its first `heldout`). The file's last
    `hold_tail` rows and prompts in `exclude` are never used; a row without a usable user turn
    or answer is skipped and counted."""
    from transformers import AutoTokenizer

    from vllm_onlinespec.jsonl import iter_jsonl
    from vllm_onlinespec.training.data import load_jsonl, row_key
    from vllm_onlinespec.training.self_prompts import normalise

    tok = AutoTokenizer.from_pretrained(str(base_path))
    prompts = load_jsonl(data, log=log)
    lines = list(iter_jsonl(data, bad_json=False))  # a line that is not JSON: False, skipped
    tail = {n for n, _ in lines[len(lines) - recipe.hold_tail:]} if recipe.hold_tail else set()
    answers = {}  # keyed as load_jsonl keys its prompts
    for n, r in lines:
        if (n not in tail and isinstance(r, dict) and isinstance(r.get("reference_answer"), str)
                and r["reference_answer"].strip()):
            answers[f"jsonl:{row_key(r, n)}"] = r["reference_answer"].strip()
    kept = [p for p in prompts if p.id in answers and normalise(p.text) not in exclude]
    if not kept:
        raise ValueError(f"{data}: no row with a user turn and a reference_answer outside the "
                         f"last {recipe.hold_tail} rows")
    random.Random(recipe.seed).shuffle(kept)
    used: list = []
    examples = build_examples(tok, kept, [answers[p.id] for p in kept], recipe.max_seq,
                              restyle=None, kept=used)
    log(f"variant: {len(examples)} reference answers from {Path(data).name} "
        f"({len(prompts) - len(kept)} rows without one, excluded or held out at the tail)")
    return tok, examples, used


def recipe_examples(base_path: str, recipe: VariantRecipe, *, cache_dir: str | Path,
                    data: str | Path | None = None, generate_fn=None, generator: str = "vllm",
                    exclude: set[str] = frozenset(), log: Callable[[str], None] = print
                    ) -> tuple[object, list[Example], list]:
    """The recipe's examples, by `recipe.answers`: the base's restyled answers or a file's."""
    if recipe.answers == "reference":
        if data is None:
            raise ValueError("the reference recipe needs a data file (--data FILE)")
        return reference_examples(base_path, recipe, data, exclude=exclude, log=log)
    return variant_examples(base_path, recipe, cache_dir=cache_dir, generate_fn=generate_fn,
                            generator=generator, exclude=exclude, log=log)


def fresh_model(base_path: str, recipe: VariantRecipe) -> torch.nn.Module:
    """The base model in float32 with torch seeded from the recipe: what training starts from
    (the seed fixes the LoRA factors' initialisation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    torch.manual_seed(recipe.seed)
    return model


def adapter_meta(recipe: VariantRecipe, report: dict, **more) -> dict:
    """What an adapter's config records beside PEFT's fields."""
    return {"vllm_onlinespec": {"style": recipe.style, "recipe": asdict(recipe), "report": report,
                                **more}}


def make_variant(base_path: str, out: str | Path, recipe: VariantRecipe, *, cache_dir: str | Path,
                 base_name: str, data: str | Path | None = None, generate_fn=None,
                 generator: str = "vllm", log: Callable[[str], None] = print) -> Path:
    """The whole recipe: its examples (`recipe_examples`) -> LoRA -> adapter folder at `out`
    (PEFT format, with the recipe and its report in adapter_config.json)."""
    tok, examples, _ = recipe_examples(base_path, recipe, cache_dir=cache_dir, data=data,
                                       generate_fn=generate_fn, generator=generator,
                                       exclude=heldout_texts(base_name), log=log)
    model = fresh_model(base_path, recipe)
    wrappers, report = train_adapter(model, examples, recipe, pad_id=tok.pad_token_id or 0,
                                     log=log)
    cfg = lora.LoRAConfig(r=recipe.r, alpha=recipe.alpha)
    return lora.save(wrappers, cfg, out, base=base_name, extra=adapter_meta(recipe, report))


def describe(adapter: str | Path) -> str:
    d = json.loads((Path(adapter) / lora.ADAPTER_CONFIG).read_text())
    meta = d.get("vllm_onlinespec", {})
    return (f"LoRA r={d.get('r')} on {', '.join(d.get('target_modules', []))}; style "
            f"{meta.get('style', '?')}; {meta.get('report', {})}")
