"""Feedback windows -> one padded training batch of blocks anchored on fresh tokens.

A block anchored at window index a predicts tokens a+1..a+K from context rows < a; its targets
are the target's final hidden states at a..a+K-1. Anchors are drawn so that the predicted
tokens are fresh (committed since the last update): the learner trains on what it has not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffer import FeedbackBuffer, TrainingWindow


@dataclass
class BlockBatch:
    ids: torch.Tensor  # [B, T] (padded with 0)
    aux: torch.Tensor  # [B, T, F]
    final_hidden: torch.Tensor  # [B, T, H]
    lengths: torch.Tensor  # [B] valid rows per window
    anchors: torch.Tensor  # [B, A] window indices, -1 = unused
    num_fresh: int  # fresh tokens these windows brought


def pick_anchors(w: TrainingWindow, max_anchors: int, gen: torch.Generator) -> list[int]:
    T = int(w.token_ids.shape[0])
    lo = max(1, w.fresh_from - 1)  # need >= 1 context row; first fresh label at fresh_from
    hi = min(w.fresh_to - 1, T - 2)  # at least one label inside the window
    if hi < lo:
        return []
    cand = torch.arange(lo, hi + 1)
    if cand.numel() > max_anchors:
        cand = cand[torch.randperm(cand.numel(), generator=gen)[:max_anchors]].sort().values
    return cand.tolist()


def windows_to_batch(windows: list[TrainingWindow], max_anchors: int,
                     gen: torch.Generator) -> BlockBatch | None:
    windows = [w for w in windows if w.target_hidden is not None]
    picked = [(w, pick_anchors(w, max_anchors, gen)) for w in windows]
    picked = [(w, a) for w, a in picked if a]
    if not picked:
        return None
    B = len(picked)
    T = max(int(w.token_ids.shape[0]) for w, _ in picked)
    A = max(len(a) for _, a in picked)
    F, H = picked[0][0].aux.shape[1], picked[0][0].target_hidden.shape[1]
    dtype = picked[0][0].aux.dtype
    ids = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, F, dtype=dtype)
    fin = torch.zeros(B, T, H, dtype=dtype)
    anchors = torch.full((B, A), -1, dtype=torch.long)
    lengths = torch.zeros(B, dtype=torch.long)
    for b, (w, a) in enumerate(picked):
        n = int(w.token_ids.shape[0])
        ids[b, :n], aux[b, :n], fin[b, :n] = w.token_ids, w.aux, w.target_hidden
        lengths[b] = n
        anchors[b, : len(a)] = torch.tensor(a)
    return BlockBatch(ids, aux, fin, lengths, anchors, sum(w.num_fresh for w, _ in picked))


def make_batch_fn(batch_blocks: int, anchors_per_request: int, holdback: int, seed: int = 0):
    """A `make_batch(buffer)` for OnlineLearner: up to batch_blocks blocks from fresh feedback."""
    gen = torch.Generator().manual_seed(seed)

    def make_batch(buffer: FeedbackBuffer) -> BlockBatch | None:
        max_windows = max(1, -(-batch_blocks // anchors_per_request))
        windows = buffer.sample_training_windows(max_windows, min_fresh=1, holdback=holdback)
        return windows_to_batch(windows, anchors_per_request, gen)

    return make_batch
