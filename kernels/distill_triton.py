"""Triton fused LM-head + distillation loss: online softmax over the vocabulary, no ``[N, V]``.

Three kernels, all computing logits tiles with ``tl.dot`` and accumulating in float32:

* ``_stats_kernel`` (pass 1): grid ``(row blocks, vocab splits)``. Each program streams over its
  vocabulary slice tile by tile (and over ``h`` inside a tile) and keeps, per row, online-softmax
  statistics of the drafter logits ``q`` and the target logits ``p``: running max ``m_q`` / ``m_p``
  (which is also the argmax, first index on ties), ``sum exp(q - m_q)``, ``sum exp((q - m_q)/T)``,
  ``sum exp((p - m_p)/T)``, the KL cross term (``sum exp((q-m_q)/T) (q-p)/T`` for reverse KL,
  ``sum exp((p-m_p)/T) (p-q)/T`` for forward KL) and ``q`` at the running target argmax. The
  ``[splits, N]`` partials are merged in PyTorch (a log-sum-exp merge on tiny tensors), which
  gives ``lse(q)``, ``lse(q/T)``, ``lse(p/T)``, ``ce``, ``kl``, the two argmaxes.
* ``_grad_logits_kernel`` (pass 2a): for one vocabulary chunk ``[c0, c0 + CV)`` it recomputes
  the logits tiles and writes ``dL/dq`` for that chunk, ``[N, CV]`` (CV ~ h, never ``V``).
* ``_accum_matmul_kernel`` (pass 2b): ``grad_hd[N, h] += dL/dq[:, chunk] @ w[chunk]``, a
  ``tl.dot`` tiled matmul accumulating into a float32 buffer (each program owns its output tile,
  no atomics, deterministic).

The gradient is produced inside the forward (as in Liger's FLCE); the backward scales it.

Interpreter note: under ``TRITON_INTERPRET=1`` Triton 3.x computes ``tl.dot`` on bfloat16 / float16
operands on their raw bit patterns (triton-lang/triton#11584, "not supported yet"), so the
kernels upcast dot operands to float32 there (``UPCAST``); on a GPU they run natively.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .chunked import GradInForward, miss_emphasis, row_epilogue
from .reference import EPS

_MODE_ID = {"reverse_kl": 0, "forward_kl": 1, "ce": 2}

#: ``tl.dot`` precision for float32 operands ("ieee" = exact fp32; "tf32" is faster but ~1e-3).
FP32_DOT_PRECISION = "ieee"


@triton.jit
def _stats_kernel(
    hd_ptr, ht_ptr, w_ptr, stats_ptr, idx_ptr,
    N, V, H, stride_hd, stride_ht, stride_w, v_per_split, inv_T,
    MODE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_split = tl.num_programs(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)  # 64-bit offsets: V * h or N * h may exceed 2**31
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    lane = tl.arange(0, BLOCK_V)

    m_q = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    m_p = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_q = tl.zeros((BLOCK_N,), tl.float32)  # sum exp(q - m_q)
    s_qT = tl.zeros((BLOCK_N,), tl.float32)  # sum exp((q - m_q) / T)
    s_pT = tl.zeros((BLOCK_N,), tl.float32)  # sum exp((p - m_p) / T)
    r_kl = tl.zeros((BLOCK_N,), tl.float32)  # KL cross term (see module docstring)
    q_t = tl.zeros((BLOCK_N,), tl.float32)  # q at the running target argmax
    t_idx = tl.zeros((BLOCK_N,), tl.int32)
    d_idx = tl.zeros((BLOCK_N,), tl.int32)

    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + lane
        col_ok = cols < v_end
        cols64 = cols.to(tl.int64)
        q = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        p = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < H
            a = tl.load(hd_ptr + rows64[:, None] * stride_hd + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(ht_ptr + rows64[:, None] * stride_ht + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + cols64[:, None] * stride_w + ks[None, :],
                         mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                wt = wt.to(tl.float32)
            wt = tl.trans(wt)
            q = tl.dot(a, wt, q, input_precision=DOT_PREC)
            p = tl.dot(b, wt, p, input_precision=DOT_PREC)
        # out-of-range columns hold q = p = 0 (w loaded as 0); keep those finite values for the
        # KL cross term (multiplied by exp(-inf) = 0 there) and mask with -inf for max / softmax
        if MODE == 0:
            qp = q - p
        elif MODE == 1:
            qp = p - q
        q = tl.where(col_ok[None, :], q, float("-inf"))
        p = tl.where(col_ok[None, :], p, float("-inf"))

        # drafter: max / argmax / sum exp(q - m) / sum exp((q - m)/T)
        tq_max, tq_arg = tl.max(q, axis=1, return_indices=True)
        d_idx = tl.where(tq_max > m_q, v0 + tq_arg, d_idx)
        mq_new = tl.maximum(m_q, tq_max)
        s_q = s_q * tl.exp(m_q - mq_new) + tl.sum(tl.exp(q - mq_new[:, None]), axis=1)
        # target: max / argmax, and q at the argmax
        tp_max, tp_arg = tl.max(p, axis=1, return_indices=True)
        upd = tp_max > m_p
        q_sel = tl.sum(tl.where(lane[None, :] == tp_arg[:, None], q, 0.0), axis=1)
        t_idx = tl.where(upd, v0 + tp_arg, t_idx)
        q_t = tl.where(upd, q_sel, q_t)
        mp_new = tl.maximum(m_p, tp_max)
        if MODE != 2:
            eqT = tl.exp((q - mq_new[:, None]) * inv_T)
            epT = tl.exp((p - mp_new[:, None]) * inv_T)
            sc_q = tl.exp((m_q - mq_new) * inv_T)
            sc_p = tl.exp((m_p - mp_new) * inv_T)
            s_qT = s_qT * sc_q + tl.sum(eqT, axis=1)
            s_pT = s_pT * sc_p + tl.sum(epT, axis=1)
            if MODE == 0:
                r_kl = r_kl * sc_q + tl.sum(eqT * qp, axis=1) * inv_T
            else:
                r_kl = r_kl * sc_p + tl.sum(epT * qp, axis=1) * inv_T
        m_q = mq_new
        m_p = mp_new

    base = pid_s * N + rows
    plane = n_split * N
    tl.store(stats_ptr + 0 * plane + base, m_q, mask=row_ok)
    tl.store(stats_ptr + 1 * plane + base, s_q, mask=row_ok)
    tl.store(stats_ptr + 2 * plane + base, s_qT, mask=row_ok)
    tl.store(stats_ptr + 3 * plane + base, m_p, mask=row_ok)
    tl.store(stats_ptr + 4 * plane + base, s_pT, mask=row_ok)
    tl.store(stats_ptr + 5 * plane + base, r_kl, mask=row_ok)
    tl.store(stats_ptr + 6 * plane + base, q_t, mask=row_ok)
    tl.store(idx_ptr + 0 * plane + base, t_idx, mask=row_ok)
    tl.store(idx_ptr + 1 * plane + base, d_idx, mask=row_ok)


@triton.jit
def _grad_logits_kernel(
    hd_ptr, ht_ptr, w_ptr, g_ptr, rowv_ptr, tgt_ptr,
    N, H, stride_hd, stride_ht, stride_w, stride_g, c0, c_len, inv_T,
    MODE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)  # 64-bit offsets: V * h or N * h may exceed 2**31
    loc = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    col_ok = loc < c_len
    cols = c0 + loc
    cols64 = cols.to(tl.int64)

    q = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    p = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(hd_ptr + rows64[:, None] * stride_hd + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + cols64[:, None] * stride_w + ks[None, :],
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            wt = wt.to(tl.float32)
        wt = tl.trans(wt)
        q = tl.dot(a, wt, q, input_precision=DOT_PREC)
        if MODE != 2:
            b = tl.load(ht_ptr + rows64[:, None] * stride_ht + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                b = b.to(tl.float32)
            p = tl.dot(b, wt, p, input_precision=DOT_PREC)

    # rowv: [6, N] = lse_q, lse_qT, lse_pT, kl, coef_ce, coef_kl
    lse_q = tl.load(rowv_ptr + 0 * N + rows, mask=row_ok, other=0.0)
    c_ce = tl.load(rowv_ptr + 4 * N + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    g = c_ce[:, None] * (tl.exp(q - lse_q[:, None]) - onehot)
    if MODE != 2:
        lse_qT = tl.load(rowv_ptr + 1 * N + rows, mask=row_ok, other=0.0)
        lse_pT = tl.load(rowv_ptr + 2 * N + rows, mask=row_ok, other=0.0)
        c_kl = tl.load(rowv_ptr + 5 * N + rows, mask=row_ok, other=0.0)
        log_a = q * inv_T - lse_qT[:, None]
        log_b = p * inv_T - lse_pT[:, None]
        a_sm = tl.exp(log_a)
        if MODE == 0:
            kl = tl.load(rowv_ptr + 3 * N + rows, mask=row_ok, other=0.0)
            gk = a_sm * (log_a - log_b - kl[:, None])
        else:
            gk = a_sm - tl.exp(log_b)
        g += c_kl[:, None] * gk
    tl.store(g_ptr + rows64[:, None] * stride_g + loc[None, :], g.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _accum_matmul_kernel(
    g_ptr, w_ptr, out_ptr,
    N, H, stride_g, stride_w, stride_out, c0, c_len,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < H
    acc = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
    for k0 in range(0, c_len, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < c_len
        gt = tl.load(g_ptr + rows64[:, None] * stride_g + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + (c0 + ks).to(tl.int64)[:, None] * stride_w + hs[None, :],
                     mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        if UPCAST:
            gt = gt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(gt, wt, acc, input_precision=DOT_PREC)
    optr = out_ptr + rows64[:, None] * stride_out + hs[None, :]
    omask = row_ok[:, None] & h_ok[None, :]
    tl.store(optr, tl.load(optr, mask=omask, other=0.0) + acc, mask=omask)


#: True when the kernels above were built by the Triton interpreter: ``TRITON_INTERPRET=1`` was
#: set when this module was imported (Triton reads it when ``@triton.jit`` decorates a function).
INTERPRETED = not isinstance(_stats_kernel, JITFunction)


def _config(n: int, v: int, h: int, device: torch.device, interp: bool) -> dict:
    """Tile sizes, vocabulary splits of pass 1 and vocabulary chunk of pass 2."""
    if interp:  # the interpreter costs per program and per op: few, mid-sized tiles
        cfg = dict(BLOCK_N=16, BLOCK_V=64, BLOCK_H=32, BLOCK_M=16, BLOCK_HO=32, BLOCK_K=64,
                   num_warps=4, splits=2, chunk=128)
    else:
        cfg = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, BLOCK_M=64, BLOCK_HO=128, BLOCK_K=64,
                   num_warps=8, splits=None, chunk=None)
        if cfg["splits"] is None:  # enough programs to fill the GPU even for small N
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            row_blocks = triton.cdiv(n, cfg["BLOCK_N"])
            cfg["splits"] = max(1, min(triton.cdiv(2 * sms, row_blocks),
                                       triton.cdiv(v, 8 * cfg["BLOCK_V"])))
        if cfg["chunk"] is None:  # dL/dq staging buffer [N, chunk] ~ the size of grad_hd
            cfg["chunk"] = max(4096, h)
    return cfg


def _prepare(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = x.detach()
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def distill_forward_triton(hd, ht, w, pw, *, alpha, temperature, clip, mode, need_grad,
                           chunk_size=None, config=None, miss_weight=0.0):
    """Run the kernels; returns ``(loss, target_ids, draft_ids, grad_hd float32 or None)``."""
    n, h = hd.shape
    v = w.shape[0]
    dev = hd.device
    interp = INTERPRETED
    native = (torch.float32, torch.bfloat16, torch.float16)
    cdt = w.dtype if (hd.dtype == ht.dtype == w.dtype) else torch.float32
    if cdt not in native:
        cdt = torch.float32
    # Mixed dtypes (float32 hidden states, the target's bf16 head): the head is read in place
    # and each tile is cast to float32 inside the kernels (UPCAST), so no float32 copy of the
    # [V, h] head is ever made; only the small [N, h] inputs are converted.
    mixed = cdt == torch.float32 and w.dtype != torch.float32 and w.dtype in native
    hd_, ht_ = _prepare(hd, cdt), _prepare(ht, cdt)
    w_ = _prepare(w, w.dtype if mixed else cdt)
    cfg = _config(n, v, h, dev, interp)
    if config:
        cfg.update(config)
    if chunk_size:
        cfg["chunk"] = int(chunk_size)
    upcast = (interp and cdt != torch.float32) or mixed
    prec = FP32_DOT_PRECISION if (cdt == torch.float32 or upcast) else "tf32"
    if mixed and not interp:
        # tf32 keeps all of a bf16 head's mantissa (10 bits >= 7) and runs on tensor cores;
        # exact float32 ("ieee") dots would cost ~10x for nothing the head could resolve.
        prec = "tf32"
    mode_id = _MODE_ID[mode]
    T = float(temperature)
    inv_T = 1.0 / T
    BN, BV, BH = cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_H"]

    # ---- pass 1: per-row statistics, one partial per vocabulary split
    v_per_split = triton.cdiv(triton.cdiv(v, max(1, int(cfg["splits"]))), BV) * BV
    n_split = triton.cdiv(v, v_per_split)
    stats = torch.empty(7, n_split, n, dtype=torch.float32, device=dev)
    idx = torch.empty(2, n_split, n, dtype=torch.int32, device=dev)
    if n > 0:
        _stats_kernel[(triton.cdiv(n, BN), n_split)](
            hd_, ht_, w_, stats, idx, n, v, h,
            hd_.stride(0), ht_.stride(0), w_.stride(0), v_per_split, inv_T,
            MODE=mode_id, UPCAST=upcast, DOT_PREC=prec,
            BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, num_warps=cfg["num_warps"],
        )
    m_q, s_q, s_qT, m_p, s_pT, r_kl, q_t = stats.unbind(0)

    # ---- merge the splits (log-sum-exp merge on [splits, N])
    Mq, sq_arg = m_q.max(dim=0)  # first maximum -> lowest split -> lowest vocabulary index
    Mp, sp_arg = m_p.max(dim=0)
    draft_ids = idx[1].gather(0, sq_arg[None]).squeeze(0).long()
    tgt_ids = idx[0].gather(0, sp_arg[None]).squeeze(0).long()
    q_at_t = q_t.gather(0, sp_arg[None]).squeeze(0)
    sc_q = torch.exp(m_q - Mq)
    lse_q = Mq + torch.log((s_q * sc_q).sum(0))
    ce = lse_q - q_at_t
    zeros = torch.zeros_like(lse_q)
    lse_qT = lse_pT = kl = zeros
    if mode != "ce":
        scT_q = torch.exp((m_q - Mq) * inv_T)
        scT_p = torch.exp((m_p - Mp) * inv_T)
        SqT = (s_qT * scT_q).sum(0)
        SpT = (s_pT * scT_p).sum(0)
        lse_qT = Mq * inv_T + torch.log(SqT)
        lse_pT = Mp * inv_T + torch.log(SpT)
        if mode == "reverse_kl":
            kl = (r_kl * scT_q).sum(0) / SqT - lse_qT + lse_pT
        else:
            kl = (r_kl * scT_p).sum(0) / SpT - lse_pT + lse_qT

    pwf = pw.detach().float()
    pwn = miss_emphasis(pwf / pwf.sum().clamp_min(EPS), tgt_ids, draft_ids, miss_weight)
    loss, coef_ce, coef_kl = row_epilogue(ce, kl, pwn, alpha=alpha, temperature=T, clip=clip,
                                          mode=mode)
    if not need_grad:
        return loss, tgt_ids, draft_ids, None

    # ---- pass 2: dL/dq chunk by chunk over the vocabulary, grad_hd += dL/dq[:, chunk] @ w[chunk]
    rowv = torch.stack([lse_q, lse_qT, lse_pT, kl, coef_ce,
                        coef_kl if coef_kl is not None else zeros]).contiguous()
    grad_hd = torch.zeros(n, h, dtype=torch.float32, device=dev)
    if n == 0:
        return loss, tgt_ids, draft_ids, grad_hd
    chunk = max(BV, triton.cdiv(min(int(cfg["chunk"]), v), BV) * BV)
    g_buf = torch.empty(n, chunk, dtype=cdt, device=dev)
    BM, BHO, BK = cfg["BLOCK_M"], cfg["BLOCK_HO"], cfg["BLOCK_K"]
    for c0 in range(0, v, chunk):
        c_len = min(chunk, v - c0)
        _grad_logits_kernel[(triton.cdiv(n, BN), triton.cdiv(c_len, BV))](
            hd_, ht_, w_, g_buf, rowv, tgt_ids, n, h,
            hd_.stride(0), ht_.stride(0), w_.stride(0), g_buf.stride(0), c0, c_len, inv_T,
            MODE=mode_id, UPCAST=upcast, DOT_PREC=prec,
            BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, num_warps=cfg["num_warps"],
        )
        _accum_matmul_kernel[(triton.cdiv(n, BM), triton.cdiv(h, BHO))](
            g_buf, w_, grad_hd, n, h, g_buf.stride(0), w_.stride(0), grad_hd.stride(0), c0, c_len,
            UPCAST=upcast, DOT_PREC=prec,
            BLOCK_M=BM, BLOCK_H=BHO, BLOCK_K=BK, num_warps=cfg["num_warps"],
        )
    return loss, tgt_ids, draft_ids, grad_hd


class TritonDistillLoss(GradInForward):
    """``(hd, ht, w, pw, alpha, T, clip, mode, chunk, config, miss_weight) -> (loss, target_ids,
    draft_ids)``."""

    @staticmethod
    def forward(ctx, hd, ht, w, pw, alpha, temperature, clip, mode, chunk_size, config,
                miss_weight=0.0):
        loss, tgt_ids, draft_ids, grad_hd = distill_forward_triton(
            hd, ht, w, pw, alpha=alpha, temperature=temperature, clip=clip, mode=mode,
            need_grad=ctx.needs_input_grad[0], chunk_size=chunk_size, config=config,
            miss_weight=miss_weight,
        )
        GradInForward.stash(ctx, grad_hd, hd, n_inputs=11)
        ctx.mark_non_differentiable(tgt_ids, draft_ids)
        return loss, tgt_ids, draft_ids


def distill_loss_triton(hd, ht, w, pw, *, alpha=0.8, temperature=1.0, clip=None,
                        mode="reverse_kl", chunk_size=None, config=None, miss_weight=0.0):
    """Triton implementation; returns ``(loss, target_ids, draft_ids)`` (arguments unchecked)."""
    return TritonDistillLoss.apply(hd, ht, w, pw, alpha, temperature, clip, mode, chunk_size,
                                   config, miss_weight)
