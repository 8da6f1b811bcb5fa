"""Online speculation's configuration, declared once: `OnlineSpecConfig.from_any(obj)` validates.

Each range is a Field constraint, repeated in the description docs/configuration.md shows. Bad
input raises `ConfigError`, one line naming the field: `onlinespec.update.lr: must be > 0 (got -1)`.
Frozen: the serving and learner threads share it (derive one with model_copy + from_any)."""

from __future__ import annotations

import json
import os
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_onlinespec.presets import merge, preset

ROOT = "onlinespec"
ORACLE_ENV = "VLLM_ONLINESPEC_BENCHMARK_ORACLE"

Algorithm = Literal["ogd", "optimistic", "optimistic_momentum", "ensemble"]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class ConfigError(ValueError):
    """Invalid online-speculation configuration; str(e) is one line naming the field(s)."""


class _Section(BaseModel):
    # inf/nan are never meaningful here; rejecting them keeps every range check honest.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


class BufferConfig(_Section):
    max_requests: int = Field(64, ge=1, description="requests whose context windows are held at "
                              "once (>= 1); the least recently updated (finished first) is evicted")
    window_tokens: int = Field(512, ge=1, description="per-request sliding context window, in "
                               "tokens (>= 1): the most committed context a training block sees")
    max_tokens: int = Field(32768, ge=1, description="tokens held across all requests (>= "
                            "window_tokens); bounds memory: each keeps its target features")
    max_records: int = Field(16384, ge=1, description="feedback records (one per request per "
                             "engine step) held across all requests (>= 1)")

    @model_validator(mode="after")
    def _window_fits(self) -> "BufferConfig":
        _check(self.window_tokens <= self.max_tokens, f"window_tokens ({self.window_tokens}) "
               f"must be <= max_tokens ({self.max_tokens})")
        return self


class PublishConfig(_Section):
    every_n_updates: int = Field(1, ge=1, description="publish new draft weights (version += 1) "
                                 "after this many successful learner updates (>= 1)")
    kv_policy: Literal["tolerate"] = Field(
        "tolerate", description="draft K/V of requests in flight when weights change: "
        "'tolerate' (the only policy) keeps it; output stays lossless (docs/results/stale_kv.md)")
    repack: bool = Field(
        True, description="CPU only: pack the drafter's weights for vLLM's CPU GEMM kernels at "
        "start and after each publish (false = a learning drafter runs plain torch linear): "
        "faster steps despite repacking (docs/results/drafter_packing.md, step_cost.md)")


class CheckpointConfig(_Section):
    dir: str | None = Field(
        None, description="directory for atomic learner checkpoints (None = no checkpoints)")
    every_n_versions: int = Field(
        100, ge=1, description="write a checkpoint every this many published versions (>= 1)")
    keep_last: int = Field(
        3, ge=1, description="complete checkpoints kept; older ones are deleted (>= 1)")


class LossConfig(_Section):
    alpha: float = Field(0.8, ge=0.0, le=1.0, description="weight of the cross-entropy to the "
                         "target's argmax; 1 - alpha weights the divergence term (in [0, 1])")
    temperature: float = Field(
        1.0, gt=0.0, description="softmax temperature applied to target and draft logits (> 0)")
    gamma: float = Field(7.0, gt=0.0, description="decay of the per-position weight in a block, "
                         "w_k = exp(-(k-1)/gamma), in block positions (> 0)")
    clip: float | None = Field(None, gt=0.0, description="clip each token's divergence term "
                               "(T^2 * KL) at this value, in nats (> 0; None = no clip)")
    mode: Literal["reverse_kl", "forward_kl", "ce"] = Field(
        "reverse_kl", description="divergence: 'reverse_kl' KL(draft||target), 'forward_kl' "
        "KL(target||draft), 'ce' cross-entropy to the target's argmax only")
    vocab: Literal["seen", "full"] = Field(
        "seen", description="LM-head rows the loss projects onto: 'seen' = the tokens trained on "
        "so far, cheaper (docs/results/learner_throughput.md); 'full' = the whole vocabulary")
    miss_weight: float = Field(0.0, ge=0.0, description="rows where the drafter's argmax misses "
                               "the target's count 1 + miss_weight times (>= 0; 0 = all alike)")


