"""The worker's figures as ONE typed record, read by attribute everywhere.

Produced by `session_stats` (OnlineSession.stats()) in the worker; crosses the process boundary as a plain dict
(`dataclasses.asdict`, for `collective_rpc("onlinespec_stats")` and the metrics file) and is
parsed back with `OnlineSpecStats.from_dict` by every reader (metrics collector, bench, tests,
examples), so a misspelt field is an AttributeError, never a silent 0. No vLLM import here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

NAN = float("nan")


def _build(cls: type, d: Mapping[str, Any] | None) -> Any:
    """cls from the fields of d; fields d lacks keep their defaults (a newer reader of an older
    file), keys cls does not know are ignored (an older reader of a newer file)."""
    if d is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class LearnerStats:
    """OnlineLearner.stats(): one online update's outcome and the learner's counters."""

    version: int = 0
    updates: int = 0
    attempts: int = 0
    errors: int = 0
    skipped_nonfinite: int = 0
    checkpoint_errors: int = 0
    last_loss: float = NAN
    loss_ema: float = NAN
    update_ms: float = NAN
    update_ms_ema: float = NAN
    grad_norm: float = NAN
    busy_s: float = 0.0
    running: bool = False
    in_update: bool = False  # between taking a batch and its update's end, now
    last_error: str | None = None
    fresh_trainable: int = 0  # fresh tokens the next update could use (held-back ones excluded)
    caught_up: bool = True  # fresh_trainable < min_new_tokens_per_update: no update until more
    hedge_weights: list[float] | None = None
    share: float = NAN  # fraction of wall time the learner may be busy now (pacing)
    gain_scores: int = 0  # batches scored against the frozen start weights (share_control gain)
    share_reason: str | None = None  # why the share is what it is
    # Mean over the duty cycle's window of accepted draft tokens per block, current minus start
    # weights on the same fresh verified text: the learner's own paired estimate of what it won
    gain_mean: float = NAN
    gain_t: float = NAN  # t-statistic of gain_mean against 0 over the window's scores
    score_errors: int = 0
    loss: dict[str, float] = field(default_factory=dict)  # the loss function's own statistics

    @classmethod
    def from_learner(cls, d: Mapping[str, Any]) -> "LearnerStats":
        loss = {k.removeprefix("loss/"): float(v) for k, v in d.items() if k.startswith("loss/")}
        return dataclasses.replace(_build(cls, d), loss=loss)


@dataclass
class BufferStats:
    """FeedbackBuffer.stats(): what the bounded feedback buffer holds and has seen (tokens)."""

    size: int = 0
    records: int = 0
    requests: int = 0
    fresh: int = 0
    records_in: int = 0
    tokens_in: int = 0
    drops: int = 0
    evictions: int = 0
    gaps: int = 0
    trained: int = 0
    context: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance: float = 0.0


@dataclass
class HookStats:
    """Serving-side hooks: failures of OUR code (the step went on as vLLM alone would have run
    it) and silent skips, by hook / reason name."""

    errors: dict[str, int] = field(default_factory=dict)
    skips: dict[str, int] = field(default_factory=dict)

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())


@dataclass
class CutterStats:
    """The draft cutter (length head -> verify-length policy -> cut)."""

    policy: str = "fixed"
    head: str = "off"  # off | warming (the learner has not trained it yet) | gated (not yet
    # better than the population estimate on fresh verification labels) | on
    drafted: int = 0  # draft tokens proposed before the cut
    verified: int = 0  # draft tokens sent to verification
    last_reason: str = ""
    head_updates: int = 0  # published versions that refreshed the head
    head_labels: int = 0  # exact verification labels the head was scored on
    head_feedback_updates: int = 0  # steps the head learned from verification labels
    # The confidence estimator (length_head.estimator 'confidence'), scored as the head is:
    # decayed mean squared error on exact block labels, its own and the population estimate's.
    estimator_labels: int = 0
    head_mse: float | None = None  # the length head's, on its exact labels (head_labels)
    head_population_mse: float | None = None
    estimator_mse: float | None = None
    estimator_population_mse: float | None = None
    gate_steps: int = 0  # steps the budget's gate decided (0: no gate)
    gate_shut_steps: int = 0  # ... of which drafted at K = 0 (nothing verified next step)
    gate_explore_steps: int = 0  # ... of which drafted only to explore
    gate_short_steps: int = 0  # ... of which drafted 0 < k < K tokens (only those paid)
    # Measured engine-cycle seconds beyond the modelled target and drafter spans, by kind of
    # step and batch bucket ("drafted@B8" / "k0@B8"), as the gate prices them.
    gate_overhead_s: dict[str, float] = field(default_factory=dict)
    # The budget's options (policy/option_choice.py): steps each ran, and what each option's
    # measured cycles cost per produced token by batch bucket ("tree@B8": ms).
    option_steps: dict[str, int] = field(default_factory=dict)
    option_ms_per_token: dict[str, float] = field(default_factory=dict)
    option_tree_as_plain: int = 0  # tree cycles that verified nothing, priced as plain ones
    option_clipped: int = 0  # cycles counted at the clip (stalls), not their measured length

    @classmethod
    def from_cutter(cls, c: Any) -> "CutterStats":
        """Read a policy.cutter.DraftCutter."""
        g = c.gate
        return cls(policy=c.policy_name, head=c.head_state, drafted=c.drafted,
                   verified=c.verified, last_reason=c.last_reason, head_updates=c.head_version,
                   head_labels=c.feedback.labels, head_feedback_updates=c.feedback.updates,
                   gate_steps=g.steps if g else 0, gate_shut_steps=g.shut_steps if g else 0,
                   gate_explore_steps=g.explore_steps if g else 0,
                   gate_short_steps=g.short_steps if g else 0,
                   gate_overhead_s=g.overhead.as_dict() if g else {},
                   option_steps=dict(c.options.chosen) if c.options else {},
                   option_ms_per_token=c.options.ms_per_token() if c.options else {},
                   option_tree_as_plain=c.options.tree_as_plain if c.options else 0,
                   option_clipped=c.options.clipped if c.options else 0,
                   **_estimator_fields(c))


@dataclass
class OnlineSpecStats:
    steps: int = 0
    published_version: int = 0  # the version vLLM's drafter holds
    publishes: int = 0
    publish_ms_last: float = NAN
    publish_ms_total: float = 0.0
    oracle_accept_len: float = 0.0  # 0 = oracle off
    cost_a_s: float | None = None  # budget policy's step cost model (None: no cost model)
    cost_b_s_per_token: float | None = None
    resumed_from: str | None = None  # checkpoint the learner resumed, None = fresh start
    target_swaps: int = 0  # in-flight swaps of the target's weights (serving/target_swap.py)
    # vLLM drafter calls by kind: "draft" (a forward that drafts), "context" (a K = 0 step's
    # context K/V only), "none" (a K = 0 step of an engine that never drafts: nothing runs)
    drafter_passes: dict[str, int] = field(default_factory=dict)
    lookup_rows: int = 0  # request-steps whose verified draft came from prompt lookup
    lookup_drafted: int = 0  # of those, draft tokens verified
    lookup_accepted: int = 0  # and accepted
    lookup_recent_rows: int = 0  # request-steps whose lookup draft came from other requests' text
    lookup_skipped_steps: int = 0  # steps every request drafted by lookup: no drafter forward
    lookup_priced_cut: int = 0  # tree draft tokens the budget left unverified (they did not pay)
    lookup_weak_rows: int = 0  # tree drafts below suffix_min_score taken where the drafter had none
    lookup_calibration: float = 1.0  # accepted / the tree's expected tokens, as verified
    invariant_mode: str = "off"  # sampling.invariant as resolved: "seeded", "all" or "off"
    invariant_rows: int = 0  # sampled request-steps verified drafter-invariantly
    coupled_rows: int = 0  # of the drafting ones, drafts drawn with the verifier's noise
    invariant_whole_steps: int = 0  # engine steps sampled entirely here: vLLM's sampler skipped
    # sampled request-steps the mode should cover but left to vLLM's sampling, by reason
    invariant_fallbacks: dict[str, int] = field(default_factory=dict)
    hooks: HookStats = field(default_factory=HookStats)
    cutter: CutterStats = field(default_factory=CutterStats)
    learner: LearnerStats | None = None  # None: learning off
    buffer: BufferStats | None = None

    @property
    def hook_errors(self) -> int:
        return self.hooks.total_errors

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "OnlineSpecStats":
        """Parse what `to_dict` produced (an RPC result or a metrics file); {} gives defaults."""
        d = dict(d or {})
        out = _build(cls, {k: v for k, v in d.items()
                           if k not in ("hooks", "cutter", "learner", "buffer")})
        out.hooks = _build(HookStats, d.get("hooks")) or HookStats()
        out.cutter = _build(CutterStats, d.get("cutter")) or CutterStats()
        out.learner = _build(LearnerStats, d.get("learner"))
        out.buffer = _build(BufferStats, d.get("buffer"))
        return out


def _estimator_fields(c: Any) -> dict[str, Any]:
    """The head's and the confidence estimator's errors on their exact labels, beside the
    population estimate's on the same labels (None where nothing was scored)."""
    out: dict[str, Any] = {}
    for prefix, owner in (("head", c.feedback), ("estimator", getattr(c, "estimator", None))):
        score = getattr(owner, "score", None)
        if score is None or not score.labels:
            continue
        out[f"{prefix}_mse"] = round(score.mse, 5)
        out[f"{prefix}_population_mse"] = round(score.population_mse, 5)
    if getattr(c, "estimator", None) is not None:
        out["estimator_labels"] = c.estimator.labels
    return out


