"""The length head against real verification: every verified draft is a label.

At each cut the cutter records, per request, what the head predicted (also when the policy did
not use it: shadow predictions), what the population estimate was, how many draft tokens went
to verification and the head's input rows. The next step's verification gives the request's
accepted count. The label (accepted + 1) / (K + 1) is exact when verification stopped inside
the verified part (accepted < verified) or the whole draft was verified; a request accepted up
to its cut is censored (it would have accepted more) and is not scored.

Two uses of those labels:
  gate   the head is consulted only once it has predicted at least `min_labels` fresh labels
         and its mean squared error (decayed) is below the population estimate's on the same
         labels; until then the policy uses the population estimate and its reason says why
  learn  with `lr` > 0, one small step of the head on each step's exact labels (MSE on the
         accepted fraction, the loss the learner trains it with offline), on the serving thread:
         the head is a 2-layer MLP on [B, 2H], ~0.1 ms per step
Core module: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MAX_PENDING = 4096  # cuts awaiting their verification (a server's running requests, bounded)


@dataclass
class LabelScore:
    """A prediction of (accepted + 1) / (K + 1) and the population estimate's, scored on the
    same exact labels: decayed squared errors (half-life in labels). Shared by the length head's
    feedback and the confidence estimator (policy/acceptance_estimator.py)."""

    half_life: float = 500.0
    labels: int = 0  # exact labels scored (not decayed)
    err: float = 0.0  # decayed sums over scored labels
    err_pop: float = 0.0
    weight: float = 0.0

    def add(self, pred: float, pop: float, y: float) -> None:
        lam = 0.5 ** (1.0 / self.half_life)
        self.err = lam * self.err + (pred - y) ** 2
        self.err_pop = lam * self.err_pop + (pop - y) ** 2
        self.weight = lam * self.weight + 1.0
        self.labels += 1

    @property
    def mse(self) -> float | None:
        return self.err / self.weight if self.labels else None

    @property
    def population_mse(self) -> float | None:
        return self.err_pop / self.weight if self.labels else None

    @property
    def beats_population(self) -> bool:
        return self.labels > 0 and self.err < self.err_pop

    def describe(self, name: str) -> str:
        verdict = "beats" if self.beats_population else "does not beat"
        return (f"{name} MSE {self.mse:.4f} {verdict} population {self.population_mse:.4f} "
                f"on {self.labels} fresh labels")


def exact_label(verified: int, accepted: int, K: int) -> float | None:
    """(accepted + 1) / (K + 1) for a draft verified `verified` tokens deep, or None where the
    label is censored (accepted up to a cut below K: it would have accepted more)."""
    if verified <= 0 or (accepted >= verified and verified < K):
        return None
    return (min(accepted, verified) + 1) / (K + 1)


@dataclass
class PendingCut:
    r_head: float | None  # the head's prediction for this draft (None: no head prediction)
    r_pop: float | None  # the population estimate at that step (None: not enough data yet)
    verified: int  # draft tokens sent to verification
    rows: torch.Tensor | None  # [K, H] the head's input, for learning (None when not learning)


class HeadFeedback:
    def __init__(self, K: int, *, min_labels: int = 64, lr: float = 0.0,
                 half_life: float = 500.0) -> None:
        self.K, self.min_labels, self.lr = K, min_labels, lr
        self.pending: dict[str, PendingCut] = {}
        self.score = LabelScore(half_life)
        self.updates = 0
        self._opt: torch.optim.Optimizer | None = None

    # -- the gate -------------------------------------------------------------------------------
    @property
    def labels(self) -> int:
        return self.score.labels

    def passes(self) -> bool:
        if self.min_labels == 0:
            return True
        return self.labels >= self.min_labels and self.score.beats_population

    def state(self) -> str:
        if self.min_labels == 0:
            return "ungated"
        if self.labels < self.min_labels:
            return f"gated: {self.labels}/{self.min_labels} fresh labels"
        return self.score.describe("head")

    # -- a step ---------------------------------------------------------------------------------
    def record(self, req_ids: list[str], r_head: list[float] | None, r_pop: float | None,
               verified: list[int], rows: torch.Tensor | None) -> None:
        """At the cut: rows [B, K, H] (the head's input) or None."""
        keep = rows is not None and self.lr > 0
        if keep:
            with torch.inference_mode(False):  # vLLM's tensors are inference tensors
                rows = rows.detach().float().clone()
        while len(self.pending) > MAX_PENDING:  # requests that vanished without finishing
            self.pending.pop(next(iter(self.pending)))
        for i, rid in enumerate(req_ids):
            self.pending[rid] = PendingCut(
                None if r_head is None else float(r_head[i]), r_pop, int(verified[i]),
                rows[i] if keep else None)

    def observe(self, head: nn.Module | None, req_ids: list[str], verified: list[int],
                accepted: list[int]) -> int:
        """After verification: score and learn from each request's exact label; returns how
        many were exact. Requests without a recorded cut (a first step) are ignored."""
        xs, ys, exact = [], [], 0
        for rid, n, a in zip(req_ids, verified, accepted):
            cut = self.pending.pop(rid, None)
            y = None if cut is None else exact_label(n, a, self.K)
            if y is None:
                continue  # no recorded cut, nothing verified, or censored at the cut
            exact += 1
            if cut.r_head is not None and cut.r_pop is not None:
                self.score.add(cut.r_head, cut.r_pop, y)
            if cut.rows is not None:
                xs.append(cut.rows)
                ys.append(y)
        if xs and head is not None and self.lr > 0:
            self._learn(head, torch.stack(xs), torch.tensor(ys))
        return exact

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.pending.pop(rid, None)

    def _learn(self, head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.inference_mode(False), torch.enable_grad():
            params = [p for p in head.parameters()]
            for p in params:
                p.requires_grad_(True)
            if self._opt is None:
                self._opt = torch.optim.Adam(params, lr=self.lr)
            dev = params[0].device
            loss = (head(x.to(dev)).float() - y.to(dev)).pow(2).mean()
            self._opt.zero_grad(set_to_none=True)
            loss.backward()
            self._opt.step()
        self.updates += 1
