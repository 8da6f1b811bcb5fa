"""Fused LM-head + distillation loss: chunked and Triton implementations against the reference.

Without CUDA the Triton kernels run under the Triton interpreter: the module-scoped fixture below
sets ``TRITON_INTERPRET=1`` before ``vllm_onlinespec.kernels.distill_triton`` (the only importer
of triton here, loaded lazily) is imported, and restores the variable after this module, so that
other test modules (and the processes they start) never see it. With CUDA the same tests run the
compiled kernels on the GPU.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from vllm_onlinespec.kernels import DistillOutput, distill_loss, triton_available

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
MODES = ("reverse_kl", "forward_kl", "ce")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


@pytest.fixture(scope="module", autouse=True)
def _triton_interpreter_without_cuda():
    if CUDA or not triton_available():
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        name = "vllm_onlinespec.kernels.distill_triton"
        mod = sys.modules.get(name)
        if mod is None:
            importlib.import_module(name)
        elif not mod.INTERPRETED:  # imported earlier without the interpreter: rebuild the kernels
            importlib.reload(mod)
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def make_inputs(n, h, v, dtype, seed=0, device=DEV, masked=True):
    """Target-like hidden states, a drafter close to them, a head with O(1..10) logits."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g) * (2.0 / h**0.5)
    ht = torch.randn(n, h, generator=g)
    hd = ht + 0.7 * torch.randn(n, h, generator=g)
    pw = torch.rand(n, generator=g) + 0.5
    if masked:
        pw[1::4] = 0.0  # masked positions
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(hd), cast(ht), cast(w), pw.to(device)


def per_position_d(hd, ht, w, T, mode):
    """T^2 * KL per position with the reference formulas (to place a clip that is active)."""
    wf = w.float()
    lq = torch.log_softmax(hd.float() @ wf.T / T, -1)
    lp = torch.log_softmax(ht.float() @ wf.T / T, -1)
    kl = (lq.exp() * (lq - lp)).sum(-1) if mode == "reverse_kl" else (lp.exp() * (lp - lq)).sum(-1)
    return T * T * kl


def run(impl, hd0, ht, w, pw, **kw):
    hd = hd0.detach().clone().requires_grad_(True)
    out = distill_loss(hd, ht, w, pw, impl=impl, return_argmax=True, **kw)
    assert isinstance(out, DistillOutput)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    out.loss.backward()
    assert hd.grad is not None and hd.grad.dtype == hd0.dtype and hd.grad.shape == hd0.shape
    return out, hd.grad


def check_against_reference(impl, hd, ht, w, pw, *, mode, clip, T, alpha=0.8, miss_weight=0.0,
                            **kw):
    ref, g_ref = run("naive", hd, ht, w, pw, mode=mode, clip=clip, temperature=T, alpha=alpha,
                     miss_weight=miss_weight)
    out, g = run(impl, hd, ht, w, pw, mode=mode, clip=clip, temperature=T, alpha=alpha,
                 miss_weight=miss_weight, **kw)
    bf16 = hd.dtype != torch.float32
    # loss: float32 math everywhere, only the summation order differs
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    # grad: float32 -> tight; low precision -> a couple of ulps of the largest entry
    gtol = dict(rtol=2e-2, atol=4e-3 * g_ref.float().abs().max().item()) if bf16 else \
        dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g.float(), g_ref.float(), **gtol)
    assert torch.equal(out.target_ids, ref.target_ids)
    assert torch.equal(out.draft_ids, ref.draft_ids)
    assert out.target_ids.dtype == torch.long and out.draft_ids.dtype == torch.long
    # masked positions: zero gradient, exactly
    masked = pw == 0
    if masked.any():
        assert g[masked].abs().max().item() == 0.0
    return ref, out, g_ref


