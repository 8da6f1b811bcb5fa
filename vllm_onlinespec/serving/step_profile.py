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
from dataclasses import asdict, dataclass
from typing import Iterator



@dataclass
class StepProfile:
    steps: int = 0
    target_s: float = 0.0
    sample_s: float = 0.0
    draft_s: float = 0.0
    ours_s: float = 0.0
    ours_in_sample_tokens_s: float = 0.0  # the part of ours_s that runs inside sample_tokens
    sample_tokens_s: float = 0.0  # the whole sample_tokens call (sample, draft, part of ours)

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

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
