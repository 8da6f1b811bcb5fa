"""The learner factory without an engine (learner/factory.py), the session's head rules, and
resuming from checkpoint directories that cannot be used (learner/resume.py).

K (vLLM's num_speculative_tokens) != the drafter's block_size - 1 is a documented adaptation:
the learner trains the K positions vLLM serves. Unusable checkpoints (another architecture,
another algorithm, a truncated file, another format version) -> one warning, fresh weights.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, LengthHead, save_drafter
from vllm_onlinespec.learner import checkpoint as ckpt
from vllm_onlinespec.learner.buffer import FeedbackRecord
from vllm_onlinespec.learner.factory import build_learner
from vllm_onlinespec.learner.resume import resume_or_fresh
from vllm_onlinespec.presets import merge

H, V = 32, 50


def write_drafter(path, *, layers=1, block_size=8, head=False, seed=0):
    cfg = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
                       target_layer_ids=[0, 1], mask_token_id=0, block_size=block_size,
                       rope_theta=10000.0, torch_dtype="float32")
    torch.manual_seed(seed)
    save_drafter(path, cfg, DFlashDrafter(cfg), LengthHead(H) if head else None)
    return str(path)


def targets():
    g = torch.Generator().manual_seed(1)
    return torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)


def cfg(**kw):
    base = dict(update={"lr": 1e-3}, min_new_tokens_per_update=1, batch_blocks=4,
                anchors_per_request=4)
    return OnlineSpecConfig.from_any(merge(base, kw))


def feed(buffer, K, steps=8):
    g = torch.Generator().manual_seed(2)
    P = 9

    def push(start, n, drafted):
        buffer.push(FeedbackRecord("r", torch.randint(1, V, (n,), generator=g), start,
                                   torch.randn(n, 2 * H, generator=g), torch.randn(n, H, generator=g),
                                   drafted, min(drafted, n - 1)))

    push(0, P, 0)
    pos = P
    for _ in range(steps):
        push(pos, K + 1, K)
        pos += K + 1


def test_learner_trains_the_K_vllm_serves_not_the_drafters_block_size(tmp_path):
    """A b8 drafter (7 draft tokens) served with K = 3: blocks carry 3 labels, the head's
    label divides by K + 1, and checkpoints keep the drafter's own block_size."""
    K = 3
    path = write_drafter(tmp_path / "d", block_size=8, head=True)
    seen = []
    parts = build_learner(cfg(), path, *targets(), K, train_length_head=True)
    assert parts.config.block_size == 8 and parts.trained_config.block_size == K + 1
    assert parts.bundle.drafter.config.num_draft_tokens == K
    objective = parts.learner.loss_fn

    def spy(model, batch):
        loss, st = objective(model, batch)
        seen.append(st)
        return loss, st

    parts.learner.loss_fn = spy
    feed(parts.buffer, K)
    assert parts.learner.sync_step() == "updated"
    assert set(k for k in seen[0] if k.startswith("match_")) == {f"match_{i + 1}" for i in range(K)}
    out = parts.learner.save_checkpoint(tmp_path / "ck")
    assert json.loads((out / "model" / "config.json").read_text())["block_size"] == 8


def test_length_head_rules(tmp_path):
    """train=false keeps a shipped head frozen; policy fixed trains and uses no head; a fresh
    head is trained but not trusted; a shipped head is trusted."""
    from vllm_onlinespec.serving import learner_setup

    shipped = write_drafter(tmp_path / "with-head", head=True)
    bare = write_drafter(tmp_path / "no-head")

    def build(path, **length_head):
        emb, lm = targets()
        runner = SimpleNamespace(model=SimpleNamespace(
            model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=emb)),
            lm_head=SimpleNamespace(weight=lm)))
        side = learner_setup.build(cfg(length_head=length_head), runner, path, drafter_k=4,
                                   leader=True)
        return side.parts.bundle.length_head, side.head, side.head_trusted

    trained, head, trusted = build(shipped, policy="adaflash", train=False)
    assert trained is None and head is not None and trusted
    trained, head, trusted = build(shipped, policy="fixed", train=True)
    assert trained is None and head is None
    # head_lr = 0: the learner trains the head (on its simulated acceptance)
    trained, head, trusted = build(bare, policy="budget", train=True, head_lr=0.0)
    assert trained is not None and head is trained and not trusted
    trained, head, trusted = build(shipped, policy="adaflash", train=True, head_lr=0.0)
    assert trained is not None and head is trained and trusted
    # head_lr > 0 (default): the cutter trains it on real verification, not the learner
    trained, head, trusted = build(shipped, policy="adaflash", train=True)
    assert trained is None and head is not None and trusted
    trained, head, trusted = build(bare, policy="budget", train=True)
    assert trained is None and head is not None and not trusted


# -- resume ----------------------------------------------------------------------------------------

def fresh_learner(tmp_path, **kw):
    path = write_drafter(tmp_path / "start", layers=kw.pop("layers", 1))
    return build_learner(cfg(**kw), path, *targets(), 3, train_length_head=False).learner


def state_of(learner):
    return ckpt.state_digest(dict(zip(learner.names, learner.params))), \
        ckpt.state_digest({f"s{i}": t for i, t in enumerate(
            v for v in _tensors(learner.algo.state_dict()))})


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


def saved_checkpoint(tmp_path, **kw):
    other = tmp_path / "other"
    other.mkdir()
    lr = fresh_learner(other, **kw)
    return lr.save_checkpoint(tmp_path / "ck")