def active_clip(hd, ht, w, T, mode):
    """A clip between the smallest and the largest T^2 KL: active for about half the rows."""
    if mode == "ce":
        return 0.5
    d = per_position_d(hd, ht, w, T, mode).sort().values
    k = len(d) // 2  # midway between two rows' values: no row sits on the clip boundary
    return 0.5 * (d[k - 1] + d[k]).item()


SHAPES = [(7, 16, 100), (33, 64, 257)]


# --------------------------------------------------------------------------- chunked vs reference


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [None, "active"])
def test_chunked_matches_reference(shape, dtype, mode, clip):
    n, h, v = shape
    hd, ht, w, pw = make_inputs(n, h, v, dtype, seed=n + h)
    T = 1.0 if clip is None else 2.0
    if clip == "active":
        clip = active_clip(hd, ht, w, T, mode)
    # chunk 4: several chunks and a ragged last one
    check_against_reference("chunked", hd, ht, w, pw, mode=mode, clip=clip, T=T, chunk_size=4)


def test_chunked_default_chunk_and_alpha_edges():
    hd, ht, w, pw = make_inputs(33, 16, 100, torch.float32, seed=3)
    for alpha in (0.0, 1.0, 0.3):
        check_against_reference("chunked", hd, ht, w, pw, mode="reverse_kl", clip=None, T=0.7,
                                alpha=alpha)


def test_clip_gradient_is_zero_when_active_everywhere():
    hd, ht, w, pw = make_inputs(7, 16, 100, torch.float32, seed=5, masked=False)
    d = per_position_d(hd, ht, w, 1.0, "reverse_kl")
    clip = d.min().item() * 0.5  # active on every row -> only the CE term has a gradient
    for impl in ("naive", "chunked"):
        _, g = run(impl, hd, ht, w, pw, mode="reverse_kl", clip=clip, alpha=0.8)
        _, g_ce = run(impl, hd, ht, w, pw, mode="ce")
        torch.testing.assert_close(g, 0.8 * g_ce, rtol=1e-5, atol=1e-7)
        loss = distill_loss(hd, ht, w, pw, mode="reverse_kl", clip=clip, impl=impl)
        loss_ce = distill_loss(hd, ht, w, pw, mode="ce", impl=impl)
        torch.testing.assert_close(loss, 0.8 * loss_ce + 0.2 * clip, rtol=1e-5, atol=1e-6)


def test_masked_positions_contribute_nothing():
    hd, ht, w, pw = make_inputs(33, 16, 100, torch.float32, seed=7)
    hd2, ht2 = hd.clone(), ht.clone()
    m = pw == 0
    hd2[m] = torch.randn_like(hd2[m]) * 5
    ht2[m] = torch.randn_like(ht2[m]) * 5
    for impl in ("naive", "chunked"):
        a = distill_loss(hd, ht, w, pw, impl=impl)
        b = distill_loss(hd2, ht2, w, pw, impl=impl)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # an all-masked batch: loss 0, grad 0
    out, g = run("chunked", hd, ht, w, torch.zeros_like(pw))
    assert out.loss.item() == 0.0 and g.abs().max().item() == 0.0


def test_loss_is_weighted_mean_of_per_position_losses():
    # pw scaled by a constant leaves the loss unchanged; pw one-hot picks one position
    hd, ht, w, pw = make_inputs(7, 16, 100, torch.float32, seed=11, masked=False)
    a = distill_loss(hd, ht, w, pw, impl="chunked")
    b = distill_loss(hd, ht, w, pw * 7.5, impl="chunked")
    torch.testing.assert_close(a, b)
    one = torch.zeros_like(pw)
    one[2] = 1.0
    c = distill_loss(hd, ht, w, one, impl="chunked", mode="ce")
    q = hd.float() @ w.float().T
    t = (ht.float() @ w.float().T).argmax(-1)
    torch.testing.assert_close(c, -torch.log_softmax(q[2], -1)[t[2]])


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("mode", MODES)
def test_miss_weight_matches_reference_values_and_gradients(impl, mode):
    """Emphasis on the rows the drafter gets wrong: the same in every implementation."""
    hd, ht, w, pw = make_inputs(33, 64, 257, torch.float32, seed=13)
    ref, _, _ = check_against_reference(impl, hd, ht, w, pw, mode=mode, clip=None, T=1.0,
                                        miss_weight=2.0, **({"chunk_size": 4} if impl == "chunked" else {}))
    miss = ref.draft_ids != ref.target_ids
    assert 0 < int(miss[pw > 0].sum()) < int((pw > 0).sum())  # the inputs have both kinds of row


