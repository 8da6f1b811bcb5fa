"""Feedback windows -> one padded training batch of blocks that cover the fresh tokens.

A block anchored at window index a predicts tokens a+1..a+K from context rows < a; its targets
are the target's final hidden states at a..a+K-1. The buffer hands out, per request, a range of
fresh tokens (trainable: after the first generated token, see buffer.py) of at most
anchors_per_request * K tokens, and marks exactly that range trained; the anchors here tile it,
a_j = fresh_from - 1 + j*K, so every token marked trained is the label of exactly one block of
this batch (the last block's labels may run on into held-back tokens, which stay fresh and are
labelled again later). Every anchor is a generated token: prompt positions are context only,
as in the offline trainer (training.blocks.response_mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffer import CONTEXT_ROWS, FeedbackBuffer, TrainingWindow


@dataclass
class BlockBatch:
    ids: torch.Tensor  # [B, T] (padded with 0)
    aux: torch.Tensor  # [B, T, F]
    final_hidden: torch.Tensor  # [B, T, H]
    lengths: torch.Tensor  # [B] valid rows per window
    anchors: torch.Tensor  # [B, A] window indices, -1 = unused
    num_fresh: int  # fresh tokens these windows brought (all of them are labels here)


def pick_anchors(w: TrainingWindow, max_anchors: int, block_size: int) -> list[int]:
    """Anchors whose blocks of `block_size` labels tile w's fresh range from its start.

    Covers all of it when fresh_to - fresh_from <= max_anchors * block_size (what
    BlockBatcher asks the buffer for); otherwise the first max_anchors * block_size tokens."""
    T = int(w.token_ids.shape[0])
    # The anchor whose first label is the first fresh token. The buffer hands out trainable
    # tokens only, so the clamps (a context row; anchors on generated tokens) never bind for
    # its windows; they keep hand-made windows honest.
    first = max(w.fresh_from - 1, CONTEXT_ROWS, w.response_from - w.start_pos)
    stop = min(w.fresh_to, T) - 2  # the last anchor whose first label is still fresh
    return list(range(first, stop + 1, block_size))[:max_anchors]


def windows_to_batch(windows: list[TrainingWindow], max_anchors: int,
                     block_size: int) -> BlockBatch | None:
    windows = [w for w in windows if w.target_hidden is not None and w.num_fresh > 0]
    picked = [(w, pick_anchors(w, max_anchors, block_size)) for w in windows]
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


@dataclass
class BlockBatcher:
    """A `make_batch(buffer)` for OnlineLearner: up to ~batch_blocks blocks from fresh feedback.

    holdback: newest tokens of each running request left fresh (the block size K, so a block
    anchored before them sees all its labels); OnlineLearner reads it for its ready gate."""

    batch_blocks: int
    anchors_per_request: int
    holdback: int
    block_size: int  # labels per block (K)

    def __call__(self, buffer: FeedbackBuffer) -> BlockBatch | None:
        max_windows = max(1, -(-self.batch_blocks // self.anchors_per_request))
        # Take from each request only what its anchors will cover: the rest stays fresh.
        windows = buffer.sample_training_windows(
            max_windows, min_fresh=1, holdback=self.holdback,
            max_fresh=self.anchors_per_request * self.block_size)
        return windows_to_batch(windows, self.anchors_per_request, self.block_size)


def make_batch_fn(batch_blocks: int, anchors_per_request: int, holdback: int, seed: int = 0,
                  block_size: int | None = None) -> BlockBatcher:
    """BlockBatcher; block_size defaults to holdback (K). `seed` is accepted for old callers:
    anchors are no longer random (they tile the fresh tokens)."""
    del seed
    return BlockBatcher(batch_blocks, anchors_per_request, holdback,
                        block_size if block_size is not None else max(1, holdback))
