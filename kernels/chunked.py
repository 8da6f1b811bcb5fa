"""Chunked pure-PyTorch fused LM-head + distillation loss (the CPU / no-Triton path).

In the style of Liger-Kernel's fused linear cross-entropy: the forward walks over chunks of
positions, materialises the ``[chunk, V]`` logits of that chunk only, computes the loss *and* the
gradient ``d loss / d hd`` for the chunk right away, and keeps nothing but ``grad_hd [N, h]``
(float32) for the backward, which only scales it by the incoming gradient. Peak extra memory is
``O(chunk * V + N * h)`` instead of the naive ``O(N * V)``.

The per-position gradient of the logits (``Z = max(sum pw, eps)``, ``a = softmax(q/T)``,
``b = softmax(p/T)``, ``s = softmax(q)``, ``e_t`` the one-hot of the target argmax)::

    dL/dq_i = pw_i / Z * [ alpha * (s_i - e_t)  +  (1 - alpha) * [d_i not clipped] * T * g_i ]
    g_i     = a_i * (log a_i - log b_i - kl_i)        reverse_kl
    g_i     = a_i - b_i                               forward_kl

(mode "ce" uses alpha = 1 and no KL term), and ``grad_hd = dL/dq @ w``.
"""

from __future__ import annotations

import math

import torch

from .reference import EPS


#: Floor of the per-chunk ``[chunk, V]`` float32 tensor size used by :func:`default_chunk_size`.
CHUNK_BUDGET_BYTES = 32 * 2**20