def test_miss_weight_is_a_row_weight_with_the_plain_normaliser():
    """loss(miss_weight) = sum pw (1 + mw [miss]) l / sum pw: the weighted rows' loss, scaled
    by how much weight the misses added; mw = 0 is exactly the plain loss; a drafter that
    matches the target everywhere is unaffected."""
    hd, ht, w, pw = make_inputs(33, 16, 100, torch.float32, seed=17)
    plain = distill_loss(hd, ht, w, pw, impl="chunked", return_argmax=True)
    assert torch.equal(distill_loss(hd, ht, w, pw, impl="chunked", miss_weight=0.0), plain.loss)
    miss = (plain.draft_ids != plain.target_ids).float()
    pw2 = pw * (1.0 + 3.0 * miss)
    for impl in ("naive", "chunked"):
        got = distill_loss(hd, ht, w, pw, impl=impl, miss_weight=3.0)
        want = distill_loss(hd, ht, w, pw2, impl=impl) * pw2.sum() / pw.sum()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got > plain.loss  # the misses add weight to positive per-row losses
        same = distill_loss(ht, ht, w, pw, impl=impl, mode="ce")
        torch.testing.assert_close(distill_loss(ht, ht, w, pw, impl=impl, mode="ce",
                                                miss_weight=3.0), same)
    with pytest.raises(ValueError, match="miss_weight must be >= 0"):
        distill_loss(hd, ht, w, pw, miss_weight=-1.0)


# --------------------------------------------------------------------------- Triton vs reference


@needs_triton
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [None, "active"])
def test_triton_matches_reference_fp32(mode, clip):
    n, h, v = 33, 64, 257  # 3 row blocks, 2 vocabulary splits, ragged tiles and chunks
    hd, ht, w, pw = make_inputs(n, h, v, torch.float32, seed=1)
    T = 1.0 if clip is None else 1.5
    if clip == "active":
        clip = active_clip(hd, ht, w, T, mode)
    check_against_reference("triton", hd, ht, w, pw, mode=mode, clip=clip, T=T)


@needs_triton
@pytest.mark.parametrize("mode", MODES)
def test_triton_matches_reference_bf16(mode):
    n, h, v = 7, 16, 100
    hd, ht, w, pw = make_inputs(n, h, v, torch.bfloat16, seed=2)
    clip = active_clip(hd, ht, w, 2.0, mode)
    check_against_reference("triton", hd, ht, w, pw, mode=mode, clip=clip, T=2.0)


@needs_triton
def test_triton_small_vocab_chunks_and_h_tail():
    # h=16 < BLOCK_H (masked reduction tail), chunk 64 -> ragged last vocabulary chunk of 36
    hd, ht, w, pw = make_inputs(7, 16, 100, torch.float32, seed=4)
    check_against_reference("triton", hd, ht, w, pw, mode="reverse_kl", clip=None, T=0.5,
                            chunk_size=64)


@needs_triton
def test_triton_forward_only_and_auto():
    hd, ht, w, pw = make_inputs(33, 16, 100, torch.float32, seed=6)
    ref = distill_loss(hd, ht, w, pw, impl="naive", mode="forward_kl")
    with torch.no_grad():
        out = distill_loss(hd, ht, w, pw, impl="triton", mode="forward_kl")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    auto = distill_loss(hd, ht, w, pw, impl="auto", mode="forward_kl")
    torch.testing.assert_close(auto, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=needs_triton)])