class LengthHeadConfig(_Section):
    policy: Literal["fixed", "adaflash", "budget"] = Field(
        "fixed", description="verify length: 'fixed' all K tokens, 'adaflash' each draft cut by "
        "the length head, 'budget' a per-step verify-token budget shared across requests")
    rho: float = Field(1.0, gt=0.0, description="verify-length scale (> 0; > 1 verifies more): "
                       "'adaflash' scales its cut, 'budget' divides a token's cost by rho")
    k_min: int = Field(1, ge=0, description="never cut a draft below this many tokens (>= 0; 0 "
                       "lets 'budget' verify nothing where a draft does not pay)")
    gate: bool = Field(True, description="'budget' only: a step that would not pay drafts and "
                       "verifies nothing (policy/step_gate.py)")
    estimator: Literal["head", "confidence"] = Field(
        "head", description="'budget' only: 'head' = the length head where it beats the "
        "population estimate; 'confidence' = a logistic model on the drafter's top-1 probability")
    price_lookup: bool = Field(True, description="'budget' only: verify only the paying prefix "
                               "of suffix-tree drafts (docs/results/priced_lookup.md)")
    k0_step: Literal["deferred", "context_only", "forward"] = Field(
        "deferred", description="a step that drafts nothing runs 'deferred' (nothing: its "
        "accepted tokens' context K/V are written in one pass when the drafter next drafts), "
        "'context_only' (those K/V now) or 'forward' (vLLM's K = 0 path); output is the same "
        "under each. Deferred rows are written with the weights in force when the drafter next "
        "drafts, and rows of a request that finished before then are dropped")
    options: list[Literal["plain", "tree", "drafter"]] | None = Field(
        None, min_length=1, description="'budget' gate: what a step may verify, chosen per step "
        "by each option's measured engine cycles (policy/option_choice.py): 'plain' nothing, "
        "'tree' the lookup's drafts alone, 'drafter' the drafter's blocks beside them; None = "
        "every option the config holds ('tree' needs prompt_lookup); ['drafter'] leaves the "
        "step to the gate's cost model alone")
    option_explore_every: int = Field(16, ge=2, description="'budget' gate's options: the "
                                      "options that are not the best run together at most one "
                                      "step in this many of a batch bucket, each at least once "
                                      "in 16 times as many, so each price stays current (>= 2)")
    option_regret: float = Field(0.01, gt=0.0, le=1.0, description="'budget' gate's options: "
                                 "what exploring one option may cost, as a share of serving "
                                 "time: an option x more per token than the best runs once in "
                                 "x / option_regret steps when that is rarer (0 < r <= 1)")
    option_objective: Literal["tokens", "slowest", "auto"] = Field(
        "tokens", description="'budget' gate's options: what a cycle's price counts: 'tokens' "
        "every token it produced (throughput: a server with requests coming and going); "
        "'slowest' the batch size times the tokens of the request furthest from its end (a "
        "closed batch's wall time, e.g. RL rollouts: the round ends with its last sequence); "
        "'auto' 'slowest' once no new request was scheduled for option_closed_after steps, "
        "'tokens' otherwise")
    option_closed_after: int = Field(8, ge=1, description="'budget' gate's options, objective "
                                     "'auto': steps without a newly scheduled request after "
                                     "which the batch counts as closed (>= 1)")
    option_cold_pick: Literal["neighbour", "gate"] = Field(
        "neighbour", description="'budget' gate's options: what a step runs in a batch bucket "
        "whose options are not all measured yet: 'neighbour' what won in the nearest measured "
        "bucket (the gate's pick where none is), 'gate' the gate's cost model's pick")
    option_margin: float = Field(0.05, ge=0.0, lt=1.0, description="'budget' gate's options: "
                                 "the tree or the drafter is chosen over plain only where its "
                                 "measured tokens per second beat plain's by this share: what "
                                 "drafting costs outside the priced decode cycles (a batch's "
                                 "tail, prefill steps) shows where the prices are close")
    explore_every: int = Field(32, ge=2, description="'budget' gate: while shut, every this-many"
                               "-th step drafts anyway to keep the estimate current (>= 2)")
    explore_requests: int = Field(2, ge=1, description="'budget' gate: requests whose full draft "
                                  "an exploring step verifies (>= 1)")
    head_gate_labels: int = Field(64, ge=0, description="consult the length head once it beat "
                                  "the population estimate on this many fresh labels (>= 0)")
    head_lr: float = Field(1e-3, ge=0.0, description="the length head's Adam step size on verify "
                           "labels, per engine step (>= 0; 0 = it follows the publishes)")
    train: bool = Field(True, description="train the length head online (learning on, policy not "
                        "'fixed'); false keeps a shipped head frozen. A fresh head is consulted "
                        "after 50 published versions")


