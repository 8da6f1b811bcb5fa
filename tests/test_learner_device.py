"""The learner on a configured device, checked without a GPU.

Placement: "meta" stands in for a second device (CPU is the only real one here): a learner built
there must hold every tensor it owns there (parameters, update-rule state, length head,
snapshot) without running an update. On CPU: the target's embedding and LM head are used in
place (the very tensors passed in), and a bf16 LM head trains a float32 drafter with the loss
of a float32 copy of that head.
"""

from __future__ import annotations

import pytest
import torch

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, LengthHead, save_drafter
from vllm_onlinespec.learner.buffer import FeedbackRecord
from vllm_onlinespec.learner.device import Snapshot, resolve_device
from vllm_onlinespec.learner.factory import build_learner, loss_impl
from vllm_onlinespec.learner.algorithms import HedgeEnsemble
from vllm_onlinespec.learner.timing import Timer
from vllm_onlinespec.presets import merge

H, V, K = 32, 50, 3


def write_drafter(path, head=True):
    cfg = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
                       target_layer_ids=[0, 1], mask_token_id=0, block_size=K + 1,
                       rope_theta=10000.0, torch_dtype="float32")
    torch.manual_seed(0)
    save_drafter(path, cfg, DFlashDrafter(cfg), LengthHead(H) if head else None)
    return str(path)


def cfg(**kw):
    base = dict(update={"lr": 1e-3}, min_new_tokens_per_update=1, batch_blocks=4,
                anchors_per_request=4)
    return OnlineSpecConfig.from_any(merge(base, kw))


