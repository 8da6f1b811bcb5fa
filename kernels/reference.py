"""Naive PyTorch reference of the fused LM-head + distillation loss (the ground truth).

It materialises the full ``[N, V]`` logits of the drafter and the target, in float32, and lets
autograd produce the gradient. Use it for tests and for small problems only: its memory grows like
``N * V * 4`` bytes times the number of live ``[N, V]`` temporaries (about ten of them).

Definition (implemented exactly; see ``kernels/README.md``)::

    q = hd @ w.T                 drafter logits  [N, V] (float32, differentiable in hd)
    p = ht @ w.T                 target logits   [N, V] (float32, no grad)
    t_i   = argmax_j p_ij        target argmax (first maximum on ties)
    ce_i  = -log softmax(q_i)[t_i]
    kl_i  = KL(softmax(q_i/T) || softmax(p_i/T))      mode "reverse_kl"
          = KL(softmax(p_i/T) || softmax(q_i/T))      mode "forward_kl"
    d_i   = min(T^2 * kl_i, clip)                     (no min when clip is None)
    l_i   = alpha * ce_i + (1 - alpha) * d_i          (mode "ce": l_i = ce_i)
    m_i   = 1 + miss_weight * [argmax_j q_ij != t_i]  emphasis on positions the drafter gets wrong
    loss  = sum_i pw_i * m_i * l_i / max(sum_i pw_i, eps)

``m_i`` is a constant (no gradient flows through the argmax), and the normaliser stays
``sum_i pw_i``: with ``miss_weight`` > 0 a batch the drafter gets more wrong weighs more, as
training on rejected positions does (OSD, Liu et al. 2023).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: Floor of the normaliser ``sum_i pw_i``: an all-masked batch gives loss 0 and zero gradient.
EPS = 1e-8

MODES = ("reverse_kl", "forward_kl", "ce")


class DistillOutput(NamedTuple):
    """What ``distill_loss(..., return_argmax=True)`` returns."""

    loss: torch.Tensor  #: float32 scalar
    target_ids: torch.Tensor  #: int64 [N], argmax of the target logits
    draft_ids: torch.Tensor  #: int64 [N], argmax of the drafter logits


def distill_loss_reference(
    hd: torch.Tensor,
    ht: torch.Tensor,
    w: torch.Tensor,
    pw: torch.Tensor,
    *,
    alpha: float = 0.8,
    temperature: float = 1.0,
    clip: float | None = None,
    mode: str = "reverse_kl",
    miss_weight: float = 0.0,
    return_argmax: bool = False,
):
    """Naive reference; arguments as :func:`vllm_onlinespec.kernels.distill_loss` (unchecked)."""
    T = float(temperature)
    wf = w.detach().float()
    q = hd.float() @ wf.T
    p = ht.detach().float() @ wf.T
    tgt = p.argmax(dim=-1)
    ce = -torch.log_softmax(q, dim=-1).gather(1, tgt[:, None]).squeeze(1)
    if mode == "ce":
        per_pos = ce
    else:
        lq = torch.log_softmax(q / T, dim=-1)
        lp = torch.log_softmax(p / T, dim=-1)
        if mode == "reverse_kl":
            kl = (lq.exp() * (lq - lp)).sum(dim=-1)
        elif mode == "forward_kl":
            kl = (lp.exp() * (lp - lq)).sum(dim=-1)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        d = (T * T) * kl
        if clip is not None:
            d = torch.clamp(d, max=float(clip))  # gradient 0 where the clip is active (d > clip)
        per_pos = alpha * ce + (1.0 - alpha) * d
    pwf = pw.detach().float()
    draft = q.detach().argmax(dim=-1)
    m = 1.0 + float(miss_weight) * (draft != tgt).float()
    loss = (pwf * m * per_pos).sum() / pwf.sum().clamp_min(EPS)
    if return_argmax:
        return DistillOutput(loss, tgt, draft)
    return loss
