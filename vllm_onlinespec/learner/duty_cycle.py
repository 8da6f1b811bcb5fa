"""The learner's duty cycle follows what learning buys.

The learner shares the serving box's cores (or GPU) with the engine; every second it trains
is a second serving may wait. Where the drafter already matches the target, updates buy
nothing and the learner should nearly idle; where the target differs (a fine-tuned or swapped
model) or has just changed, it should train at its full share.

The signal. Every `score_every`-th update, before it trains, the learner scores the batch's
fresh blocks (verified text it has not trained on; replayed blocks would flatter the current
weights) twice, without gradients: with its current weights and with the frozen start weights.
Both give accepted draft tokens per block on the same text, so their difference, the *gain*, is
a paired estimate whose batch-to-batch noise largely cancels. Three things call for learning:

* the gain is above zero: the start weights do not match what is served (a fine-tuned or
  changed target), training has paid and more fresh text may pay more (t-statistic of the
  window's mean gain);
* the gain is rising: updates are still paying (t-statistic of the least-squares slope of the
  gain over the last `window` scores);
* the current weights' acceptance dropped against its own recent past: the target or the
  traffic changed (t-statistic of the mean of the older half of the window minus the newer).

Where the drafter already matches the served traffic, none holds (online learning measured no
gain in-domain) and the learner idles at min_share.

A cold start is the exception: where the start weights draft (almost) nothing on the served
text (mean reference acceptance below `cold_accepted` drafts per block: random or minutes-
trained weights, or a drafter for another tokenizer's habits), current and reference both sit
at the zero floor, a paired gain cannot show until training has already paid, and there is no
drafting to lose. The learner keeps its full share there.

share = min_share + (max_share - min_share) * clip((t - t_idle) / (t_full - t_idle), 0, 1) with
t the largest statistic. Until `warmup` scores exist the learner runs at max_share (a cold start
has everything to learn). A ramp holds for `hold` scores so that one noisy window does not
switch it off. Cost: two no-gradient forwards over the fresh blocks every `score_every`
updates (a fresh block set is a fraction of a replay-filled batch).

Pure module: no torch, no vLLM.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GainScore:
    update: int  # learner update count when scored
    current: float  # accepted draft tokens per block, current weights
    reference: float  # the same blocks, frozen start weights

    @property
    def gain(self) -> float:
        return self.current - self.reference


def slope_t(xs: list[float], ys: list[float]) -> float:
    """t-statistic of the least-squares slope of ys on xs (0 when undefined)."""
    n = len(xs)
    if n < 3:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(resid / (n - 2) / sxx)
    return b / se if se > 0 else (math.inf if b > 0 else 0.0)


def mean_t(ys: list[float]) -> float:
    """t-statistic of the mean of ys against 0 (0 when undefined)."""
    n = len(ys)
    if n < 3:
        return 0.0
    m = sum(ys) / n
    sd = math.sqrt(sum((y - m) ** 2 for y in ys) / (n - 1))
    return m / (sd / math.sqrt(n)) if sd > 0 else (math.inf if m > 0 else 0.0)


def drop_t(ys: list[float]) -> float:
    """t-statistic of (mean of the older half) - (mean of the newer half): > 0 when ys fell."""
    h = len(ys) // 2
    if h < 2:
        return 0.0
    old, new = ys[:h], ys[-h:]
    mo, mn = sum(old) / h, sum(new) / h
    var = (sum((y - mo) ** 2 for y in old) + sum((y - mn) ** 2 for y in new)) / (2 * h - 2)
    se = math.sqrt(2 * var / h)
    return (mo - mn) / se if se > 0 else (math.inf if mo > mn else 0.0)


class DutyCycle:
    # Fresh blocks are few per update (~20 fresh tokens reach the learner between updates), so
    # one score is noisy: the window holds many (scored every update by default) and the
    # thresholds are those that separated a +0.18 tokens-per-block gain (a changed target) from
    # none on a tuning stream.
    def __init__(self, min_share: float, max_share: float, *, window: int = 32, warmup: int = 16,
                 t_idle: float = 1.5, t_full: float = 3.0, hold: int = 4,
                 cold_accepted: float = 0.05) -> None:
        if not 0 < min_share <= max_share <= 1:
            raise ValueError(f"need 0 < min_share <= max_share <= 1 (got {min_share}, {max_share})")
        if window < 6 or warmup < 1 or not t_full > t_idle:
            raise ValueError("need window >= 6, warmup >= 1 and t_full > t_idle")
        self.min_share, self.max_share = min_share, max_share
        self.warmup, self.t_idle, self.t_full, self.hold = warmup, t_idle, t_full, hold
        self.cold_accepted = cold_accepted
        self.scores: deque[GainScore] = deque(maxlen=window)
        self.n = 0
        self.share = max_share
        self.signal = math.nan  # the last t-statistic that set the share
        self._held = 0  # scores left in the current hold
        self.reason = f"warming up (0/{warmup} scores): full share"

    @property
    def mean_gain(self) -> float:
        """Mean gain over the window (accepted draft tokens per block, current minus start
        weights on the same fresh text); NaN before any score."""
        if not self.scores:
            return math.nan
        return sum(s.gain for s in self.scores) / len(self.scores)

    @property
    def gain_t(self) -> float:
        """t-statistic of the window's mean gain against 0 (each score is on its own fresh
        blocks); NaN before 3 scores."""
        return mean_t([s.gain for s in self.scores]) if len(self.scores) >= 3 else math.nan

    def observe(self, score: GainScore) -> float:
        """One scored batch; returns the share to run at from now on."""
        if not (math.isfinite(score.current) and math.isfinite(score.reference)):
            return self.share
        self.scores.append(score)
        self.n += 1
        if self.n < self.warmup:
            self.reason = f"warming up ({self.n}/{self.warmup} scores): full share"
            self.share = self.max_share
            return self.share
        xs = [float(s.update) for s in self.scores]
        gains = [s.gain for s in self.scores]
        ref_mean = sum(s.reference for s in self.scores) / len(self.scores)
        if ref_mean < self.cold_accepted:
            self.share, self.signal, self._held = self.max_share, math.nan, self.hold
            self.reason = (f"cold start (start weights accept {ref_mean:.3f} drafts per block): "
                           f"full share")
            return self.share
        t_level, t_gain = mean_t(gains), slope_t(xs, gains)
        t_drop = drop_t([s.current for s in self.scores])
        t = max(t_level, t_gain, t_drop)
        frac = min(1.0, max(0.0, (t - self.t_idle) / (self.t_full - self.t_idle)))
        target = self.min_share + (self.max_share - self.min_share) * frac
        if target >= self.share:
            self._held = self.hold if frac > 0 else self._held
        elif self._held > 0:  # keep a ramp for `hold` scores
            self._held -= 1
            target = self.share
        self.share, self.signal = target, t
        self.reason = (f"gain {sum(gains) / len(gains):+.3f} tok/block (t {t_level:+.1f}, slope t "
                       f"{t_gain:+.1f}), current acceptance drop t {t_drop:+.1f}: share "
                       f"{self.share:.2f}")
        return self.share
