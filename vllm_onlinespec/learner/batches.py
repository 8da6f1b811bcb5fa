"""Feedback windows -> one padded training batch of blocks that cover the fresh tokens.

A block anchored at window index a predicts tokens a+1..a+K from context rows < a; its targets
are the target's final hidden states at a..a+K-1. The buffer hands out, per request, a range of
fresh tokens (trainable: after the first generated token, see buffer.py) of at most
anchors_per_request * K tokens, and marks exactly that range trained; the anchors here tile it,
a_j = fresh_from - 1 + j*K, so every token marked trained is the label of exactly one block of
this batch (the last block's labels may run on into held-back tokens, which stay fresh and are
labelled again later). Every anchor is a generated token: prompt positions are context only,
as in the offline trainer (training.blocks.response_mask).

Two ways to learn more per fresh token, for a learner with CPU to spare (it is data-starved
beside serving: ~20 fresh tokens reach it between updates, 4-5 blocks at stride K):
  anchor_stride < K   blocks overlap, so a fresh token is also a label at draft positions other
                      than its own block's (stride 1: at every position 1..K, K blocks per K
                      tokens). The fresh range a request hands out shrinks to
                      anchors_per_request * stride tokens, all of them labels of this batch.
  replay              the batch is filled up to batch_blocks with blocks anchored on tokens the
                      learner trained on before, drawn uniformly from the same windows' response
                      (recent context of requests that brought fresh tokens: replay of recent
                      windows, without a second store).
"""

from __future__ import annotations

import dataclasses

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
    # The same anchors with the replayed ones set to -1 (None: nothing replayed): blocks the
    # learner has not trained on yet, what the gain score measures on (learner/duty_cycle.py).
    fresh_anchors: torch.Tensor | None = None

    def fresh_only(self) -> "BlockBatch":
        """This batch restricted to its fresh blocks."""
        if self.fresh_anchors is None:
            return self
        return dataclasses.replace(self, anchors=self.fresh_anchors, fresh_anchors=None)


def _first_anchor(w: TrainingWindow) -> int:
    # Anchors sit on generated tokens with a context row before them. The buffer hands out
    # trainable tokens only, so these clamps never bind for its fresh ranges; they keep
    # hand-made windows honest and bound replay to the response.
    return max(CONTEXT_ROWS, w.response_from - w.start_pos)


def pick_anchors(w: TrainingWindow, max_anchors: int, stride: int) -> list[int]:
    """Anchors every `stride` rows from the one whose first label is w's first fresh token.

    With stride = K the blocks tile the fresh range; covers all of it when fresh_to -
    fresh_from <= max_anchors * stride (what BlockBatcher asks the buffer for); otherwise the
    first max_anchors * stride tokens."""
    T = int(w.token_ids.shape[0])
    first = max(w.fresh_from - 1, _first_anchor(w))
    stop = min(w.fresh_to, T) - 2  # the last anchor whose first label is still fresh
    return list(range(first, stop + 1, stride))[:max_anchors]


def replay_anchors(w: TrainingWindow, n: int, gen: torch.Generator) -> list[int]:
    """Up to n distinct anchors drawn uniformly from w's already-trained response tokens (the
    rows before the first fresh anchor), sorted."""
    lo, hi = _first_anchor(w), min(w.fresh_from - 1, int(w.token_ids.shape[0]) - 1)
    if n <= 0 or hi <= lo:
        return []
    idx = torch.randperm(hi - lo, generator=gen)[:n] + lo
    return sorted(idx.tolist())


def windows_to_batch(windows: list[TrainingWindow], max_anchors: int, stride: int,
                     replay_to: int = 0, gen: torch.Generator | None = None
                     ) -> BlockBatch | None:
    """One batch from the fresh ranges of `windows` (anchors every `stride` rows, at most
    max_anchors per window); replay_to > 0 fills it up to that many blocks with replayed
    anchors, spread evenly over the windows. A batch without a fresh block is None: replay only
    ever rides along with new data."""
    windows = [w for w in windows if w.target_hidden is not None and w.num_fresh > 0]
    picked = [(w, pick_anchors(w, max_anchors, stride)) for w in windows]
    picked = [(w, a) for w, a in picked if a]
    if not picked:
        return None
    spare = replay_to - sum(len(a) for _, a in picked)
    replayed = [0] * len(picked)
    if spare > 0:
        gen = gen if gen is not None else torch.Generator().manual_seed(0)
        per_window = -(-spare // len(picked))
        extra = [replay_anchors(w, per_window, gen) for w, _ in picked]
        replayed = [len(r) for r in extra]
        picked = [(w, r + a) for (w, a), r in zip(picked, extra)]
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
    fresh = None
    if any(replayed):  # replayed anchors come first in each row
        fresh = anchors.clone()
        for b, r in enumerate(replayed):
            fresh[b, :r] = -1
    return BlockBatch(ids, aux, fin, lengths, anchors, sum(w.num_fresh for w, _ in picked),
                      fresh_anchors=fresh)


@dataclass
class BlockBatcher:
    """A `make_batch(buffer)` for OnlineLearner: up to ~batch_blocks blocks from fresh feedback.

    holdback: newest tokens of each running request left fresh (the block size K, so a block
    anchored before them sees all its labels); OnlineLearner reads it for its ready gate."""

    batch_blocks: int
    anchors_per_request: int
    holdback: int
    block_size: int  # labels per block (K)
    stride: int | None = None  # rows between fresh anchors (None = block_size: tiling)
    replay: bool = False  # fill batches up to batch_blocks with replayed blocks
    seed: int = 0  # of the replay draws

    def __post_init__(self) -> None:
        if self.stride is None:
            self.stride = self.block_size
        if not 1 <= self.stride <= self.block_size:
            raise ValueError(f"onlinespec: anchor_stride must be in [1, {self.block_size}] "
                             f"(num_speculative_tokens), got {self.stride}: a larger one "
                             "leaves fresh tokens that no block labels")
        self._gen = torch.Generator().manual_seed(self.seed)

    def __call__(self, buffer: FeedbackBuffer) -> BlockBatch | None:
        max_windows = max(1, -(-self.batch_blocks // self.anchors_per_request))
        # Take from each request only what its anchors will cover: the rest stays fresh.
        windows = buffer.sample_training_windows(
            max_windows, min_fresh=1, holdback=self.holdback,
            max_fresh=self.anchors_per_request * self.stride)
        return windows_to_batch(windows, self.anchors_per_request, self.stride,
                                self.batch_blocks if self.replay else 0, self._gen)


def make_batch_fn(batch_blocks: int, anchors_per_request: int, holdback: int, seed: int = 0,
                  block_size: int | None = None, stride: int | None = None,
                  replay: bool = False) -> BlockBatcher:
    """BlockBatcher; block_size defaults to holdback (K), stride to block_size."""
    return BlockBatcher(batch_blocks, anchors_per_request, holdback,
                        block_size if block_size is not None else max(1, holdback),
                        stride, replay, seed)
