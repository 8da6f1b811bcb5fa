"""What a whole engine step costs beyond what the budget models: the gate's measured correction.

The step gate prices a step as the target's modelled forward t(n) (StepCostModel, fitted to the
timed target span) plus the drafter's measured forward at the step's draft length. An engine
step is more than those two spans: the rejection sampler, vLLM's bookkeeping of accepted
tokens, the scheduler, our own hooks. Those extra seconds differ between a drafted step and a
K = 0 step (more sampled positions, more tokens to book) and they are what made a step the
model called cheap slower in practice. This estimator measures them: for each engine cycle (one
`execute_model` start to the next) it takes the wall time minus the modelled spans and keeps an
exponential average per kind of step (drafted or not) and batch-size bucket. The gate adds each
kind's overhead to its price, so its comparison is the measured throughput of drafted vs K = 0
steps at the same batch size, with the model only interpolating over token counts.

Why residuals and not raw throughput per k: raw tokens/s per (batch size, k) would need every
pair measured and re-measured as prefill load shifts; the residual is small, changes slowly and
transfers across token counts because the model already accounts for them.

Core module: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket: 1, 2, 4, 8, ... (batch sizes whose overheads are alike)."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


@dataclass
class CycleOverhead:
    """Exponential average of (measured cycle seconds - modelled seconds), keyed by
    (drafted, batch bucket). A residual beyond `clip` times the modelled step is clipped there:
    an idle gap between bursts of requests is not a step's cost."""

    half_life_steps: float = 32.0
    clip: float = 1.0
    ema: dict[tuple[bool, int], float] = field(default_factory=dict)
    samples: dict[tuple[bool, int], int] = field(default_factory=dict)

    def observe(self, drafted: bool, batch_size: int, measured_s: float, modelled_s: float) -> None:
        if batch_size <= 0 or not (measured_s >= 0 and modelled_s >= 0):
            return
        resid = measured_s - modelled_s
        resid = max(-modelled_s, min(self.clip * modelled_s, resid))
        key = (bool(drafted), batch_bucket(batch_size))
        decay = 0.5 ** (1.0 / self.half_life_steps)
        old = self.ema.get(key)
        self.ema[key] = resid if old is None else decay * old + (1 - decay) * resid
        self.samples[key] = self.samples.get(key, 0) + 1

    def get(self, drafted: bool, batch_size: int) -> float:
        """Seconds a step of this kind costs beyond the model. Unmeasured bucket: the nearest
        measured bucket of the same kind; nothing of that kind measured: 0 (the model alone)."""
        kind = [b for (d, b) in self.ema if d == bool(drafted)]
        if not kind:
            return 0.0
        want = batch_bucket(batch_size)
        near = min(kind, key=lambda b: (abs(b.bit_length() - want.bit_length()), b))
        return self.ema[(bool(drafted), near)]

    def as_dict(self) -> dict[str, float]:
        return {f"{'drafted' if d else 'k0'}@B{b}": v for (d, b), v in sorted(self.ema.items())}

    def describe(self) -> str:
        if not self.ema:
            return "step overhead: nothing measured"
        parts = [f"{'drafted' if d else 'k=0'}@B{b} {v * 1e3:+.1f} ms"
                 for (d, b), v in sorted(self.ema.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
        return "step overhead beyond the model: " + ", ".join(parts)
