"""AdaFlash length head: predicts from a drafted block's hidden states how much of it the target
will accept, so the serving layer can cut drafts that would be rejected anyway."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LengthHead(nn.Module):
    """[..., K, H] drafter hidden states -> [...] predicted accepted fraction of the block in (0, 1).

    Input is concat(mean over the block, last row): the mean summarises how confident the whole
    block is, the last row carries what the drafter still knows at the far end.
    """

    def __init__(self, hidden_size: int, width: int = 256) -> None:
        super().__init__()
        self.hidden_size, self.width = hidden_size, width
        self.inp = nn.Linear(2 * hidden_size, width)
        self.res = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, h: Tensor) -> Tensor:
        x = torch.cat([h.mean(dim=-2), h[..., -1, :]], dim=-1).to(self.inp.weight.dtype)
        z = F.silu(self.inp(x))
        z = z + F.silu(self.res(z))
        return torch.sigmoid(self.out(z)).squeeze(-1)


def length_label(accepted: Tensor, block_size: int) -> Tensor:
    """Target of the head: tokens one verify step yields (accepted drafts + the bonus) / block."""
    return ((accepted.float() + 1) / block_size).clamp(0, 1)


def length_loss(pred: Tensor, accepted: Tensor, block_size: int, mask: Tensor | None = None) -> Tensor:
    """MSE between predicted and observed fraction; `mask` selects the rows that count."""
    err = (pred.float() - length_label(accepted, block_size)).pow(2)
    if mask is None:
        return err.mean()
    mask = mask.to(err.dtype)
    return (err * mask).sum() / mask.sum().clamp(min=1)


def accepted_length(draft_tokens: Tensor, target_tokens: Tensor) -> Tensor:
    """Greedy acceptance: number of leading draft tokens equal to the target's, [...].

    draft_tokens [..., K]; target_tokens [..., >=K] where target_tokens[..., k] is the target's
    choice at draft position k (a trailing bonus column is ignored).
    """
    k = draft_tokens.shape[-1]
    match = (draft_tokens == target_tokens[..., :k]).to(torch.int64)
    return match.cumprod(dim=-1).sum(dim=-1)