class FeatureLogConfig(_Section):
    """Log the target features vLLM computes while serving, for offline drafter training."""

    dir: str | None = Field(None, description="write committed tokens' target features as "
                            "safetensors here (None = off); prefix-cache hits cannot be logged")
    plain: bool = Field(False, description="never speculate: decode as plain vLLM while logging")
    flush_tokens: int = Field(16384, ge=1, description="write a file once this many token rows "
                              "are pending (>= 1); shutdown and the flush RPC write the rest")


class OracleConfig(_Section):
    """Benchmark only, output NOT the target's: a perfect drafter's ceiling at real step cost."""

    accept_len: float | None = Field(
        None, ge=1.0, description="force this mean acceptance length, in tokens per verify step "
        f"(>= 1, <= K + 1; None = off); needs {ORACLE_ENV}=1 and enabled = false")
    seed: int = Field(0, ge=0, description="seed of the oracle's acceptance draws (>= 0)")


class UpdateConfig(_Section):
    """The online update rule."""

    algorithm: Algorithm = Field(
        "ogd", description="'ogd' (AdamW, persistent state), 'optimistic' (optimistic OGD), "
        "'optimistic_momentum' (optimistic Adam), 'ensemble' (Hedge over ensemble_lrs)")
    lr: float = Field(1e-4, gt=0.0, description="learning rate, per update (> 0)")
    weight_decay: float = Field(
        0.0, ge=0.0, description="decoupled weight decay per update, relative to lr (>= 0)")
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999), description="Adam moment decays (beta1, beta2), each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0.0, description="Adam denominator epsilon (> 0)")
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="clip the global gradient L2 norm to this (> 0; None = no clip)")
    ensemble_lrs: list[Annotated[float, Field(gt=0.0)]] = Field(
        [3e-5, 1e-4, 3e-4], min_length=1, description="learning rates of the Hedge ensemble's "
        "members (each > 0; 'ensemble' needs >= 2)")
    hedge_lr: float = Field(0.1, gt=0.0, description="Hedge learning rate eta (> 0, per unit of "
                            "loss): each update multiplies member i's weight by exp(-eta loss_i)")
    hedge_share: float = Field(0.01, ge=0.0, lt=1.0, description="Hedge fixed share, in [0, 1): "
                               "lets the ensemble move to a new best member after drift")

    @model_validator(mode="after")
    def _ensemble_needs_members(self) -> "UpdateConfig":
        _check(self.algorithm != "ensemble" or len(self.ensemble_lrs) >= 2,
               f"algorithm 'ensemble' needs >= 2 ensemble_lrs (got {len(self.ensemble_lrs)})")
        return self


