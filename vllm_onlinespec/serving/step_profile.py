"""Where one engine step's time goes inside the worker, accumulated over the run.

    target    execute_model: input preparation + the target's forward over every scheduled
              token (verified drafts included)
    sample    _sample: the (rejection) sampler
    draft     propose_draft_token_ids: the drafter's input preparation and forward
    ours      this project's hooks: feedback capture, after-step (buffer, publish, metrics),
              draft cutting, the oracle
    other     the rest of sample_tokens (vLLM's bookkeeping, output lists)

The engine step's wall time also holds the scheduler and the engine-core <-> worker hand-off,
which the worker cannot see: a benchmark gets it as (wall time / steps) - worker total.
Host timers: on CPU every op is synchronous, so perf_counter brackets the real work.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator

from vllm_onlinespec.policy.cycle_overhead import batch_bucket


def _add(split: dict[str, list[float]], key: str, seconds: float, tokens: int) -> None:
    acc = split.setdefault(key, [0, 0.0, 0])
    acc[0] += 1
    acc[1] += seconds
    acc[2] += tokens


@dataclass
class StepProfile:
    steps: int = 0
    target_s: float = 0.0
    sample_s: float = 0.0
    draft_s: float = 0.0
    ours_s: float = 0.0
    ours_in_sample_tokens_s: float = 0.0  # the part of ours_s that runs inside sample_tokens
    sample_tokens_s: float = 0.0  # the whole sample_tokens call (sample, draft, part of ours)
    # The target span split by whether the learner was inside an update when the step began,
    # per batch bucket ("busy@B8" / "idle@B8" -> [steps, target seconds, scheduled tokens]):
    # what a learner busy beside serving costs a step and a verified token, like for like.
    learner: dict[str, list[float]] = field(default_factory=dict)
    # The same span by the budget's option the step verified (policy/option_choice.py), its
    # batch bucket and whether prefill shared the step ("tree@B16+prefill" -> [steps, target
    # seconds, scheduled tokens]): what each option's steps cost, prefill steps included.
    options: dict[str, list[float]] = field(default_factory=dict)
    lean_greedy_steps: int = 0  # all-greedy steps verified by compat/greedy_verify.py

    def observe_target(self, seconds: float, *, learner_busy: bool | None = None,
                       batch_size: int = 0, tokens: int = 0, option: str | None = None) -> None:
        """One execute_model span; learner_busy None: no learner (that split stays empty);
        option: the budget's option the step verified, as "tree@B16" (+"+prefill")."""
        self.steps += 1
        self.target_s += seconds
        if option is not None:
            _add(self.options, option, seconds, tokens)
        if learner_busy is not None and batch_size > 0:
            _add(self.learner, f"{'busy' if learner_busy else 'idle'}@B{batch_bucket(batch_size)}",
                 seconds, tokens)

    @contextmanager
    def ours(self, inside_sample_tokens: bool) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.ours_s += dt
            if inside_sample_tokens:
                self.ours_in_sample_tokens_s += dt

    def per_step_ms(self) -> dict[str, float]:
        """Mean ms per step of each phase; `other` = sample_tokens minus what is inside it."""
        n = max(1, self.steps)
        other = (self.sample_tokens_s - self.sample_s - self.draft_s
                 - self.ours_in_sample_tokens_s)
        return {"target": 1e3 * self.target_s / n, "sample": 1e3 * self.sample_s / n,
                "draft": 1e3 * self.draft_s / n, "ours": 1e3 * self.ours_s / n,
                "other": 1e3 * max(0.0, other) / n}

    def learner_cost(self) -> dict[str, float]:
        """Per batch bucket with both kinds of step: a busy-learner step's target ms per
        scheduled token over an idle-learner one's ("B8": 1.04), and over every such bucket,
        weighted by the idle steps ("all"). {} without steps of both kinds."""
        out: dict[str, float] = {}
        num = den = 0.0
        for key, (n_busy, s_busy, t_busy) in self.learner.items():
            kind, _, bucket = key.partition("@")
            idle = self.learner.get(f"idle@{bucket}")
            if kind != "busy" or not idle or not (n_busy and t_busy and idle[0] and idle[2]):
                continue
            per_tok_busy, per_tok_idle = s_busy / t_busy, idle[1] / idle[2]
            if per_tok_idle <= 0:
                continue
            out[bucket] = round(per_tok_busy / per_tok_idle, 4)
            num += idle[0] * per_tok_busy / per_tok_idle
            den += idle[0]
        if den:
            out["all"] = round(num / den, 4)
        return out

    def as_dict(self) -> dict:
        return {**asdict(self), "learner_cost": self.learner_cost()}
