"""The length head against real verification (policy/head_feedback.py): exact labels only
(censored cuts skipped), a gate that opens only when the head beats the population estimate on
fresh labels, and a head that learns from those labels."""

import torch

from vllm_onlinespec.config import LengthHeadConfig
from vllm_onlinespec.drafter import LengthHead
from vllm_onlinespec.policy.cutter import DraftCutter
from vllm_onlinespec.policy.head_feedback import HeadFeedback
from vllm_onlinespec.policy.verify_length import AcceptanceStats

K, H = 4, 8


def test_only_exact_labels_are_scored():
    fb = HeadFeedback(K, min_labels=1)
    fb.record(["a", "b", "c", "d"], [0.5] * 4, 0.4, verified=[4, 2, 2, 0], rows=None)
    # a: full draft verified (exact); b: rejected inside the cut (exact); c: accepted up to its
    # cut (censored); d: nothing verified
    n = fb.observe(None, ["a", "b", "c", "d"], [4, 2, 2, 0], [4, 1, 2, 0])
    assert n == 2 and fb.labels == 2 and not fb.pending


def test_gate_opens_only_when_the_head_beats_the_population():
    good, bad = HeadFeedback(K, min_labels=8), HeadFeedback(K, min_labels=8)
    for i in range(8):
        acc = i % 3  # labels (acc + 1) / 5 in {0.2, 0.4, 0.6}
        y = (acc + 1) / (K + 1)
        good.record(["r"], [y], 0.4, [K], None)
        bad.record(["r"], [1.0 - y], 0.4, [K], None)
        assert not good.passes() or i == 7  # never before min_labels
        good.observe(None, ["r"], [K], [acc])
        bad.observe(None, ["r"], [K], [acc])
    assert good.passes() and not bad.passes()
    assert "beats" in good.state() and "does not beat" in bad.state()


def make_cutter(**kw):
    cfg = LengthHeadConfig(policy="adaflash", rho=1.0, **kw)
    torch.manual_seed(0)
    return DraftCutter(cfg, K, head=LengthHead(H, width=16), head_trusted=True)


def population(c, n=32):
    c.policy.stats = AcceptanceStats(K)
    for _ in range(n):
        c.policy.stats.observe([K], [2])


def test_a_gated_head_predicts_in_shadow_and_the_reason_says_why():
    c = make_cutter(head_gate_labels=64, head_lr=0.0)
    population(c)
    c.observe_hidden(torch.randn(2 * K, H))
    c.cut([[1, 2, 3, 4]] * 2, ["a", "b"])
    assert c.head_state == "gated" and "length head not used (gated: 0/64" in c.last_reason
    assert set(c.feedback.pending) == {"a", "b"}
    assert c.feedback.pending["a"].r_head is not None  # shadow prediction recorded


def test_the_head_learns_from_verification_and_is_not_overwritten_by_the_learner():
    """Labels that depend on the hidden states: the head's error on them must fall."""
    c = make_cutter(head_gate_labels=16, head_lr=3e-2)
    population(c)
    g = torch.Generator().manual_seed(1)
    signs = torch.tensor([1.0, -1.0])

    def step(ids):
        h = torch.randn(2, K, H, generator=g) * 0.1
        h[..., 0] += signs[:, None] * 2  # request a: feature +2 -> accepts all; b: -2 -> none
        c.observe_hidden(h.reshape(2 * K, H))
        c.cut([[1, 2, 3, 4]] * 2, ids)
        c.observe([K, K], [K, 0], ids)

    before = [p.detach().clone() for p in c.head.parameters()]
    for i in range(200):
        step([f"a{i}", f"b{i}"])
    assert c.feedback.updates == 200
    assert any(not torch.equal(a, b) for a, b in zip(before, c.head.parameters()))
    assert c.feedback.passes() and c.head_state == "on", c.feedback.state()
    h = torch.zeros(2, K, H)
    h[..., 0] = signs[:, None] * 2
    with torch.no_grad():
        r = c.head(h)
    assert r[0] > 0.8 and r[1] < 0.4, r  # labels 1.0 and 0.2
    w = [p.detach().clone() for p in c.head.parameters()]
    c.refresh({f"length_head.{k}": torch.zeros_like(v) for k, v in c.head.state_dict().items()}, 9)
    assert all(torch.equal(a, b) for a, b in zip(w, c.head.parameters()))