class PacingConfig(_Section):
    """How hard the learner thread may run beside serving."""

    update_interval_s: float = Field(
        0.0, ge=0.0, description="minimum seconds between the starts of two updates (>= 0)")
    max_updates_per_s: float | None = Field(
        None, gt=0.0, description="cap on updates per second (> 0; None = no cap)")
    learner_threads: int = Field(1, ge=1, description="torch threads of the learner (>= 1); no "
                                 "effect under vLLM's CPU worker")
    learner_cores: Literal["auto", "inherit"] | list[Annotated[int, Field(ge=0)]] = Field(
        "auto", description="the learner thread's CPU cores: 'auto' = online cores outside the "
        "serving worker's, 'inherit' = the worker's, or a list of core ids (learner/cores.py)")
    learner_cpu_share: float = Field(0.5, gt=0.0, le=1.0, description="fraction of wall time the "
                                     "learner may be busy, in (0, 1] "
                                     "(docs/results/learner_share.md)")
    share_control: Literal["gain", "fixed"] = Field(
        "gain", description="'gain': learner_cpu_share while learning pays, else min_cpu_share "
        "(learner/duty_cycle.py); 'fixed': always learner_cpu_share")
    min_cpu_share: float = Field(0.05, gt=0.0, le=1.0, description="the learner's share while "
                                 "learning buys nothing (in (0, 1], <= learner_cpu_share)")
    score_every: int = Field(1, ge=1, description="updates between two gain scores (>= 1), each "
                             "two no-gradient forwards")
    learner_priority: Literal["idle", "low", "normal"] = Field(
        "normal", description="the learner thread's scheduling priority: 'idle' (SCHED_IDLE: "
        "CPU time serving leaves), 'low' (nice 19), 'normal' (docs/results/learner_priority.md)")
    idle_after_s: float | None = Field(
        0.5, gt=0.0, description="no engine step for this many seconds (a server between "
        "requests) and the learner trains at full share until the next step (> 0; None = "
        "never); an engine step at batch 1 takes ~0.05-0.1 s on a CPU")

    idle_only: bool = Field(
        False, description="train only while serving idles (an RL trainer's gap through the "
        "worker's `onlinespec_idle`, or no engine step for idle_after_s): an update never shares "
        "the cores with a serving step, except one already running when a step arrives")

    @model_validator(mode="after")
    def _min_below_max(self) -> "PacingConfig":
        _check(self.min_cpu_share <= self.learner_cpu_share, f"min_cpu_share "
               f"{self.min_cpu_share} exceeds learner_cpu_share {self.learner_cpu_share}")
        return self


class PromptLookupConfig(_Section):
    """Prompt lookup beside the drafter (drafter/prompt_lookup.py): where the text predicts what
    follows, verify that instead of the drafter's block; the drafter still runs and learns, and
    output stays lossless (docs/results/hybrid_ceiling.md)."""

    enabled: bool = Field(False, description="verify a request's lookup proposal instead of "
                          "the drafter's block where the rule takes it")
    min_n: int = Field(2, ge=1, description="shortest suffix n-gram matched, in tokens (>= 1)")
    max_n: int = Field(4, ge=1, description="longest suffix n-gram, tried first (>= min_n)")
    min_tokens: int | None = Field(None, ge=1, description="ngram: take a proposal of at least "
                                   "this many tokens (>= 1; None = drafter_tokens)")
    skip_drafter: bool = Field(True, description="a step where every request takes a lookup "
                               "draft runs the drafter's context K/V only")
    recent_tokens: int = Field(
        4096, ge=0, description="where the request's own text has no match, search this many "
        "tokens of recently finished requests' text (>= 0; 0 = off): only speed depends on it, "
        "a timing side channel between tenants (docs/results/online_replay.md)")
    recent_min_n: int = Field(3, ge=1, description="shortest n-gram matched in other requests' "
                              "text, in tokens (>= 1)")
    recent_max_n: int = Field(8, ge=1, description="longest match scored in other requests' "
                              "text, in tokens (>= recent_min_n)")
    source: Literal["ngram", "suffix_tree"] = Field(
        "ngram", description="'ngram' = vLLM's ngram rule, 'suffix_tree' = SuffixDecoding's trees "
        "(`python -m vllm_onlinespec.suffix_install`); seeded requests use ngram on own text")
    suffix_min_score: float = Field(1.0, ge=0.0, description="suffix_tree: least score (expected "
                                    "accepted tokens) of a draft taken (>= 0)")
    suffix_max_depth: int = Field(24, ge=1, description="suffix_tree: longest suffix matched and "
                                  "path stored, in tokens (>= 1)")
    suffix_max_cached_requests: int = Field(
        10000, ge=0, description="suffix_tree: finished requests kept in the global tree (>= 0)")
    suffix_max_spec_factor: float = Field(1.0, gt=0.0, description="suffix_tree: draft tokens per "
                                          "matched token (> 0), at most K")
    suffix_min_token_prob: float = Field(0.1, ge=0.0, le=1.0, description="suffix_tree: end a "
                                         "draft below this token probability (in [0, 1])")

    @model_validator(mode="after")
    def _n_range(self) -> "PromptLookupConfig":
        _check(self.max_n >= self.min_n, f"max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        _check(self.recent_max_n >= self.recent_min_n, f"recent_max_n ({self.recent_max_n}) "
               f"must be >= recent_min_n ({self.recent_min_n})")
        return self


