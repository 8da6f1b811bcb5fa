"""Configuration of the online drafter learner: one validated pydantic model.

`OnlineSpecConfig.from_any(obj)` is the single entry point (None, dict, JSON text, a path to a
.json file, or an instance). Every range lives in the Field constraints and is repeated in the
description, so `--help` style listings and error messages agree. Invalid input raises
`ConfigError` with one line per call, naming each bad field by its dotted path, e.g.

    onlinespec.lr: must be > 0 (got -1)

The model is frozen: it is shared by the serving thread and the learner thread, so nobody may
mutate it under the other's feet. Use `cfg.model_copy(update=...)` + `from_any` to derive one.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal, get_args

try:
    import annotated_types as at
    from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                          model_validator)

    PYDANTIC = True
except ImportError:  # the GPU device image has no pydantic (lab/gpu_check.sh)
    from ._pydantic_lite import (BaseModel, ConfigDict, Field, ValidationError, at,  # type: ignore
                                 field_validator, model_validator)

    PYDANTIC = False

ROOT = "onlinespec"

Algorithm = Literal["ogd", "optimistic", "optimistic_momentum", "ensemble"]
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class ConfigError(ValueError):
    """Invalid online-speculation configuration; str(e) is one line naming the field(s)."""


class _Section(BaseModel):
    # inf/nan are never meaningful here; rejecting them keeps every range check honest.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False)


class BufferConfig(_Section):
    max_requests: int = Field(
        64, ge=1, description="requests whose context windows are held at once (>= 1); the least "
        "recently updated one is evicted first (finished requests before running ones)")
    window_tokens: int = Field(
        512, ge=1, description="per-request sliding context window, in tokens (>= 1): training "
        "blocks see at most this much committed context")
    max_tokens: int = Field(
        32768, ge=1, description="total tokens held across all requests (>= window_tokens); "
        "bounds memory: each token carries its aux features and target hidden state")
    max_records: int = Field(
        16384, ge=1, description="total feedback records (one per request per engine step) held "
        "across all requests (>= 1)")

    @model_validator(mode="after")
    def _window_fits(self) -> "BufferConfig":
        if self.window_tokens > self.max_tokens:
            raise ValueError(
                f"window_tokens ({self.window_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self


class PublishConfig(_Section):
    every_n_updates: int = Field(
        1, ge=1, description="publish new draft weights (version += 1) after this many "
        "successful learner updates (>= 1)")
    kv_policy: Literal["tolerate"] = Field(
        "tolerate", description="draft KV already cached for requests in flight when weights "
        "change. Only 'tolerate' exists, so nothing reads this field yet (it names the "
        "behaviour and reserves the key): 'tolerate' keeps it (output stays lossless; those requests draft against "
        "context K/V of older weights until they finish). The only policy so far: re-projecting "
        "a running request's cache needs every past position's target features, which vLLM does "
        "not keep; what tolerating costs is measured by lab/stale_kv.py")


    repack: bool = Field(
        True, description="CPU only: the drafter loads with plain Linear weights and they are "
        "packed for vLLM's CPU GEMM kernels (oneDNN / SGL) by this project, once at start and "
        "after each publish, keeping plain copies for the next publish; a frozen drafter "
        "(enabled false) loads the same way, so frozen and learning engines differ only in "
        "learning (docs/results/drafter_packing.md). A learning drafter was measured faster "
        "this way than with plain weights although every publish pays for it "
        "(docs/results/step_cost.md: 12 / 5 / 1 % less per step at batch 1 / 8 / 32). False = "
        "a learning drafter runs torch's plain linear; a frozen one keeps vLLM's packing at "
        "load")


class CheckpointConfig(_Section):
    dir: str | None = Field(
        None, description="directory for atomic learner checkpoints (None = no checkpoints)")
    every_n_versions: int = Field(
        100, ge=1, description="write a checkpoint every this many published versions (>= 1)")
    keep_last: int = Field(
        3, ge=1, description="complete checkpoints kept; older ones are deleted (>= 1)")


class LossConfig(_Section):
    alpha: float = Field(
        0.8, ge=0.0, le=1.0, description="weight of the cross-entropy term towards the target's "
        "argmax; 1 - alpha weights the clipped divergence from the target's distribution "
        "(in [0, 1])")
    temperature: float = Field(
        1.0, gt=0.0, description="softmax temperature applied to target and draft logits (> 0)")
    gamma: float = Field(
        7.0, gt=0.0, description="decay of the per-position weight inside a block, "
        "w_k = exp(-(k-1)/gamma), in block positions (> 0)")
    clip: float | None = Field(
        None, gt=0.0, description="clip each token's divergence term (T^2 * KL, the 1 - alpha "
        "part) at this value, in nats (> 0; None = no clip); the cross-entropy term is never "
        "clipped. Bounds the pull of a single surprising token's distribution")
    mode: Literal["reverse_kl", "forward_kl", "ce"] = Field(
        "reverse_kl", description="distillation divergence: 'reverse_kl' KL(draft||target), "
        "'forward_kl' KL(target||draft), 'ce' cross-entropy to the target's argmax only")
    vocab: Literal["seen", "full"] = Field(
        "seen", description="LM-head rows the loss projects onto: 'seen' = the tokens of the "
        "sequences trained on (offline: the whole training set; online: every feedback batch so "
        "far, growing), ~3x faster steps on a CPU; 'full' = the whole vocabulary. Serving always "
        "uses the whole LM head, and offline held-out evaluation does too")
    miss_weight: float = Field(
        0.0, ge=0.0, description="emphasis on the positions the drafter gets wrong (as OSD "
        "trains on rejected tokens): a row where the drafter's argmax differs from the "
        "target's counts 1 + miss_weight times (>= 0, dimensionless; 0 = every row alike). "
        "Measured on the tuning stream by the replay (docs/results/online_replay.md)")


class LengthHeadConfig(_Section):
    policy: Literal["fixed", "adaflash", "budget"] = Field(
        "fixed", description="verify-length policy: 'fixed' verifies all K drafted tokens, "
        "'adaflash' cuts each request's draft where the length head's predicted acceptance "
        "stops paying, 'budget' shares a per-step verify-token budget across requests")
    rho: float = Field(
        1.0, gt=0.0, description="verify-length scale (> 0, dimensionless): 'adaflash' verifies "
        "clamp(round(r * K * rho), k_min, K) tokens where r is the head's predicted tokens per "
        "verify step as a fraction of the block, (accepted + 1) / (K + 1); 'budget' divides the measured cost of a verified token by rho. > 1 verifies "
        "more, < 1 less")
    k_min: int = Field(
        1, ge=0, description="never cut a draft below this many tokens (>= 0; 0 lets 'budget' "
        "verify nothing for a request whose draft does not pay)")
    gate: bool = Field(
        True, description="'budget' only: before drafting, decide whether the next step "
        "speculates at all (policy/step_gate.py); a step that would not pay drafts "
        "nothing (the drafter's context K/V only, `k0_step`) and verifies nothing")
    estimator: Literal["head", "confidence"] = Field(
        "head", description="'budget' only: what predicts each draft token's acceptance. "
        "'head' = the length head where it beats the population estimate on fresh labels, "
        "else the population estimate; 'confidence' = an online logistic model on the "
        "drafter's top-1 probability per position, fitted from verification (vLLM's adaptive "
        "verification feature, policy/acceptance_estimator.py); no length head needed")
    price_lookup: bool = Field(
        True, description="'budget' only: verify only the prefix of each suffix-tree draft "
        "(prompt_lookup source 'suffix_tree') that pays in the next step, each token priced by "
        "the tree's own estimate calibrated from verification and the target's measured cost "
        "per token (policy/lookup_price.py); false verifies tree drafts whole, as vLLM's "
        "suffix decoding does")
    k0_step: Literal["context_only", "forward"] = Field(
        "context_only", description="what the DFlash drafter runs on a step that drafts "
        "nothing (the gate shut, or a plain feature-logging engine): 'context_only' writes only "
        "the new tokens' context K/V (fc and the k/v projections; no drafter layers, no LM "
        "head), 'forward' runs vLLM's own K = 0 path (also the drafter's layers over the "
        "bonus-token queries, output discarded). Both keep later drafts identical")
    explore_every: int = Field(
        32, ge=2, description="'budget' gate: while shut, every this-many-th step drafts anyway "
        "so the acceptance estimate stays current (>= 2, steps)")
    explore_requests: int = Field(
        2, ge=1, description="'budget' gate: requests whose full draft an exploring step "
        "verifies (>= 1)")
    head_gate_labels: int = Field(
        64, ge=0, description="consult the length head only after it has predicted this many "
        "fresh verification labels (accepted counts of verified drafts) better than the "
        "population estimate (>= 0 labels; 0 = no gate)")
    head_lr: float = Field(
        1e-3, ge=0.0, description="learning rate of the length head on real verification "
        "labels, one Adam step per engine step on the serving thread (>= 0; 0 = off, the head "
        "then follows the learner's publishes)")
    train: bool = Field(
        True, description="train the length head online from accept/reject feedback (only "
        "when learning is on and the policy consults a head, i.e. not 'fixed'); false keeps a "
        "head shipped with the drafter frozen. A head created fresh for training is consulted "
        "only after the learner has published 50 versions (policy/cutter.py)")


ORACLE_ENV = "VLLM_ONLINESPEC_BENCHMARK_ORACLE"


class FeatureLogConfig(_Section):
    """Keep the target features vLLM computes while it serves, for offline drafter training:
    a data-generation engine then needs no second pass of the target (written by
    training/feature_log.FeatureLogWriter from serving/session.py, read back by
    training/feature_log.read_feature_log)."""

    dir: str | None = Field(
        None, description="write every committed token's target features (the drafter's aux "
        "layers and the final hidden state, in the serving dtype) to safetensors files in this "
        "folder (None = off). Tokens served from the prefix cache are never computed, so a "
        "request with a cache hit cannot be assembled: turn prefix caching off where every "
        "request should count")
    plain: bool = Field(
        False, description="never speculate: every step drafts nothing (the drafter's "
        "context K/V only, `length_head.k0_step`) and verifies nothing, so the engine decodes as plain vLLM "
        "does while it logs features (data generation)")
    flush_tokens: int = Field(
        16384, ge=1, description="write a file once this many token rows are pending (>= 1); "
        "the worker's `onlinespec_flush_features` RPC and shutdown write the rest")


class OracleConfig(_Section):
    """Benchmark-only: output is NOT the target's. Measures the ceiling a perfect drafter would
    reach at the real cost of drafting and verifying (vLLM's synthetic rejection mode, which
    vLLM refuses on CPU)."""

    accept_len: float | None = Field(
        None, ge=1.0, description="force this mean acceptance length per verify step, in tokens "
        "(>= 1, at most K + 1; None = off): each request's drafts are accepted up to a sampled "
        "length whatever the target says, so the OUTPUT IS NOT THE TARGET'S. Refused unless "
        f"the environment has {ORACLE_ENV}=1 and learning is off (enabled = false)")
    seed: int = Field(0, ge=0, description="seed of the oracle's acceptance draws (>= 0)")


class UpdateConfig(_Section):
    """The online update rule (old flat keys at the root are still accepted)."""

    algorithm: Algorithm = Field(
        "ogd", description="online update rule: 'ogd' (AdamW with persistent state), "
        "'optimistic' (optimistic OGD, hint 2g_t - g_{t-1}, RMS-preconditioned), "
        "'optimistic_momentum' (optimistic Adam: correction on the persistent momentum), "
        "'ensemble' (Hedge over learners with ensemble_lrs)")
    lr: float = Field(1e-4, gt=0.0, description="learning rate, per update (> 0)")
    weight_decay: float = Field(
        0.0, ge=0.0, description="decoupled weight decay per update, relative to lr (>= 0)")
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999), description="Adam moment decays (beta1, beta2), each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0.0, description="Adam denominator epsilon (> 0; old key: eps)")
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="clip the global gradient L2 norm to this value (> 0; None = "
        "no clip)")
    ensemble_lrs: list[Annotated[float, Field(gt=0.0)]] = Field(
        [3e-5, 1e-4, 3e-4], min_length=1, description="learning rates of the Hedge ensemble "
        "members, one learner each (each > 0; algorithm 'ensemble' needs >= 2)")
    hedge_lr: float = Field(
        0.1, gt=0.0, description="Hedge learning rate eta, per unit of loss (> 0; old key: "
        "hedge_eps): each update multiplies member i's weight by exp(-hedge_lr * loss_i) "
        "(without share: p_i ~ exp(-hedge_lr * L_i), L_i the cumulative loss)")
    hedge_share: float = Field(
        0.01, ge=0.0, lt=1.0, description="Hedge fixed share (Herbster & Warmuth), in [0, 1): "
        "after each update this fraction of the total weight is spread evenly over the members, "
        "so no weight falls below hedge_share / N and the ensemble can move to a member that "
        "becomes the best after the traffic drifts (0 = plain Hedge, whose weights cannot "
        "recover once collapsed)")

    @model_validator(mode="after")
    def _ensemble_needs_members(self) -> "UpdateConfig":
        if self.algorithm == "ensemble" and len(self.ensemble_lrs) < 2:
            raise ValueError(
                f"algorithm 'ensemble' needs >= 2 ensemble_lrs (got {len(self.ensemble_lrs)})")
        return self


class PacingConfig(_Section):
    """How hard the learner thread may run beside serving (old flat keys still accepted)."""

    update_interval_s: float = Field(
        0.0, ge=0.0, description="minimum seconds between the starts of two updates (>= 0)")
    max_updates_per_s: float | None = Field(
        None, gt=0.0, description="cap on updates per second (> 0; None = no cap)")
    learner_threads: int = Field(
        1, ge=1, description="torch intra-op threads of the learner thread (>= 1). No effect "
        "under vLLM's CPU worker, which replaces torch.set_num_threads with a no-op and sets "
        "OMP_NUM_THREADS itself; there the learner is bounded by learner_cores and "
        "learner_cpu_share. On other workers: on a 2-core box keep it at 1")
    learner_cores: Literal["auto", "inherit"] | list[Annotated[int, Field(ge=0)]] = Field(
        "auto", description="CPU cores of the learner thread: 'auto' = the online cores outside "
        "the serving worker's affinity (vLLM's CPU worker leaves VLLM_CPU_NUM_OF_RESERVED_CPU "
        "cores, default 1, to its front end), else unchanged; 'inherit' = share the worker's "
        "cores; or a list of core ids")
    learner_cpu_share: float = Field(
        0.5, gt=0.0, le=1.0, description="fraction of wall time the learner may be busy, in "
        "(0, 1]; enforced by sleeping after each update in proportion to its duration")
    share_control: Literal["gain", "fixed"] = Field(
        "gain", description="'gain': the learner's share of wall time follows what learning "
        "buys (learner/duty_cycle.py): learner_cpu_share while the drafter's gain over its "
        "frozen start weights is above zero or rising, or its acceptance drops (a changed "
        "target), min_cpu_share otherwise; 'fixed': always learner_cpu_share")
    min_cpu_share: float = Field(
        0.05, gt=0.0, le=1.0, description="fraction of wall time the learner keeps when "
        "learning buys nothing (share_control 'gain'; <= learner_cpu_share)")
    score_every: int = Field(
        1, ge=1, description="updates between two gain scores (share_control 'gain'): each "
        "score is two no-gradient forwards (current and frozen start weights) over the batch's "
        "fresh blocks")
    learner_priority: Literal["idle", "low", "normal"] = Field(
        "normal", description="scheduling priority of the learner thread: 'idle' (SCHED_IDLE: "
        "it runs only on CPU time serving leaves, a waking engine thread preempts it at once), "
        "'low' (nice 19) or 'normal'. On a CPU box the learner shares its cores with vLLM's "
        "engine core and front end, which every step waits on (learner/cores.py)")

    @model_validator(mode="after")
    def _min_below_max(self) -> "PacingConfig":
        if self.min_cpu_share > self.learner_cpu_share:
            raise ValueError(f"min_cpu_share {self.min_cpu_share} exceeds learner_cpu_share "
                             f"{self.learner_cpu_share}")
        return self


# Old flat keys of the root -> (section, key) they moved to. Still accepted; error messages
# name the key as the user wrote it.
MOVED = {**{k: ("update", k) for k in ("algorithm", "lr", "weight_decay", "betas", "grad_clip",
                                        "ensemble_lrs", "hedge_share")},
         "eps": ("update", "adam_eps"), "hedge_eps": ("update", "hedge_lr"),
         **{k: ("pacing", k) for k in ("update_interval_s", "max_updates_per_s", "learner_threads",
                                        "learner_cores", "learner_cpu_share",
                                        "learner_priority")}}


def _move_old_keys(data: Any) -> tuple[Any, dict[tuple, tuple]]:
    """(data with old flat keys moved into their sections, {new loc: old loc})."""
    if not isinstance(data, dict) or not any(k in data for k in MOVED):
        return data, {}
    data, renames = dict(data), {}
    for old, (section, new) in MOVED.items():
        if old not in data:
            continue
        sec = data.get(section, {})
        sec = dict(sec) if isinstance(sec, dict) else sec
        if isinstance(sec, dict):
            if new in sec:
                raise ConfigError(f"{ROOT}.{old}: also given as {ROOT}.{section}.{new}; use one")
            sec[new] = data.pop(old)
            data[section] = sec
            renames[(section, new)] = (old,)
    return data, renames


def move_old_keys(data: dict) -> dict:
    """`data` with old flat keys (`lr`, `algorithm`, `learner_cpu_share`, ...) moved into their
    sections; ConfigError when a key is given both ways."""
    return _move_old_keys(data)[0]


def _with_preset(data: Any) -> Any:
    """The named preset's settings under the ones `data` gives (its sections merged key by key);
    data unchanged without a preset."""
    if not isinstance(data, dict) or data.get("preset") is None:
        return data
    from vllm_onlinespec.presets import merge, preset

    try:
        return merge(preset(data["preset"]), data)
    except ValueError as e:
        raise ConfigError(f"{ROOT}.preset: {e}") from None


class PromptLookupConfig(_Section):
    """Prompt lookup beside the drafter (drafter/prompt_lookup.py, applied in
    serving/session.py): where the request's own text predicts what follows (the longest suffix
    n-gram recurs earlier in prompt + output), verify the tokens that followed it instead of the
    DFlash drafter's block. The drafter still runs every step (its context K/V needs each
    step's target features) and keeps learning from every verified token; only which tokens the
    target verifies changes, so output stays lossless. Measured offline on held-out answers:
    2.29 tokens per verify step against 1.44 (drafter alone) and 1.84 (lookup alone)
    (docs/results/hybrid_ceiling.md)."""

    enabled: bool = Field(
        False, description="replace a request's drafter block by its prompt-lookup proposal "
        "where that proposal is at least min_tokens long")
    min_n: int = Field(
        2, ge=1, description="shortest suffix n-gram that counts as a match, in tokens (>= 1)")
    max_n: int = Field(
        4, ge=1, description="longest suffix n-gram tried first, in tokens (>= min_n)")
    min_tokens: int | None = Field(
        None, ge=1, description="ngram source: use a lookup proposal only if it has at least "
        "this many tokens (>= 1; None = the drafter's draft length, `drafter_tokens`: the rule "
        "measured offline, a short proposal means the match ran into the end of the text, "
        "where the drafter does better)")
    skip_drafter: bool = Field(
        True, description="when every request of a step has a lookup draft the rule takes, "
        "the DFlash drafter drafts nothing that step (its context K/V only, "
        "`length_head.k0_step`): its block would be replaced everywhere")
    recent_tokens: int = Field(
        4096, ge=0, description="where the request's own text has no match, search the text "
        "(prompt + output) of recently finished requests, this many tokens of it, oldest "
        "dropped (>= 0; 0 = the request's own text only). Answers of one domain share their "
        "scaffolding: on 40 math word problems, 1.93 tokens per verify step against 1.85 "
        "(own text only) and 1.42 (drafter alone), offline (docs/results/online_replay.md). "
        "Output never depends on it; only speed can depend on other requests' text (set 0 "
        "where that timing side channel between tenants matters). Seeded requests search "
        "their own text only, so they reproduce while the drafter is frozen")
    recent_min_n: int = Field(
        3, ge=1, description="shortest suffix n-gram matched in other requests' text, in "
        "tokens (>= 1; 2 matches more often and is accepted less: 1.0 vs 1.3 tokens a match)")
    recent_max_n: int = Field(
        8, ge=1, description="longest suffix match scored in other requests' text, in tokens "
        "(>= recent_min_n; the longest match wins, the latest on a tie)")
    source: Literal["ngram", "suffix_tree"] = Field(
        "ngram", description="where proposals come from: 'ngram' = vLLM's ngram rule on the "
        "request's own text, then recently finished requests' text (recent_*); 'suffix_tree' = "
        "SuffixDecoding's suffix trees over the request's text and finished outputs (vLLM's "
        "`method: suffix` cache, arctic-inference; `python -m vllm_onlinespec.suffix_install`), "
        "taken where its score reaches suffix_min_score. Seeded requests use their own text "
        "only, with the ngram rule")
    suffix_min_score: float = Field(
        1.0, ge=0.0, description="suffix_tree: take the tree's draft when its score (the sum of "
        "its tokens' estimated probabilities, about the tokens it expects accepted) is at least "
        "this, in tokens (>= 0); else the drafter's block")
    suffix_max_depth: int = Field(
        24, ge=1, description="suffix_tree: longest context suffix matched and longest "
        "sequence stored per tree node path, in tokens (vLLM's suffix_decoding_max_tree_depth)")
    suffix_max_cached_requests: int = Field(
        10000, ge=0, description="suffix_tree: finished requests' outputs kept in the global "
        "tree, oldest evicted first (0 = none: each request's own text only)")
    suffix_max_spec_factor: float = Field(
        1.0, gt=0.0, description="suffix_tree: a draft is at most this many tokens per matched "
        "context token (dimensionless, > 0), and at most K")
    suffix_min_token_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="suffix_tree: stop a draft at the first token whose "
        "estimated probability (its continuation's share of the match's occurrences) is below "
        "this (in [0, 1])")

    @model_validator(mode="after")
    def _n_range(self) -> "PromptLookupConfig":
        if self.max_n < self.min_n:
            raise ValueError(f"max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        if self.recent_max_n < self.recent_min_n:
            raise ValueError(f"recent_max_n ({self.recent_max_n}) must be >= recent_min_n "
                             f"({self.recent_min_n})")
        return self


class SamplingConfig(_Section):
    """How sampled requests are verified (sampling/invariant.py, wired in
    serving/compat/invariant_sampling.py)."""

    invariant: Literal["auto", "seeded", "all", "off"] = Field(
        "auto", description="drafter-invariant verification of sampled (temperature > 0) "
        "requests: each position's token is the Gumbel-max sample fixed by (request seed, "
        "position) after every logits processor, and a draft is accepted iff it equals it, so a "
        "seeded request gives the same tokens whatever the drafter version, K, cut or lookup "
        "draft. 'seeded': requests with a seed; 'all': also unseeded ones (a seed drawn per "
        "request); 'off': vLLM's rejection sampling; 'auto' = 'seeded' when anything changes "
        "the drafts while serving (learning, a verify-length policy other than fixed, prompt "
        "lookup), else 'off'. Greedy requests are never touched. Cost: per sampled request and "
        "step, K + 1 rows of vocabulary-wide processing and noise on the sampler's device, and "
        "a match rate of (1 - TV) / (1 + TV) per draft against rejection sampling's 1 - TV")
    coupled_drafts: bool = Field(
        False, description="with invariant verification on, draw a covered request's DFlash "
        "drafts as argmax(log q + G) with the verifier's noise G (q: the drafter's "
        "distribution at the request's temperature, top-k, top-p) instead of argmax q: a draft "
        "then matches with probability >= (1 - TV) / (1 + TV) instead of p(argmax q), more "
        "where the target spreads its mass. Costs one vocabulary-wide noise pass per drafted "
        "row of a covered request: measured on a 2-vCPU CPU it accepted 1.82x rejection "
        "sampling's drafts at temperature 1 (greedy drafts 1.31x) but served 0.87-0.91x its "
        "tok/s (greedy drafts 0.89-0.92x), so it is off by default")


class OnlineSpecConfig(_Section):
    """Root configuration of online speculative decoding: the `onlinespec` object of vLLM's
    `--additional-config` JSON (docs/configuration.md lists every key)."""

    preset: str | None = Field(
        None, description="named settings filling every key this config does not give "
        "(vllm_onlinespec/presets.py; a key given here wins): 'cpu' = the learner's settings "
        "and the CPU serving recipe the demo and benchmarks measured (budget verify policy, "
        "suffix-tree lookup; measured with num_speculative_tokens 16); None = the defaults "
        "below")
    enabled: bool = Field(True, description="learn online while serving (False = frozen drafter)")
    drafter: str | None = Field(
        None, description="path of the DFlash drafter checkpoint to start from (HF folder)")
    drafter_tokens: int | None = Field(
        None, ge=1, description="draft tokens the DFlash drafter proposes per request and step "
        "(>= 1; None = its trained block, block_size - 1, at most num_speculative_tokens). "
        "vLLM's num_speculative_tokens above it is room for prompt-lookup drafts only: a "
        "suffix-tree match may draft up to num_speculative_tokens tokens, the drafter never "
        "drafts rows it was not trained for")

    # -- what one update sees ---------------------------------------------------------------
    batch_blocks: int = Field(
        16, ge=1, description="training blocks (anchor + K predicted tokens) per update (>= 1)")
    anchors_per_request: int = Field(
        4, ge=1, description="at most this many block anchors drawn from one request's fresh "
        "tokens per update (>= 1)")
    anchor_stride: int | None = Field(
        None, ge=1, description="rows between the fresh tokens that anchor blocks, in [1, K] "
        "(None = K: the blocks tile the fresh tokens, each a label once, at one draft "
        "position; 1 = every fresh token anchors a block, so each is a label at every draft "
        "position 1..K: K times the blocks per fresh token)")
    replay: bool = Field(
        False, description="fill each update up to batch_blocks with blocks anchored on tokens "
        "already trained on, drawn from the same requests' recent windows (the learner beside "
        "serving gets ~20 fresh tokens between updates; replay lets it use spare CPU on them)")
    min_new_tokens_per_update: int = Field(
        16, ge=1, description="wait until the buffer holds at least this many fresh (untrained) "
        "tokens before an update (>= 1)")

    # -- where the learner computes ------------------------------------------------------------
    learner_device: str = Field(
        "auto", description="torch device of the learner (its drafter copy, length head, "
        "update-rule state, batches and loss): 'auto' = where vLLM's drafter lives (the GPU "
        "of a GPU worker, else 'cpu'), or 'cpu', 'cuda', 'cuda:1', ...")
    learner_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the learner's trainable parameters and update-rule "
        "state: 'float32', or 'bfloat16' (CUDA only; halves the learner's memory, updates "
        "round to bf16)")

    learner_compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the learner's matmuls, forward and backward (torch "
        "autocast; parameters, update-rule state, softmaxes and the length head stay in "
        "learner_dtype / float32): 'auto' = bfloat16 where the learner's device computes it in "
        "hardware (a GPU, or a CPU with AVX512-BF16 or AMX), else float32; 'float32'; "
        "'bfloat16'. Measured on a 2-core AVX512-BF16 EPYC: 2.4x faster updates, gradients "
        "within 1 % in direction of float32's (docs/results/learner_throughput.md)")

    trace_dir: str | None = Field(
        None, description="write what vLLM's drafter computed at every step (block positions, "
        "mask-row hidden states) to this directory, for parity checks (None = off)")

    update: UpdateConfig = Field(default_factory=UpdateConfig, description="online update rule")
    pacing: PacingConfig = Field(default_factory=PacingConfig, description="learner thread pacing")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="feedback buffer")
    publish: PublishConfig = Field(default_factory=PublishConfig, description="weight publishing")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="learner checkpoints")
    loss: LossConfig = Field(default_factory=LossConfig, description="online training loss")
    length_head: LengthHeadConfig = Field(
        default_factory=LengthHeadConfig, description="verify-length head and policy")
    oracle: OracleConfig = Field(
        default_factory=OracleConfig, description="benchmark-only forced acceptance (off)")
    features: FeatureLogConfig = Field(
        default_factory=FeatureLogConfig, description="log served tokens' target features "
        "for offline training (off)")
    prompt_lookup: PromptLookupConfig = Field(
        default_factory=PromptLookupConfig, description="prompt lookup where the request's "
        "own text predicts what follows, the drafter elsewhere (off)")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="verification of sampled requests")

    @property
    def invariant_sampling(self) -> str:
        """The resolved sampling.invariant: 'seeded', 'all' or 'off'."""
        mode = self.sampling.invariant
        if mode != "auto":
            return mode
        if self.oracle.accept_len is not None:  # forced acceptance: output is not the target's
            return "off"
        changes_drafts = (self.enabled or self.length_head.policy != "fixed"
                          or self.prompt_lookup.enabled)
        return "seeded" if changes_drafts else "off"

    @field_validator("learner_device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if v == "auto":
            return v
        try:
            import torch

            dev = torch.device(v)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"not a torch device: 'auto', 'cpu', 'cuda' or 'cuda:N' "
                             f"(got {v!r})") from None
        if dev.type not in ("cpu", "cuda", "meta"):  # meta: placement tests build on it
            raise ValueError(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N' (got {v!r})")
        return v

    @model_validator(mode="after")
    def _bf16_needs_cuda(self) -> "OnlineSpecConfig":
        if self.learner_dtype == "bfloat16" and self.learner_device == "cpu":
            raise ValueError("learner_dtype 'bfloat16' needs a CUDA learner_device (CPU "
                             "training keeps float32 parameters)")
        return self

    @model_validator(mode="after")
    def _confidence_needs_budget(self) -> "OnlineSpecConfig":
        if self.length_head.estimator == "confidence" and self.length_head.policy != "budget":
            raise ValueError(f"length_head.estimator 'confidence' needs length_head.policy "
                             f"'budget' (got {self.length_head.policy!r})")
        return self

    @model_validator(mode="after")
    def _oracle_is_explicit(self) -> "OnlineSpecConfig":
        if self.oracle.accept_len is None:
            return self
        if os.environ.get(ORACLE_ENV) != "1":
            raise ValueError(
                f"oracle.accept_len is benchmark-only (output is not the target's); set "
                f"{ORACLE_ENV}=1 in the environment to allow it")
        if self.enabled:
            raise ValueError("oracle.accept_len needs enabled = false (the learner would train "
                             "on forced acceptances)")
        return self

    @model_validator(mode="after")
    def _invariant_not_with_oracle(self) -> "OnlineSpecConfig":
        if self.oracle.accept_len is not None and self.sampling.invariant in ("seeded", "all"):
            raise ValueError("sampling.invariant needs oracle.accept_len unset (forced "
                             "acceptance replaces verification)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _accept_old_keys(cls, data: Any) -> Any:
        return _with_preset(_move_old_keys(data)[0])

    # Old flat names, read-only: the sections hold the values.
    algorithm = property(lambda self: self.update.algorithm)
    lr = property(lambda self: self.update.lr)
    weight_decay = property(lambda self: self.update.weight_decay)
    betas = property(lambda self: self.update.betas)
    eps = property(lambda self: self.update.adam_eps)
    grad_clip = property(lambda self: self.update.grad_clip)
    ensemble_lrs = property(lambda self: self.update.ensemble_lrs)
    hedge_eps = property(lambda self: self.update.hedge_lr)
    hedge_share = property(lambda self: self.update.hedge_share)
    update_interval_s = property(lambda self: self.pacing.update_interval_s)
    max_updates_per_s = property(lambda self: self.pacing.max_updates_per_s)
    learner_threads = property(lambda self: self.pacing.learner_threads)
    learner_cores = property(lambda self: self.pacing.learner_cores)
    learner_cpu_share = property(lambda self: self.pacing.learner_cpu_share)
    learner_priority = property(lambda self: self.pacing.learner_priority)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_any(cls, obj: Any = None) -> "OnlineSpecConfig":
        """Build a validated config from None (defaults), a dict, JSON text, a .json path, or an
        instance (re-validated, so a `model_copy(update=...)` cannot smuggle in bad values)."""
        if obj is None:
            data: Any = {}
        elif isinstance(obj, cls):
            data = obj.model_dump()
        elif isinstance(obj, dict):
            data = obj
        elif isinstance(obj, (str, bytes, os.PathLike)):
            data = _parse_text(obj)
        else:
            raise ConfigError(
                f"{ROOT}: expected None, a dict, JSON text or an OnlineSpecConfig "
                f"(got {type(obj).__name__})")
        if not isinstance(data, dict):
            raise ConfigError(f"{ROOT}: expected a JSON object (got {type(data).__name__})")
        data, renames = _move_old_keys(data)
        data = _with_preset(data)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, cls, renames)) from None

    def to_json(self) -> str:
        return self.model_dump_json()


def _parse_text(obj: str | bytes | os.PathLike) -> Any:
    if isinstance(obj, os.PathLike) or (
            isinstance(obj, str) and obj.strip().endswith(".json")
            and not obj.lstrip().startswith("{")):
        path = os.fspath(obj)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{ROOT}: cannot read config file {path!r}: {e.strerror}") from None
    else:
        text = obj.decode() if isinstance(obj, bytes) else obj
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{ROOT}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


# -- one-line error messages ----------------------------------------------------------------------


def _path(loc: tuple[Any, ...]) -> str:
    out = ROOT
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _field_info(model: type[BaseModel], loc: tuple[Any, ...]):
    """FieldInfo of the section field at `loc` (walking nested sections), or None."""
    info = None
    cur: Any = model
    for part in loc:
        if isinstance(part, int) or not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return None
        info = cur.model_fields.get(part)
        if info is None:
            return None
        cur = info.annotation
    return info


def _constraints(model: type[BaseModel], loc: tuple[Any, ...]) -> list:
    """annotated_types constraints that apply at `loc`, including list/tuple items."""
    n = len(loc)
    while n and isinstance(loc[n - 1], int):
        n -= 1
    info = _field_info(model, loc[:n])
    if info is None:
        return []
    if n == len(loc):
        return list(info.metadata)
    # An item: its constraints sit in Annotated[...] metadata of the container's type args.
    args = get_args(info.annotation)
    idx = loc[n]
    item = args[idx] if len(args) > 1 and idx < len(args) else (args[0] if args else None)
    return list(getattr(item, "__metadata__", ())) if item is not None else []


def _fmt_num(x: Any) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return repr(x)


def _range_of(constraints: list) -> str | None:
    lo = hi = None
    flat = []
    for m in constraints:  # a Field(...) inside Annotated carries its constraints as metadata
        flat.extend(getattr(m, "metadata", None) or [m])
    for m in flat:
        if isinstance(m, at.Gt):
            lo = ("(", m.gt)
        elif isinstance(m, at.Ge):
            lo = ("[", m.ge)
        elif isinstance(m, at.Lt):
            hi = (")", m.lt)
        elif isinstance(m, at.Le):
            hi = ("]", m.le)
    if lo and hi:
        return f"must be in {lo[0]}{_fmt_num(lo[1])}, {_fmt_num(hi[1])}{hi[0]}"
    if lo:
        return f"must be {'>' if lo[0] == '(' else '>='} {_fmt_num(lo[1])}"
    if hi:
        return f"must be {'<' if hi[0] == ')' else '<='} {_fmt_num(hi[1])}"
    return None


def _got(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _one(err: dict, model: type[BaseModel], renames: dict[tuple, tuple]) -> str:
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    # pydantic puts a union member's name into loc ("float", "none"): drop those tags.
    loc = tuple(p for p in loc if isinstance(p, int) or p not in ("float", "int", "none", "str"))
    shown = next((old + loc[2:] for new, old in renames.items() if loc[:2] == new), loc)
    path = _path(shown)
    cons = _constraints(model, loc)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        rng = _range_of(cons)
        if rng is None:
            op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
                  "less_than_equal": "<="}[kind]
            bound = next(iter(ctx.values()), "?")
            rng = f"must be {op} {_fmt_num(bound)}"
        return f"{path}: {rng} (got {_got(err.get('input'))})"
    if kind == "literal_error":
        return f"{path}: must be one of {ctx.get('expected')} (got {_got(err.get('input'))})"
    if kind == "extra_forbidden":
        parent = _field_info(model, loc[:-1]) if len(loc) > 1 else None
        owner = parent.annotation if parent is not None else (model if len(loc) == 1 else None)
        allowed = ", ".join(owner.model_fields) if isinstance(owner, type) else ""
        return f"{path}: unknown field" + (f" (allowed: {allowed})" if allowed else "")
    if kind == "missing":
        return f"{path}: required field missing"
    if kind == "value_error":
        msg = str(ctx.get("error", err.get("msg", "")))
        return f"{path}: {msg}"
    msg = err.get("msg") or kind
    rng = _range_of(cons)
    suffix = f"; {rng}" if rng else ""
    return f"{path}: {msg[0].lower() + msg[1:]}{suffix} (got {_got(err.get('input'))})"


def format_validation_error(e: ValidationError, model: type[BaseModel] = OnlineSpecConfig,
                            renames: dict[tuple, tuple] | None = None) -> str:
    """All errors of `e` on one line, '; '-separated, each 'onlinespec.<path>: <rule> (got x)'.
    renames {new loc prefix: old loc prefix}: name moved keys as the user wrote them."""
    return "; ".join(_one(err, model, renames or {})
                     for err in e.errors(include_url=False)).replace("\n", " ")