def drafter_pass_counts(proposer: Any) -> dict[str, int]:
    """vLLM's drafter calls by kind (compat/drafter.py install_context_only_k0), and the
    deferred context's rows ("deferred_written", ...: compat/deferred_context.py)."""
    out = dict(getattr(proposer, "_onlinespec_passes", None) or {})
    store = getattr(proposer, "_onlinespec_deferred", None)
    if store is not None:
        out.update({f"deferred_{k}": v for k, v in store.stats().items()})
    return out


def lookup_fields(lookup: Any) -> dict[str, float]:
    """OnlineSpecStats' lookup_* fields from a serving.lookup.LookupStage (None: lookup off)."""
    if lookup is None:
        return {}
    return {"lookup_rows": lookup.rows, "lookup_drafted": lookup.drafted,
            "lookup_accepted": lookup.accepted, "lookup_recent_rows": lookup.recent_rows,
            "lookup_skipped_steps": lookup.skipped_steps, "lookup_priced_cut": lookup.priced_cut,
            "lookup_weak_rows": lookup.weak_rows,
            "lookup_calibration": round(lookup.calibration.scale, 4)}


def invariant_fields(inv: Any) -> dict[str, Any]:
    """OnlineSpecStats' invariant fields from the runner's InvariantVerifier (None: off)."""
    if inv is None:
        return {}
    return {"invariant_mode": inv.mode, "invariant_rows": inv.covered_steps,
            "coupled_rows": inv.coupled_rows, "invariant_whole_steps": inv.replaced_steps,
            "invariant_fallbacks": dict(inv.fallbacks)}