class SamplingConfig(_Section):
    """How sampled requests are verified (sampling/invariant.py)."""

    invariant: Literal["auto", "seeded", "all", "off"] = Field(
        "auto", description="drafter-invariant verification of sampled requests: a draft is "
        "accepted iff it equals the Gumbel-max sample fixed by (seed, position), so a seeded "
        "request's output does not depend on the drafter. 'seeded'; 'all' (unseeded too); 'off' "
        "(vLLM's rejection sampling); 'auto' = when drafts change while serving, 'all' on one "
        "rank, 'seeded' under tensor parallelism. Greedy requests are never touched. Where "
        "every request of a step is covered it replaces vLLM's sampler: cheaper on a CPU "
        "(docs/results/unseeded_sampling.md)")
    coupled_drafts: bool = Field(
        False, description="with invariant verification, draft argmax(log q + G) with the "
        "verifier's noise G: more drafts accepted, fewer tok/s (docs/results/seeded_sampling.md)")


class OnlineSpecConfig(_Section):
    """The `onlinespec` object of vLLM's `--additional-config` JSON."""

    preset: str | None = Field(
        None, description="the starting point: named settings filling every key not given (a "
        "given key wins; presets.py). 'cpu' = the CPU recipe the demo and benchmarks measured, "
        "with num_speculative_tokens 16; None = the defaults")
    enabled: bool = Field(True, description="learn online while serving (False = frozen drafter)")
    drafter: str | None = Field(
        None, description="path of the DFlash drafter checkpoint to start from (HF folder)")
    drafter_tokens: int | None = Field(
        None, ge=1, description="tokens the drafter drafts per request and step (>= 1; None = "
        "its trained block, at most K); a larger K is room for lookup drafts only")
    batch_blocks: int = Field(16, ge=1, description="training blocks (anchor + K predicted "
                              "tokens) per update (>= 1)")
    anchors_per_request: int = Field(4, ge=1, description="at most this many block anchors from "
                                     "one request's fresh tokens per update (>= 1)")
    anchor_stride: int | None = Field(
        None, ge=1, description="tokens between block anchors, in [1, K] (None = K: the blocks "
        "tile the fresh tokens; 1 = every fresh token anchors a block)")
    replay: bool = Field(False, description="fill updates up to batch_blocks with blocks on "
                         "tokens already trained on (docs/results/online_replay.md)")
    min_new_tokens_per_update: int = Field(16, ge=1, description="fresh (untrained) tokens the "
                                           "buffer must hold before an update (>= 1)")
    learner_device: str = Field("auto", description="torch device of the learner: 'auto' = "
                                "vLLM's drafter's, or 'cpu', 'cuda', 'cuda:1', ...")
    learner_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the learner's parameters and update-rule state "
        "('bfloat16': CUDA only, half the memory)")
    learner_compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the learner's matmuls: 'auto' = bfloat16 where the device "
        "has it in hardware, else float32 (docs/results/learner_throughput.md)")
    trace_dir: str | None = Field(None, description="write what vLLM's drafter computed each "
                                  "step to this directory, for parity checks (None = off)")

    update: UpdateConfig = Field(UpdateConfig(), description="online update rule")
    pacing: PacingConfig = Field(PacingConfig(), description="learner thread pacing")
    buffer: BufferConfig = Field(BufferConfig(), description="feedback buffer")
    publish: PublishConfig = Field(PublishConfig(), description="weight publishing")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="learner checkpoints")
    loss: LossConfig = Field(LossConfig(), description="online training loss")
    length_head: LengthHeadConfig = Field(LengthHeadConfig(), description="verify-length policy")
    oracle: OracleConfig = Field(OracleConfig(), description="forced acceptance")
    features: FeatureLogConfig = Field(FeatureLogConfig(), description="feature log")
    prompt_lookup: PromptLookupConfig = Field(PromptLookupConfig(), description="prompt lookup")
    sampling: SamplingConfig = Field(SamplingConfig(), description="sampled requests")

    @property
    def invariant_sampling(self) -> str:
        """The resolved sampling.invariant on one rank: 'seeded', 'all' or 'off'."""
        return self.invariant_mode(tensor_parallel_size=1)

    def invariant_mode(self, tensor_parallel_size: int) -> str:
        """The resolved sampling.invariant: 'seeded', 'all' or 'off'. 'auto', where something
        changes the drafts while serving: 'all' on one rank (unseeded sampled requests too: the
        invariant sampler replaces vLLM's, 3.5 against 16.9 ms a step at 8 unseeded requests on
        a 2-vCPU CPU, docs/results/unseeded_sampling.md), 'seeded' under tensor parallelism (an
        unseeded request's seed is salted per process: the ranks would disagree)."""
        if self.sampling.invariant != "auto":
            return self.sampling.invariant
        changes = self.enabled or self.length_head.policy != "fixed" or self.prompt_lookup.enabled
        if not changes or self.oracle.accept_len is not None:
            return "off"
        return "all" if tensor_parallel_size <= 1 else "seeded"

    @field_validator("learner_device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        _check(re.fullmatch(r"auto|(cpu|cuda|meta)(:\d+)?", v) is not None,  # meta: for tests
               f"must be 'auto', 'cpu', 'cuda' or 'cuda:N' (got {v!r})")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "OnlineSpecConfig":
        _check(self.learner_dtype != "bfloat16" or self.learner_device != "cpu",
               "learner_dtype 'bfloat16' needs a CUDA learner_device (CPU keeps float32)")
        lh = self.length_head
        _check(lh.estimator != "confidence" or lh.policy == "budget", f"length_head.estimator "
               f"'confidence' needs length_head.policy 'budget' (got {lh.policy!r})")
        _check(lh.options is None or len(set(lh.options)) == len(lh.options),
               f"length_head.options lists an option twice ({lh.options})")
        _check(lh.options is None or lh.options == ["drafter"] or lh.policy == "budget",
               f"length_head.options needs length_head.policy 'budget' (got {lh.policy!r})")
        _check(lh.options is None or "tree" not in lh.options or self.prompt_lookup.enabled,
               "length_head.options 'tree' needs prompt_lookup.enabled (the lookup drafts it)")
        if self.oracle.accept_len is not None:
            _check(os.environ.get(ORACLE_ENV) == "1", f"oracle.accept_len is benchmark-only "
                   f"(output is not the target's); set {ORACLE_ENV}=1 to allow it")
            _check(not self.enabled, "oracle.accept_len needs enabled = false (no learning)")
            _check(self.sampling.invariant not in ("seeded", "all"), "sampling.invariant needs "
                   "oracle.accept_len unset (forced acceptance replaces verification)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        return _with_preset(data)

    @classmethod
    def from_any(cls, obj: Any = None) -> "OnlineSpecConfig":
        """Build a validated config from None (defaults), a dict, JSON text, a .json path, or an
        instance (re-validated, so a `model_copy(update=...)` cannot smuggle in bad values)."""
        data = _parse_text(obj) if isinstance(obj, (str, bytes, os.PathLike)) else obj
        data = {} if data is None else data.model_dump() if isinstance(data, cls) else data
        if not isinstance(data, dict):
            raise ConfigError(f"{ROOT}: expected a JSON object, JSON text, a .json path or an "
                              f"OnlineSpecConfig (got {type(data).__name__})")
        try:
            return cls.model_validate(_with_preset(data))
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, cls)) from None


