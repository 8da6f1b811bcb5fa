"""Triton kernels for the learner hot path, each beside its PyTorch reference.

``distill_loss``: fused LM-head + distillation loss of the drafter (see ``kernels/README.md``).
Triton is imported lazily, only when the Triton implementation is used.
"""

from __future__ import annotations

import importlib.util

import torch

from .chunked import distill_loss_chunked
from .reference import EPS, MODES, DistillOutput, distill_loss_reference

__all__ = ["distill_loss", "DistillOutput", "triton_available", "EPS", "MODES"]

_IMPLS = ("auto", "naive", "chunked", "triton")


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def _check(hd, ht, w, pw, alpha, temperature, clip, mode, impl, chunk_size):
    for name, x in (("hd", hd), ("ht", ht), ("w", w), ("pw", pw)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"distill_loss: {name} must be a torch.Tensor, got {type(x).__name__}")
    if hd.dim() != 2 or ht.dim() != 2 or w.dim() != 2 or pw.dim() != 1:
        raise ValueError(f"distill_loss: expected hd [N,h], ht [N,h], w [V,h], pw [N]; got "
                         f"{tuple(hd.shape)}, {tuple(ht.shape)}, {tuple(w.shape)}, {tuple(pw.shape)}")
    if ht.shape != hd.shape or w.shape[1] != hd.shape[1] or pw.shape[0] != hd.shape[0]:
        raise ValueError(f"distill_loss: shape mismatch: hd {tuple(hd.shape)}, ht {tuple(ht.shape)}, "
                         f"w {tuple(w.shape)}, pw {tuple(pw.shape)} (want [N,h], [N,h], [V,h], [N])")
    if w.shape[0] == 0:
        raise ValueError("distill_loss: empty vocabulary (w has 0 rows)")
    if not (hd.is_floating_point() and ht.is_floating_point() and w.is_floating_point()):
        raise ValueError("distill_loss: hd, ht and w must be floating point tensors")
    devs = {x.device for x in (hd, ht, w, pw)}
    if len(devs) != 1:
        raise ValueError(f"distill_loss: all tensors must be on one device, got {sorted(map(str, devs))}")
    if mode not in MODES:
        raise ValueError(f"distill_loss: unknown mode {mode!r}; expected one of {MODES}")
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"distill_loss: alpha must be in [0, 1], got {alpha}")
    if not float(temperature) > 0.0:
        raise ValueError(f"distill_loss: temperature must be > 0, got {temperature}")
    if clip is not None and not float(clip) > 0.0:
        raise ValueError(f"distill_loss: clip must be > 0 or None, got {clip}")
    if impl not in _IMPLS:
        raise ValueError(f"distill_loss: unknown impl {impl!r}; expected one of {_IMPLS}")
    if chunk_size is not None and int(chunk_size) <= 0:
        raise ValueError(f"distill_loss: chunk_size must be a positive int or None, got {chunk_size}")


def distill_loss(
    hd: torch.Tensor,
    ht: torch.Tensor,
    w: torch.Tensor,
    pw: torch.Tensor,
    *,
    alpha: float = 0.8,
    temperature: float = 1.0,
    clip: float | None = None,
    mode: str = "reverse_kl",
    impl: str = "auto",
    chunk_size: int | None = None,
    miss_weight: float = 0.0,
    return_argmax: bool = False,
):
    """Fused LM-head + distillation loss of the drafter against the target.

    Args:
        hd: drafter final hidden states ``[N, h]`` (the only input that gets a gradient).
        ht: target final hidden states ``[N, h]``; w: frozen LM head ``[V, h]``;
        pw: per-position weights ``[N]`` (>= 0, 0 = masked position).
        alpha: weight of the CE-to-target-argmax term (the distillation term gets ``1 - alpha``).
        temperature: ``T`` of the distillation term (scaled by ``T^2``).
        clip: per-position cap on ``T^2 * KL`` (no gradient where active); ``None`` = no cap.
        mode: ``"reverse_kl"`` (KL(q||p)), ``"forward_kl"`` (KL(p||q)) or ``"ce"`` (CE only).
        impl: ``"auto"`` (Triton for CUDA tensors when triton is importable, else chunked),
            ``"naive"``, ``"chunked"`` or ``"triton"``.
        chunk_size: chunked: positions per chunk; triton: vocabulary columns per backward
            chunk; ``None`` = heuristic. Ignored by ``"naive"``.
        miss_weight: extra weight of the positions where the drafter's argmax misses the
            target's: each such row counts ``1 + miss_weight`` times (>= 0; 0 = off). The
            normaliser stays ``sum pw``, and no gradient flows through the argmax.
        return_argmax: also return the target and drafter argmax ids (int64 ``[N]``).

    Returns:
        The float32 scalar loss, or ``DistillOutput(loss, target_ids, draft_ids)``.
    """
    _check(hd, ht, w, pw, alpha, temperature, clip, mode, impl, chunk_size)
    if not miss_weight >= 0:  # NaN too
        raise ValueError(f"distill_loss: miss_weight must be >= 0 (got {miss_weight})")
    miss_weight = float(miss_weight)
    alpha, temperature = float(alpha), float(temperature)
    clip = None if clip is None else float(clip)
    if impl == "auto":
        impl = "triton" if (hd.is_cuda and triton_available()) else "chunked"
    if impl == "naive":
        return distill_loss_reference(hd, ht, w, pw, alpha=alpha, temperature=temperature,
                                      clip=clip, mode=mode, miss_weight=miss_weight,
                                      return_argmax=return_argmax)
    if impl == "chunked":
        loss, tgt, draft = distill_loss_chunked(hd, ht, w, pw, alpha=alpha,
                                                temperature=temperature, clip=clip, mode=mode,
                                                chunk_size=chunk_size, miss_weight=miss_weight)
    else:
        if not triton_available():
            raise ValueError("distill_loss: impl='triton' but triton is not installed")
        from . import distill_triton

        if not hd.is_cuda and not distill_triton.INTERPRETED:
            raise ValueError("distill_loss: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 "
                             "when vllm_onlinespec.kernels.distill_triton is first imported)")
        distill_loss_triton = distill_triton.distill_loss_triton

        loss, tgt, draft = distill_loss_triton(hd, ht, w, pw, alpha=alpha,
                                               temperature=temperature, clip=clip, mode=mode,
                                               chunk_size=chunk_size, miss_weight=miss_weight)
    if return_argmax:
        return DistillOutput(loss, tgt, draft)
    return loss