def default_chunk_size(n: int, h: int, v: int) -> int:
    """Positions per chunk (a power of two, at most ``n``).

    Liger's rule (``chunk * V ~ N * h``), but never below the rows of a 32 MiB ``[chunk, V]``
    float32 tensor (nor below 16): thinner chunks make every chunk's two ``[chunk, h] x [h, V]``
    and one ``[chunk, V] x [V, h]`` matmul re-read the whole head, which on a CPU made N=1024,
    V=49152 about 3x slower with 16-row chunks than with 128-row chunks.
    """
    inc = max(1, math.ceil(v / max(h, 1)))
    c = max(1, math.ceil(n / inc))
    c = 1 << (c - 1).bit_length()
    budget_rows = max(1, CHUNK_BUDGET_BYTES // (4 * max(v, 1)))
    budget_rows = 1 << (budget_rows.bit_length() - 1)  # power of two below the budget
    return max(1, min(n, max(16, c, budget_rows)))


#: Size of one float32 slice of the head cast at a time when the head is not float32.
HEAD_SLICE_BYTES = 8 * 2**20


def head_slice_rows(w: torch.Tensor) -> int:
    """Vocabulary rows per float32 slice of a non-float32 head (all of it for a float32 one)."""
    if w.dtype == torch.float32:
        return max(1, w.shape[0])
    return max(1, HEAD_SLICE_BYTES // (4 * max(1, w.shape[1])))


def logits_f32(x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """``x.float() @ w.T`` in float32 without a float32 copy of the whole head: a bf16 head
    (the target's own, used in place) is cast one vocabulary slice of ``rows`` rows at a time."""
    x = x.float()
    if w.dtype == torch.float32:
        return x @ w.T
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for v0 in range(0, w.shape[0], rows):
        out[:, v0:v0 + rows] = x @ w[v0:v0 + rows].float().T
    return out


def grad_f32(g: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """``g @ w`` (g float32 ``[n, V]``) in float32, casting a non-float32 head slice by slice."""
    if w.dtype == torch.float32:
        return g @ w
    out = torch.zeros(g.shape[0], w.shape[1], dtype=torch.float32, device=g.device)
    for v0 in range(0, w.shape[0], rows):
        out.addmm_(g[:, v0:v0 + rows], w[v0:v0 + rows].float())
    return out


def row_epilogue(ce, kl, pw, *, alpha, temperature, clip, mode):
    """Per-position combination shared by the chunked and the Triton paths.

    ``ce`` and ``kl`` are float32 ``[n]`` (``kl`` ignored for mode "ce"), ``pw`` float32 ``[n]``
    already divided by ``Z``. Returns ``(loss_sum, coef_ce, coef_kl)`` where ``loss_sum`` is the
    contribution ``sum_i pw_i/Z * l_i`` and the coefficients multiply, per row, ``(s - e_t)`` and
    ``g`` in the gradient of the logits (``coef_kl`` already holds the factor ``T`` and is 0 where
    the clip is active; it is ``None`` for mode "ce").
    """
    if mode == "ce":
        return (pw * ce).sum(), pw, None
    T = float(temperature)
    d = (T * T) * kl
    coef_kl = pw * ((1.0 - alpha) * T)
    if clip is not None:
        active = d > clip  # torch.clamp(max=clip) passes the gradient at equality
        d = torch.where(active, torch.full_like(d, float(clip)), d)
        coef_kl = torch.where(active, torch.zeros_like(coef_kl), coef_kl)
    per_pos = alpha * ce + (1.0 - alpha) * d
    return (pw * per_pos).sum(), pw * alpha, coef_kl


class GradInForward(torch.autograd.Function):
    """Base for Functions that compute d loss / d hd during the forward and stash only that
    [N, h] tensor (Liger's FLCE trick): backward just scales it by the incoming gradient."""

    @staticmethod
    def stash(ctx, grad_hd: torch.Tensor | None, hd: torch.Tensor, n_inputs: int) -> None:
        ctx.save_for_backward(grad_hd)
        ctx.hd_dtype = hd.dtype
        ctx.n_inputs = n_inputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _g_tgt, _g_draft):
        (grad_hd,) = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0]:
            grad = (grad_hd * grad_loss).to(ctx.hd_dtype)
        return (grad,) + (None,) * (ctx.n_inputs - 1)


def miss_emphasis(pwn, target_ids, draft_ids, miss_weight: float):
    """pwn * (1 + miss_weight) where the drafter's argmax misses the target's (reference.py:
    m_i), shared by the chunked and the Triton paths; pwn itself where miss_weight is 0."""
    if not miss_weight:
        return pwn
    return pwn * (1.0 + miss_weight * (draft_ids != target_ids).to(pwn.dtype))


class ChunkedDistillLoss(GradInForward):
    """``(hd, ht, w, pw, alpha, T, clip, mode, chunk, miss_weight) -> (loss, target_ids,
    draft_ids)``."""

    @staticmethod
    def forward(ctx, hd, ht, w, pw, alpha, temperature, clip, mode, chunk_size, miss_weight=0.0):
        n, h = hd.shape
        v = w.shape[0]
        T = float(temperature)
        need_grad = ctx.needs_input_grad[0]
        # The head is read in place: a non-float32 one (the target's bf16 LM head) is cast per
        # vocabulary slice inside logits_f32/grad_f32, never copied whole.
        wf = w.detach()
        rows = head_slice_rows(wf)
        pwf = pw.detach().float()
        pwn = pwf / pwf.sum().clamp_min(EPS)
        c = int(chunk_size) if chunk_size else default_chunk_size(n, h, v)
        dev = hd.device
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        tgt_ids = torch.empty(n, dtype=torch.long, device=dev)
        draft_ids = torch.empty(n, dtype=torch.long, device=dev)
        grad_hd = torch.empty(n, h, dtype=torch.float32, device=dev) if need_grad else None

        for s in range(0, n, c):
            e = min(s + c, n)
            q = logits_f32(hd[s:e].detach(), wf, rows)  # [c, V]
            p = logits_f32(ht[s:e].detach(), wf, rows)
            t = p.argmax(dim=-1)
            tgt_ids[s:e] = t
            draft_ids[s:e] = q.argmax(dim=-1)
            pw_c = miss_emphasis(pwn[s:e], t, draft_ids[s:e], miss_weight)
            lse_q = torch.logsumexp(q, dim=-1)
            ce = lse_q - q.gather(1, t[:, None]).squeeze(1)
            kl = gk = None
            if mode != "ce":
                lqT = torch.log_softmax(q / T if T != 1.0 else q, dim=-1)
                lpT = torch.log_softmax(p.div_(T) if T != 1.0 else p, dim=-1)
                del p
                if mode == "reverse_kl":
                    a = lqT.exp()
                    gk = lqT.sub_(lpT)  # log a - log b, in place
                    kl = (a * gk).sum(dim=-1)
                    if need_grad:
                        gk.sub_(kl[:, None]).mul_(a)
                    del a
                else:  # forward_kl
                    b = lpT.exp()
                    kl = (b * (lpT - lqT)).sum(dim=-1)
                    del lpT
                    gk = lqT.exp_().sub_(b) if need_grad else None
                    del b
                del lqT
            part, coef_ce, coef_kl = row_epilogue(
                ce, kl, pw_c, alpha=alpha, temperature=T, clip=clip, mode=mode
            )
            loss += part
            if need_grad:
                g = q.sub_(lse_q[:, None]).exp_()  # softmax(q), in place of q
                g.scatter_add_(1, t[:, None], torch.full_like(ce[:, None], -1.0))
                g.mul_(coef_ce[:, None])
                if gk is not None:
                    g.add_(gk.mul_(coef_kl[:, None]))
                grad_hd[s:e] = grad_f32(g, wf, rows)
            del q, gk

        GradInForward.stash(ctx, grad_hd, hd, n_inputs=10)
        ctx.mark_non_differentiable(tgt_ids, draft_ids)
        return loss, tgt_ids, draft_ids


def distill_loss_chunked(
    hd, ht, w, pw, *, alpha=0.8, temperature=1.0, clip=None, mode="reverse_kl", chunk_size=None,
    miss_weight=0.0
):
    """Chunked implementation; returns ``(loss, target_ids, draft_ids)`` (arguments unchecked)."""
    return ChunkedDistillLoss.apply(hd, ht, w, pw, alpha, temperature, clip, mode, chunk_size,
                                    miss_weight)