def test_argmax_ties_pick_first_index(impl):
    # duplicate vocabulary rows in other tiles / splits: all impls return the first index
    n, h, v = 7, 32, 257
    hd, ht, w, pw = make_inputs(n, h, v, torch.float32, seed=8)
    w = w.clone()
    big = ht[0].float() * 2.0
    for j in (30, 100, 200):  # 30 and 100: same split, other tile; 200: other split
        w[j] = big
    dbig = hd[3].float() * 2.0
    for j in (250, 20, 180):
        w[j] = dbig
    ref = distill_loss(hd, ht, w, pw, impl="naive", return_argmax=True)
    out = distill_loss(hd, ht, w, pw, impl=impl, return_argmax=True)
    assert ref.target_ids[0].item() == 30
    assert ref.draft_ids[3].item() == 20
    assert torch.equal(out.target_ids, ref.target_ids)
    assert torch.equal(out.draft_ids, ref.draft_ids)


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_head_with_fp32_hidden_states(impl, mode, monkeypatch):
    """The learner passes the target's bf16 LM head in place with float32 drafter states: the
    loss and gradient equal those with a float32 copy of that head (the kernels cast it per
    slice / per tile instead of copying it)."""
    from vllm_onlinespec.kernels import chunked

    monkeypatch.setattr(chunked, "HEAD_SLICE_BYTES", 4 * 16 * 40)  # 40-row slices, ragged last
    n, h, v = 33, 16, 257
    hd, ht, w32, pw = make_inputs(n, h, v, torch.float32, seed=10)
    w = w32.to(torch.bfloat16)
    assert chunked.head_slice_rows(w) == 40
    ref, g_ref = run("naive", hd, ht, w.float(), pw, mode=mode, clip=None)
    out, g = run(impl, hd, ht, w, pw, mode=mode, clip=None, chunk_size=8 if impl == "chunked" else None)
    exact = not (CUDA and impl == "triton")  # on a GPU the mixed-dtype dots run in tf32
    tol = dict(rtol=1e-5, atol=1e-5) if exact else dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out.loss, ref.loss, **tol)
    gtol = dict(rtol=1e-4, atol=1e-6) if exact else dict(rtol=2e-2, atol=1e-2 * g_ref.abs().max().item())
    torch.testing.assert_close(g, g_ref, **gtol)
    if exact:
        assert torch.equal(out.target_ids, ref.target_ids)
        assert torch.equal(out.draft_ids, ref.draft_ids)


# --------------------------------------------------------------------------- API


def test_argument_errors():
    hd, ht, w, pw = make_inputs(7, 16, 100, torch.float32, device="cpu")
    bad = [
        dict(ht=ht[:, :8]),
        dict(w=w[:, :8]),
        dict(pw=pw[:3]),
        dict(hd=hd[0]),
        dict(mode="kl"),
        dict(alpha=1.5),
        dict(alpha=-0.1),
        dict(temperature=0.0),
        dict(clip=0.0),
        dict(clip=-1.0),
        dict(impl="cuda"),
        dict(chunk_size=0),
    ]
    for b in bad:
        args = dict(hd=hd, ht=ht, w=w, pw=pw)
        kw = {}
        for k, val in b.items():
            (args if k in args else kw)[k] = val
        with pytest.raises(ValueError, match="distill_loss"):
            distill_loss(args["hd"], args["ht"], args["w"], args["pw"], **kw)


def test_import_is_lazy_and_auto_on_cpu_is_chunked():
    import subprocess

    code = (
        "import sys, torch\n"
        "from vllm_onlinespec.kernels import distill_loss\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "hd = torch.randn(5, 8, requires_grad=True)\n"
        "l = distill_loss(hd, torch.randn(5, 8), torch.randn(20, 8), torch.ones(5))\n"
        "l.backward()\n"
        "assert 'triton' not in sys.modules, 'auto on CPU must not use triton'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