def targets(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(V, H, generator=g).to(dtype), torch.randn(V, H, generator=g).to(dtype)


def feed(buffer, steps=6):
    g = torch.Generator().manual_seed(2)

    def push(start, n, drafted):
        buffer.push(FeedbackRecord("r", torch.randint(1, V, (n,), generator=g), start,
                                   torch.randn(n, 2 * H, generator=g), torch.randn(n, H, generator=g),
                                   drafted, min(drafted, n - 1)))

    push(0, 9, 0)
    for i in range(steps):
        push(9 + i * (K + 1), K + 1, K)


def all_state_tensors(algo):
    """Every per-parameter state slot the rule can create (created now: slots are lazy), and
    the members of an ensemble with theirs."""
    out = []
    rules = [algo]
    if isinstance(algo, HedgeEnsemble):
        out += [t for member in algo.members for t in member]
        rules = algo.algos
    for rule in rules:
        for i in range(len(rule.params)):
            out += [rule._slot(i, name) for name in rule._slots]
    return out


@pytest.mark.parametrize("algorithm", ["ogd", "optimistic_momentum", "ensemble"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_everything_the_learner_owns_is_on_its_device(tmp_path, algorithm, dtype):
    path = write_drafter(tmp_path / "d")
    emb, lm = (t.to("meta") for t in targets())
    c = cfg(update={"algorithm": algorithm, "ensemble_lrs": [1e-3, 1e-4]}, learner_device="meta",
            learner_dtype=dtype)
    parts = build_learner(c, path, emb, lm, K, train_length_head=True)  # device from the config
    learner = parts.learner
    assert learner.device.type == "meta"
    tensors = {f"param {n}": p for n, p in parts.bundle.named_parameters()}
    tensors.update({f"buffer {n}": b for n, b in parts.bundle.named_buffers()})
    tensors.update({f"state {i}": t for i, t in enumerate(all_state_tensors(learner.algo))})
    version, snap = learner.latest()
    assert isinstance(snap, Snapshot) and snap.ready is None
    tensors.update({f"snapshot {n}": t for n, t in snap.items()})
    assert len(snap) == len(learner.params) and any(n.startswith("length_head.") for n in snap)
    off = sorted(n for n, t in tensors.items() if t.device.type != "meta")
    assert not off, off
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert {p.dtype for p in parts.bundle.drafter.parameters()} == {want}
    assert {p.dtype for p in parts.bundle.length_head.parameters()} == {torch.float32}
    obj = learner.loss_fn
    assert obj.embed_w is emb and obj.lm_head_w is lm  # same device: no copy
    assert obj.impl == "chunked"


def test_explicit_device_wins_and_auto_follows_the_head(tmp_path):
    path = write_drafter(tmp_path / "d", head=False)
    emb, lm = (t.to("meta") for t in targets())
    parts = build_learner(cfg(), path, emb, lm, K, train_length_head=False)  # auto -> lm's device
    assert parts.learner.device.type == "meta"
    emb, lm = targets()
    parts = build_learner(cfg(), path, emb, lm, K, train_length_head=False, device="meta")
    assert all(p.device.type == "meta" for p in parts.learner.params)
    # another device than the target's: one copy each, in the target's dtype
    assert parts.learner.loss_fn.lm_head_w.device.type == "meta"
    assert parts.learner.loss_fn.lm_head_w.dtype == torch.float32
    assert resolve_device("auto", None) == torch.device("cpu")
    assert resolve_device("auto", torch.device("meta")) == torch.device("meta")
    assert resolve_device("cuda:1", torch.device("cpu")) == torch.device("cuda:1")
    assert loss_impl(torch.device("cpu")) == "chunked"


def test_cpu_learner_reads_the_target_head_in_place(tmp_path):
    path = write_drafter(tmp_path / "d")
    emb, lm = targets()
    emb0, lm0 = emb.clone(), lm.clone()
    parts = build_learner(cfg(), path, emb, lm, K, train_length_head=True)
    obj = parts.learner.loss_fn
    assert obj.embed_w is emb and obj.lm_head_w is lm
    assert obj.embed_w.data_ptr() == emb.data_ptr() and obj.lm_head_w.data_ptr() == lm.data_ptr()
    feed(parts.buffer)
    assert parts.learner.sync_step() == "updated"
    assert torch.equal(emb, emb0) and torch.equal(lm, lm0)  # read-only
    s = parts.learner.stats()
    assert s["device"] == "cpu" and s["update_ms"] > 0 and s["snapshot_ms"] >= 0
    version, snap = parts.learner.latest()
    assert version == 1
    snap.wait_ready()  # no-op on CPU
    for n, p in zip(parts.learner.names, parts.learner.params):  # copies, not views
        assert torch.equal(snap[n], p) and snap[n].data_ptr() != p.data_ptr()


def test_bf16_head_trains_a_float32_drafter_like_a_float32_copy(tmp_path):
    """The bf16 head in place (cast per slice inside the loss) gives the loss that a float32
    copy of the same bf16 values gives, and a finite one (float32 matmuls: no autocast)."""
    path = write_drafter(tmp_path / "d")
    emb16, lm16 = targets(torch.bfloat16)
    runs = {}
    for name, (emb, lm) in {"bf16": (emb16, lm16), "fp32": (emb16.float(), lm16.float())}.items():
        parts = build_learner(cfg(learner_compute_dtype="float32"), path, emb, lm, K,
                              train_length_head=True)
        assert parts.learner.loss_fn.lm_head_w is lm
        assert {p.dtype for p in parts.learner.params} == {torch.float32}
        feed(parts.buffer)
        assert parts.learner.sync_step() == "updated", parts.learner.last_error
        runs[name] = parts.learner
    a, b = runs["bf16"].last_loss, runs["fp32"].last_loss
    assert torch.isfinite(torch.tensor(a)) and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    for p, q in zip(runs["bf16"].params, runs["fp32"].params):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_learner_device_config_errors_name_the_field():
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(ConfigError) as e:
            cfg(learner_device=bad)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("onlinespec.learner_device:"), msg
    with pytest.raises(ConfigError, match="learner_dtype"):
        cfg(learner_device="cpu", learner_dtype="bfloat16")
    assert cfg(learner_device="cuda:1").learner_device == "cuda:1"
    assert cfg().learner_device == "auto" and cfg().learner_dtype == "float32"


def test_timer_host_clock_off_cuda():
    with Timer(torch.device("cpu")) as t:
        sum(range(1000))
    assert t.ms > 0


def test_online_loss_vocabulary_grows_with_the_feedback(tmp_path):
    """loss.vocab 'seen': the learner projects onto the tokens of the batches it has trained on,
    a set that only grows; 'full' keeps the whole head."""
    path = write_drafter(tmp_path / "d")
    emb, lm = targets()
    parts = build_learner(cfg(), path, emb, lm, K, train_length_head=False)
    obj = parts.learner.loss_fn
    first = obj.vocab_for(torch.tensor([[5, 7, 7], [9, 5, 0]]))
    assert first.ids.tolist() == [0, 5, 7, 9]
    torch.testing.assert_close(first.weight, lm[[0, 5, 7, 9]])
    assert obj.vocab_for(torch.tensor([7, 9])) is first  # nothing new: no rebuild
    grown = obj.vocab_for(torch.tensor([3, 49]))
    assert grown.ids.tolist() == [0, 3, 5, 7, 9, 49]
    feed(parts.buffer)
    assert parts.learner.sync_step() == "updated", parts.learner.last_error
    assert set(grown.ids.tolist()) <= set(obj._vocab.ids.tolist())  # the update's batch added
    assert len(obj._vocab) > len(grown)

    full = build_learner(cfg(loss={"vocab": "full"}), path, emb, lm, K, train_length_head=False)
    assert full.learner.loss_fn.vocab_for(torch.tensor([1, 2])) is None
    feed(full.buffer)
    assert full.learner.sync_step() == "updated", full.learner.last_error
    with pytest.raises(ConfigError, match="vocab"):
        cfg(loss={"vocab": "most"})


def test_bf16_autocast_updates_match_float32_updates_within_tolerance(tmp_path):
    """learner_compute_dtype "bfloat16" (CPU autocast; float32 parameters and Adam state) moves
    the drafter as the float32 path does. Tolerance: bf16 keeps 8 mantissa bits, so each
    update's gradient may differ by ~1e-2 relative; over 3 updates the parameter *change* keeps
    a cosine >= 0.98 with float32's and a norm within 10 %, the loss within 2 %, and the
    length head (kept in float32 under autocast) stays float32."""
    path = write_drafter(tmp_path / "d")
    emb, lm = targets()
    runs = {}
    for cd in ("float32", "bfloat16"):
        torch.manual_seed(0)
        parts = build_learner(cfg(learner_compute_dtype=cd), path, emb, lm, K,
                              train_length_head=True)
        assert parts.learner.loss_fn.autocast == (None if cd == "float32" else torch.bfloat16)
        start = [p.detach().clone() for p in parts.learner.params]
        feed(parts.buffer)
        batch = parts.learner.make_batch(parts.buffer)  # one batch, three updates on it
        losses = []
        for _ in range(3):
            assert parts.learner.sync_step(batch) == "updated", parts.learner.last_error
            losses.append(parts.learner.last_loss)
        assert {p.dtype for p in parts.learner.params} == {torch.float32}
        delta = torch.cat([(p.detach() - s).flatten()
                           for p, s in zip(parts.learner.params, start)])
        runs[cd] = (delta, losses)
    d32, d16 = runs["float32"][0], runs["bfloat16"][0]
    assert float(d32.norm()) > 0
    cos = float(torch.nn.functional.cosine_similarity(d32, d16, dim=0))
    assert cos >= 0.98, cos
    assert float(d16.norm()) == pytest.approx(float(d32.norm()), rel=0.1)
    for a, b in zip(runs["float32"][1], runs["bfloat16"][1]):
        assert b == pytest.approx(a, rel=0.02)


def test_compute_dtype_auto_follows_the_hardware(monkeypatch):
    from vllm_onlinespec import serving_dtype
    from vllm_onlinespec.learner.device import compute_dtype

    cpu = torch.device("cpu")
    assert compute_dtype("float32", cpu) is None
    assert compute_dtype("bfloat16", cpu) is torch.bfloat16
    monkeypatch.setattr(serving_dtype, "cpu_native_bf16", lambda: False)
    assert compute_dtype("auto", cpu) is None  # emulated bf16 would be slower, not faster
    monkeypatch.setattr(serving_dtype, "cpu_native_bf16", lambda: True)
    assert compute_dtype("auto", cpu) is torch.bfloat16
    assert compute_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