def _with_preset(data: Any) -> Any:
    """The named preset's settings under the ones `data` gives (sections merged key by key)."""
    if not isinstance(data, dict) or data.get("preset") is None:
        return data
    try:
        return merge(preset(data["preset"]), data)
    except ValueError as e:
        raise ConfigError(f"{ROOT}.preset: {e}") from None


def _parse_text(obj: str | bytes | os.PathLike) -> Any:
    text = obj.decode() if isinstance(obj, bytes) else obj
    if isinstance(obj, os.PathLike) or (isinstance(obj, str) and text.strip().endswith(".json")
                                        and not text.lstrip().startswith("{")):
        try:
            text = Path(obj).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{ROOT}: cannot read {os.fspath(obj)!r}: {e.strerror}") from None
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{ROOT}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


# -- one-line error messages ----------------------------------------------------------------------

# Flat root keys of older versions -> where they live now, for the one line refusing them.
MOVED_TO = {"eps": "update.adam_eps", "hedge_eps": "update.hedge_lr",
            **{k: f"{s}.{k}" for s, sec in (("update", UpdateConfig), ("pacing", PacingConfig))
               for k in sec.model_fields}}
_OPS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _walk(model: type[BaseModel], loc: tuple) -> tuple[tuple, Any, list]:
    """(loc without pydantic's union-member tags, the type at loc, its bounds metadata)."""
    shown, tp, meta = [], model, []
    for part in loc:
        if isinstance(part, int):  # a list/tuple item: its Annotated[...] carries its bounds
            args = get_args(next((a for a in (tp, *get_args(tp))
                                  if get_origin(a) in (list, tuple)), None))
            tp = args[min(part, len(args) - 1)] if args else None
            meta = list(getattr(tp, "__metadata__", ()))
        elif isinstance(tp, type) and issubclass(tp, BaseModel):
            info = tp.model_fields.get(part)
            tp, meta = (info.annotation, list(info.metadata)) if info else (None, [])
        else:  # 'float', 'none', "literal['auto','inherit']": the union member that failed
            continue
        shown.append(part)
    return tuple(shown), tp, [c for m in meta for c in (getattr(m, "metadata", None) or [m])]