def session_stats(s: Any) -> OnlineSpecStats:
    """The figures of a serving.session.OnlineSession, read now."""
    cm, pub = s.cutter.cost_model, s.publisher
    out = OnlineSpecStats(
        steps=s.steps, published_version=pub.version, publishes=pub.count,
        publish_ms_last=pub.last_ms, publish_ms_total=pub.total_ms,
        oracle_accept_len=s.oracle.accept_len if s.oracle else 0.0,
        cost_a_s=cm.a if cm is not None else None,
        cost_b_s_per_token=cm.b if cm is not None else None,
        resumed_from=s.resumed_from, hooks=s.guard.stats(), target_swaps=s.target_swaps,
        drafter_passes=drafter_pass_counts(getattr(s.runner, "drafter", None)),
        cutter=CutterStats.from_cutter(s.cutter),
        **invariant_fields(getattr(s.runner, "_onlinespec_invariant", None)),
        **lookup_fields(s.lookup))
    if s.learner is not None:
        out.learner = LearnerStats.from_learner(s.learner.stats())
        out.buffer = BufferStats(**s.buffer.stats())
    return out


def session_info(s: Any) -> dict[str, str]:
    """The settings in force, as the `onlinespec:config_info` metric's labels."""
    return {"algorithm": s.cfg.update.algorithm, "learning": str(s.cfg.enabled),
            "verify_policy": s.cfg.length_head.policy, "K": str(s.K),
            "prompt_lookup": str(s.lookup is not None), "length_head": s.cutter.head_state}


def fetch(llm: Any) -> OnlineSpecStats:
    """The first worker's stats of an `LLM` (offline engine), parsed."""
    return OnlineSpecStats.from_dict(llm.collective_rpc("onlinespec_stats")[0])


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)
