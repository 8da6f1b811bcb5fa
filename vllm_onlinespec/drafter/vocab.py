"""A subset of the target's vocabulary with its LM-head rows: the drafter's reduced draft
vocabulary (served) and the training loss's projection (trained), one type for both.

vLLM 0.32 serves a DFlash drafter with a reduced vocabulary when its config.json has
`draft_vocab_size` and its checkpoint holds `lm_head.weight` [draft_vocab_size, H] and `d2t`
[draft_vocab_size] int64 (qwen3_dflash): draft token i is target token i + d2t[i] (EAGLE-3's
offsets), and the drafter's logits over the subset are scattered into the target's vocabulary
with -inf elsewhere, so its argmax is always a subset token. The drafter's head is then a
[Vd, H] matmul instead of the target's [V, H]: most of a small drafter's serving cost.

Why one type: the rows the drafter is trained against must be the rows it serves with, or
train != serve. The offline trainer projects its loss onto the subset, exports it as d2t, and
the online learner projects onto the checkpoint's subset again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftVocab:
    """LM-head rows of a sorted subset of the target's token ids."""

    ids: Tensor  # [S] int64, ascending, unique target token ids
    weight: Tensor  # [S, H] the LM-head rows of those tokens

    @classmethod
    def of(cls, lm_head_w: Tensor, ids: Tensor) -> "DraftVocab":
        """The rows of `lm_head_w` [V, H] at `ids` (any order, repeats allowed)."""
        ids = torch.unique(ids.long().flatten())  # sorted, deduplicated
        if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= lm_head_w.shape[0]:
            raise ValueError(f"loss vocabulary ids must lie in [0, {lm_head_w.shape[0]})")
        return cls(ids=ids, weight=lm_head_w.detach()[ids].contiguous())

    @classmethod
    def most_frequent(cls, lm_head_w: Tensor, counts: Tensor, size: int,
                      always: Tensor | None = None) -> "DraftVocab":
        """The `size` tokens with the highest `counts` [V] (ties: lower id), plus `always`
        (e.g. special tokens) within the same size."""
        if not 1 <= size <= lm_head_w.shape[0]:
            raise ValueError(f"draft vocabulary size must be in [1, {lm_head_w.shape[0]}] "
                             f"(got {size})")
        score = counts.double().clone()
        if always is not None and always.numel():
            score[always.long()] = float("inf")
        top = torch.sort(score, descending=True, stable=True).indices[:size]
        return cls.of(lm_head_w, top)

    @classmethod
    def from_d2t(cls, d2t: Tensor, weight: Tensor, vocab_size: int, where: str = "d2t"
                 ) -> "DraftVocab":
        """vLLM's checkpoint form back to token ids; a bad d2t fails in one line naming it."""
        if d2t.dim() != 1 or d2t.shape[0] != weight.shape[0]:
            raise ValueError(f"{where}: d2t has shape {list(d2t.shape)}, lm_head.weight has "
                             f"{weight.shape[0]} rows; both must be draft_vocab_size")
        if d2t.dtype.is_floating_point:
            raise ValueError(f"{where}: d2t must hold integer offsets (got {d2t.dtype})")
        ids = torch.arange(d2t.shape[0], dtype=torch.long) + d2t.long().cpu()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary "
                             f"[0, {vocab_size})")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"{where}: d2t must map draft ids to distinct, ascending target ids")
        return cls(ids=ids.to(weight.device), weight=weight)

    def d2t(self) -> Tensor:
        """vLLM's offsets: target id = draft id + d2t[draft id]."""
        return self.ids - torch.arange(len(self), dtype=torch.long, device=self.ids.device)

    def __len__(self) -> int:
        return int(self.ids.numel())

    def index_of(self, token_ids: Tensor) -> Tensor:
        """Each token's position in the subset, -1 where it is not in it."""
        pos = torch.searchsorted(self.ids, token_ids).clamp(max=len(self) - 1)
        return torch.where(self.ids[pos] == token_ids, pos, torch.full_like(pos, -1))

    def full_logits(self, hidden: Tensor, vocab_size: int) -> Tensor:
        """Logits over the whole target vocabulary, -inf outside the subset (what vLLM's
        compute_logits returns for a reduced-vocabulary drafter)."""
        sub = hidden @ self.weight.T.to(hidden.dtype)
        out = sub.new_full((*sub.shape[:-1], vocab_size), float("-inf"))
        out[..., self.ids] = sub
        return out

    def to(self, device=None, dtype=None) -> "DraftVocab":
        return DraftVocab(ids=self.ids.to(device) if device is not None else self.ids,
                          weight=self.weight.to(device=device, dtype=dtype))