def _range(bounds: list) -> str | None:
    """'must be > 0', 'must be in [0, 1)', ... from annotated_types bounds."""
    b = {op: f"{getattr(c, op):g}" for c in bounds for op in _OPS if hasattr(c, op)}
    lo, hi = (next((op for op in ops if op in b), None) for ops in (("gt", "ge"), ("lt", "le")))
    if lo and hi:
        return f"must be in {'(['[lo == 'ge']}{b[lo]}, {b[hi]}{')]'[hi == 'le']}"
    return f"must be {_OPS[lo or hi]} {b[lo or hi]}" if lo or hi else None


def _one(err: dict, model: type[BaseModel]) -> str:
    loc, _, bounds = _walk(model, tuple(err["loc"]))
    path = ROOT + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    kind, ctx, rng = err["type"], err.get("ctx") or {}, _range(bounds)
    if kind == "extra_forbidden":
        if len(loc) == 1 and loc[0] in MOVED_TO:
            return f"{path}: moved to {ROOT}.{MOVED_TO[loc[0]]}"
        allowed = ", ".join(_walk(model, loc[:-1])[1].model_fields)
        return f"{path}: unknown field (allowed: {allowed})"
    if kind == "value_error":
        return f"{path}: {ctx['error']}"
    if kind == "literal_error":
        rule = f"must be one of {ctx['expected']}"
    elif kind.startswith(("greater_than", "less_than")) and rng:
        rule = rng
    else:
        rule = err["msg"][:1].lower() + err["msg"][1:] + (f"; {rng}" if rng else "")
    return f"{path}: {rule} (got {reprlib.repr(err.get('input'))})"


def format_validation_error(e: ValidationError, model: type[BaseModel] = OnlineSpecConfig) -> str:
    """All errors of `e` on one line, '; '-separated, each 'onlinespec.<path>: <rule> (got x)'."""
    return "; ".join(_one(err, model) for err in e.errors(include_url=False)).replace("\n", " ")
