"""An online acceptance estimator from the drafter's confidence: the length head's peer.

vLLM's adaptive verification (PR #52228) predicts whether each draft token survives
verification from one feature, logit(max q): the log-odds of the drafter's own top-1
probability at that position, mapped to a probability by a logistic model fitted online from
verification results. This module is that estimator for this project's budget policy:

    P(token j accepted | tokens < j were) = sigmoid(w_j * logit(c_j) + b_j)

c_j the drafter's top-1 probability at draft position j, one (w_j, b_j) per position, started at
(1, 0) (the drafter's confidence taken at its word) and moved by one AdaGrad step on the log
loss per label. Labels come from the next step's verification of what the cut kept: positions
before the first rejection are 1, the first rejected position 0, later ones unlabelled (their
prefix was not accepted).

Where the length head predicts a whole block's acceptance from the drafter's hidden states and
needs training (offline, by the learner, or from verification), this needs only the logits
vLLM computes anyway and two numbers per position. Both are scored on the same exact labels the
head feedback uses (policy/head_feedback.py: (accepted + 1) / (K + 1), censored drafts left
out) against the population estimate, so the serving stats compare them directly.

Core module: numpy only, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_onlinespec.policy.head_feedback import LabelScore, exact_label

EPS = 1e-4  # confidences are clipped to [EPS, 1 - EPS] before the log-odds
MAX_PENDING = 4096  # cuts awaiting their verification (bounded, as head_feedback's)


def logit(c: np.ndarray) -> np.ndarray:
    c = np.clip(np.asarray(c, dtype=np.float64), EPS, 1 - EPS)
    return np.log(c) - np.log1p(-c)


@dataclass
class _Pending:
    x: np.ndarray  # [k] logit(c) per draft position
    verified: int  # tokens the cut kept
    r_est: float  # predicted (accepted + 1) / (K + 1) over the verified part
    r_pop: float | None  # the population estimate's, same definition


class ConfidenceEstimator:
    def __init__(self, K: int, *, lr: float = 0.05, half_life: float = 500.0) -> None:
        if K < 1 or lr <= 0 or half_life <= 0:
            raise ValueError(f"ConfidenceEstimator: want K >= 1, lr > 0, half_life > 0 "
                             f"(got {K}, {lr}, {half_life})")
        self.K, self.lr = K, lr
        self.w = np.ones(K)
        self.b = np.zeros(K)
        self._g2 = np.full((K, 2), 1e-8)  # AdaGrad's squared-gradient sums (w, b)
        self.pending: dict[str, _Pending] = {}
        self.score = LabelScore(half_life)  # block predictions against exact labels
        self.updates = 0  # position labels learned from

    @property
    def labels(self) -> int:
        return self.score.labels

    def predict(self, conf: np.ndarray) -> np.ndarray:
        """[B, k] confidences -> [B, k] conditional acceptance probabilities."""
        x = logit(conf)
        k = x.shape[-1]
        return 1.0 / (1.0 + np.exp(-(self.w[:k] * x + self.b[:k])))

    def record(self, req_ids: list[str], conf: np.ndarray, p: np.ndarray, verified: list[int],
               r_pop: float | None) -> None:
        """At the cut: each request's confidences [B, k], the predictions the cut used
        (`predict(conf)`) and the verified lengths."""
        x = logit(conf)
        while len(self.pending) > MAX_PENDING:  # requests that vanished without finishing
            self.pending.pop(next(iter(self.pending)))
        for i, rid in enumerate(req_ids):
            n = int(verified[i])
            g = np.cumprod(p[i, :n])
            self.pending[rid] = _Pending(x[i], n, (1.0 + float(g.sum())) / (self.K + 1), r_pop)

    def observe(self, req_ids: list[str], verified: list[int], accepted: list[int]) -> None:
        """After verification: learn each position label, score each exact block label."""
        for rid, n, a in zip(req_ids, verified, accepted):
            cut = self.pending.pop(rid, None)
            if cut is None or n <= 0:
                continue
            n = min(n, cut.verified, len(cut.x))
            a = min(int(a), n)
            labelled = a + 1 if a < n else n  # through the first rejection
            for j in range(labelled):
                self._step(j, float(cut.x[j]), 1.0 if j < a else 0.0)
            y = exact_label(n, a, self.K)
            if y is not None and cut.r_pop is not None:
                self.score.add(cut.r_est, cut.r_pop, y)

    def _step(self, j: int, x: float, y: float) -> None:
        p = 1.0 / (1.0 + np.exp(-(self.w[j] * x + self.b[j])))
        grad = np.array([(p - y) * x, p - y])
        self._g2[j] += grad * grad
        step = self.lr * grad / np.sqrt(self._g2[j])
        self.w[j] -= step[0]
        self.b[j] -= step[1]
        self.updates += 1

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.pending.pop(rid, None)

    def state(self) -> str:
        if not self.labels:
            return "confidence estimator: no exact labels yet"
        return self.score.describe("confidence estimator")
