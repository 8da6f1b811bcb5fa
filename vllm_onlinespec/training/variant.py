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


@dataclass
class Example:
    ids: list[int]
    start: int  # first answer token


def build_examples(tokenizer, prompts: Sequence, answers: Sequence[str], max_seq: int
                   ) -> list[Example]:
    """(prompt, restyled answer) pairs as chat-formatted token ids; answers the style does not
    apply to are skipped."""
    from vllm_onlinespec.training.generate import chat_ids

    out = []
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for p, a in zip(prompts, answers):
        styled = terse_steps(a)
        if styled is None:
            continue
        head = chat_ids(tokenizer, p)
        body = list(tokenizer(styled, add_special_tokens=False)["input_ids"]) + [eos]
        ids = (head + body)[:max_seq]
        if len(ids) - len(head) >= 8:
            out.append(Example(ids, len(head)))
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


def train_adapter(model: torch.nn.Module, examples: list[Example], recipe: VariantRecipe, *,
                  pad_id: int, log: Callable[[str], None] = print
                  ) -> tuple[dict[str, lora.LoRALinear], dict]:
    """Attach a LoRA to `model` and train it on the examples; returns (wrappers, report)."""
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

    def lr_at(step: int) -> float:
        if step < 20:
            return recipe.lr * (step + 1) / 20
        t = (step - 20) / max(1, recipe.steps - 20)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def held_loss() -> float:
        with torch.no_grad():
            losses = [answer_loss(model, held[i:i + recipe.batch_size], pad_id).item()
                      for i in range(0, len(held), recipe.batch_size)]
        return sum(losses) / max(1, len(losses))

    before = held_loss() if held else float("nan")
    log(f"variant: {len(train)} training / {len(held)} held-out examples, "
        f"{sum(p.numel() for p in params) / 1e6:.2f} M adapter parameters; held-out loss "
        f"before {before:.3f}")
    t0, order = time.time(), []
    model.train()
    for step in range(recipe.steps):
        if len(order) < recipe.batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch = [train[i] for i in order[: recipe.batch_size]]
        del order[: recipe.batch_size]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not torch.cuda.is_available()):
            loss = answer_loss(model, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == recipe.steps - 1:
            log(f"variant: step {step + 1}/{recipe.steps} loss {loss.item():.3f} "
                f"({time.time() - t0:.0f} s)")
    model.eval()
    after = held_loss() if held else float("nan")
    log(f"variant: held-out loss {before:.3f} -> {after:.3f} in {time.time() - t0:.0f} s")
    return wrappers, {"heldout_loss_before": before, "heldout_loss_after": after,
                      "train_examples": len(train), "heldout_examples": len(held),
                      "train_s": round(time.time() - t0, 1)}


def make_variant(base_path: str, out: str | Path, recipe: VariantRecipe, *, cache_dir: str | Path,
                 base_name: str, generate_fn=None, log: Callable[[str], None] = print) -> Path:
    """The whole recipe: self-written prompts -> base answers -> restyle -> LoRA -> adapter
    folder at `out` (PEFT format, with the recipe and its report in adapter_config.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_onlinespec.training.generate import SamplingSpec, generate, vllm_generate_fn
    from vllm_onlinespec.training.self_prompts import self_written_prompts

    base_path = str(base_path)
    tok = AutoTokenizer.from_pretrained(base_path)
    fn = generate_fn
    close = None
    if fn is None:
        fn = vllm_generate_fn(base_path, "bfloat16")
        close = getattr(fn, "close", None)
    try:
        prompts = self_written_prompts(base_path, tok, recipe.prompts, cache_dir=cache_dir,
                                       generate_fn=fn, seed=recipe.seed, log=log)
        samples = generate(base_path, prompts, SamplingSpec(max_tokens=recipe.max_answer_tokens),
                           tokenizer=tok, cache_dir=cache_dir, generate_fn=fn, log=log)
    finally:
        if close is not None:
            close()
    by_id = {p.id: p for p in prompts}
    answers = [tok.decode(s.ids[s.start:], skip_special_tokens=True) for s in samples]
    examples = build_examples(tok, [by_id[s.prompt_id] for s in samples], answers, recipe.max_seq)
    log(f"variant: {len(examples)} of {len(samples)} base answers restyled ({STYLE})")
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(recipe.seed)
    wrappers, report = train_adapter(model, examples, recipe, pad_id=tok.pad_token_id or 0,
                                     log=log)
    cfg = lora.LoRAConfig(r=recipe.r, alpha=recipe.alpha)
    return lora.save(wrappers, cfg, out, base=base_name,
                     extra={"vllm_onlinespec": {"style": STYLE, "recipe": asdict(recipe),
                                                "report": report}})


def describe(adapter: str | Path) -> str:
    d = json.loads((Path(adapter) / lora.ADAPTER_CONFIG).read_text())
    meta = d.get("vllm_onlinespec", {})
    return (f"LoRA r={d.get('r')} on {', '.join(d.get('target_modules', []))}; style "
            f"{meta.get('style', '?')}; {meta.get('report', {})}")