def _break(case, tmp_path):
    if case == "architecture":
        return saved_checkpoint(tmp_path, layers=2)
    if case == "algorithm":
        return saved_checkpoint(tmp_path, update={"algorithm": "optimistic"})
    p = saved_checkpoint(tmp_path)
    if case == "truncated":
        f = p / ckpt.MODEL_FILE
        f.write_bytes(f.read_bytes()[:100])
    elif case == "version":
        m = json.loads((p / ckpt.MARKER).read_text())
        m["format"] = 99
        (p / ckpt.MARKER).write_text(json.dumps(m))
    return p


@pytest.mark.parametrize("case", ["architecture", "algorithm", "truncated", "version"])
def test_unusable_checkpoint_means_one_warning_and_a_fresh_start(tmp_path, case, caplog):
    _break(case, tmp_path)
    lr = fresh_learner(tmp_path)
    before = state_of(lr)
    with caplog.at_level(logging.WARNING):
        r = resume_or_fresh(lr, tmp_path / "ck")
    # One record (a handler may see it twice when vLLM's handlers also reach caplog's).
    warnings = list({id(x): x for x in caplog.records if x.levelno >= logging.WARNING}.values())
    assert len(warnings) == 1 and "starting fresh" in warnings[0].getMessage(), \
        [w.getMessage() for w in warnings]
    assert r.path is None and r.version == 0 and len(r.skipped) == 1
    assert state_of(lr) == before and lr.published_version == 0
    assert lr.sync_step() in ("no_batch", "updated")  # still a working learner


def test_a_good_checkpoint_resumes_silently(tmp_path, caplog):
    p = saved_checkpoint(tmp_path)
    lr = fresh_learner(tmp_path)
    with caplog.at_level(logging.WARNING):
        r = resume_or_fresh(lr, tmp_path / "ck")
    assert r.path == p and not [x for x in caplog.records if x.levelno >= logging.WARNING]
    assert resume_or_fresh(lr, tmp_path / "empty").path is None  # nothing there: no warning


def test_gain_pacing_scores_batches_against_the_frozen_start_weights(tmp_path):
    """share_control 'gain': every score_every-th update also scores the batch with the frozen
    start weights; the first score is a gain of exactly 0 (nothing trained yet), the scores
    reach the duty cycle and its share, and the reference weights stay frozen."""
    K = 3
    path = write_drafter(tmp_path / "d", block_size=4)
    parts = build_learner(cfg(update={"lr": 1e-2}, pacing={"score_every": 1,
                                                           "learner_cpu_share": 0.5,
                                                           "min_cpu_share": 0.1}),
                          path, *targets(), K, train_length_head=False)
    lr = parts.learner
    assert lr.duty is not None and lr.share == 0.5
    assert parts.footprint.reference > 0
    seen = []
    score = lr.duty.observe
    lr.duty.observe = lambda s: (seen.append(s), score(s))[1]
    for i in range(6):
        feed(parts.buffer, K, steps=4)
        assert lr.sync_step() == "updated"
    assert len(seen) == 6 and seen[0].gain == pytest.approx(0.0, abs=1e-6)
    assert any(abs(s.gain) > 0 for s in seen[1:])  # the trained weights moved, the frozen did not
    st = lr.stats()
    assert st["gain_scores"] == 6 and st["score_errors"] == 0 and "share" in st
    fixed = build_learner(cfg(pacing={"share_control": "fixed"}), path, *targets(), K,
                          train_length_head=False)
    assert fixed.learner.duty is None and fixed.footprint.reference == 0


def test_min_share_above_the_share_is_one_line():
    with pytest.raises(Exception, match="min_cpu_share 0.6 exceeds learner_cpu_share 0.5"):
        cfg(pacing={"min_cpu_share": 0.6, "learner_cpu_share": 0.5})


def test_replayed_blocks_are_left_out_of_the_gain_score():
    """A batch filled up with replayed anchors keeps them apart: fresh_only() is the same batch
    with the replayed anchors masked, and without replay it is the batch itself."""
    from vllm_onlinespec.learner.batches import windows_to_batch
    from vllm_onlinespec.learner.buffer import FeedbackBuffer

    K = 3
    buf = FeedbackBuffer(window_tokens=256, max_tokens=4096)
    feed(buf, K, steps=12)  # 9 prompt tokens + 12 steps of K + 1: positions 0..56
    buf.sample_training_windows(4, holdback=0)  # trained once: the next window can replay them
    g = torch.Generator().manual_seed(3)
    for pos in range(57, 57 + 4 * (K + 1), K + 1):
        buf.push(FeedbackRecord("r", torch.randint(1, V, (K + 1,), generator=g), pos,
                                torch.randn(K + 1, 2 * H, generator=g),
                                torch.randn(K + 1, H, generator=g), K, 1))
    wins = buf.sample_training_windows(4, holdback=K)
    plain = windows_to_batch(wins, max_anchors=2, stride=K)
    assert plain.fresh_anchors is None and plain.fresh_only() is plain
    full = windows_to_batch(wins, max_anchors=2, stride=K, replay_to=8)
    fresh = full.fresh_only()
    kept = fresh.anchors[fresh.anchors >= 0].tolist()
    assert kept == plain.anchors[plain.anchors >= 0].tolist()  # exactly the fresh anchors
    assert int((full.anchors >= 0).sum()) > len(kept)  # replay added blocks
