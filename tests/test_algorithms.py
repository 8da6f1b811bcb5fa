import math

import pytest
import torch

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.learner.algorithms import (OGD, HedgeEnsemble, NonFiniteUpdate, Optimistic,
                                                OptimisticMomentum, make_algorithm)


def params(seed=0, shapes=((3, 4), (4,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def grads_stream(n, seed=1, shapes=((3, 4), (4,))):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(n)]


def test_ogd_matches_torch_adamw():
    ours = params()
    ref = [torch.nn.Parameter(p.clone()) for p in ours]
    opt = torch.optim.AdamW(ref, lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    alg = OGD(ours, lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    for gs in grads_stream(12):
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        opt.step()
        alg.step(gs)
    # same ops in the same order as AdamW's single-tensor path: bit-exact, not just close
    for a, b, start in zip(ours, ref, params()):
        assert torch.equal(a, b.detach())
        assert not torch.equal(a, start)


def test_ogd_skips_none_grads():
    ps = params()
    before = ps[1].clone()
    OGD(ps, lr=0.1).step([torch.ones(3, 4), None])
    assert torch.equal(ps[1], before) and not torch.equal(ps[0], params()[0])


def test_optimistic_plain_sgd_hand_computed():
    p = [torch.tensor([1.0, -2.0])]
    alg = Optimistic(p, lr=0.5, precondition="none")
    g1, g2, g3 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([0.0, 4.0])
    alg.step([g1])  # first step: plain g_1
    assert torch.equal(p[0], torch.tensor([1.0 - 0.5 * 1, -2.0 - 0.5 * 2]))
    alg.step([g2])  # 2 g_2 - g_1 = [5, -4]
    assert torch.equal(p[0], torch.tensor([0.5 - 2.5, -3.0 + 2.0]))
    alg.step([g3])  # 2 g_3 - g_2 = [-3, 9]
    assert torch.equal(p[0], torch.tensor([-2.0 + 1.5, -1.0 - 4.5]))


def test_optimistic_rms_hand_computed():
    lr, b2, eps = 0.1, 0.9, 1e-8
    p = [torch.tensor([0.0])]
    alg = Optimistic(p, lr=lr, betas=(0.0, b2), eps=eps)
    g1, g2 = 2.0, -1.0
    alg.step([torch.tensor([g1])])
    v1 = (1 - b2) * g1 ** 2
    u1 = g1 / (math.sqrt(v1 / (1 - b2)) + eps)  # = sign(g1)
    x1 = -lr * u1
    assert p[0].item() == pytest.approx(x1, rel=1e-6)
    alg.step([torch.tensor([g2])])
    v2 = b2 * v1 + (1 - b2) * g2 ** 2
    u2 = g2 / (math.sqrt(v2 / (1 - b2 ** 2)) + eps)
    assert p[0].item() == pytest.approx(x1 - lr * (2 * u2 - u1), rel=1e-6)


def test_optimistic_momentum_hand_computed():
    lr, b1 = 0.5, 0.5
    p = [torch.tensor([0.0])]
    alg = OptimisticMomentum(p, lr=lr, betas=(b1, 0.999), precondition="none")
    alg.step([torch.tensor([2.0])])
    m1 = (1 - b1) * 2.0
    u1 = m1 / (1 - b1)  # = 2
    assert p[0].item() == pytest.approx(-lr * u1)
    alg.step([torch.tensor([-4.0])])
    m2 = b1 * m1 + (1 - b1) * -4.0  # momentum persists
    u2 = m2 / (1 - b1 ** 2)
    assert p[0].item() == pytest.approx(-lr * u1 - lr * (2 * u2 - u1))


def test_hedge_weights_closed_form_and_average():
    ps = [torch.zeros(2)]
    lrs = [0.1, 0.2, 0.4]
    eta = 0.7
    h = HedgeEnsemble(ps, lrs, eta=eta, member_factory=lambda q, lr: Optimistic(
        q, lr=lr, precondition="none"))
    torch.testing.assert_close(h.weights, torch.full((3,), 1 / 3, dtype=torch.float64))
    losses = [[1.0, 2.0, 0.5], [3.0, 0.1, 0.2], [0.4, 0.4, 5.0]]
    g = [torch.tensor([1.0, -1.0])]
    for L in losses:
        h.step([g, g, g], L)
    cum = torch.tensor(losses, dtype=torch.float64).sum(0)
    expect = torch.exp(-eta * cum) / torch.exp(-eta * cum).sum()
    torch.testing.assert_close(h.weights, expect, rtol=1e-12, atol=0)
    assert h.weights.sum().item() == pytest.approx(1.0, abs=1e-12)
    # members moved by lr_i * (g + g + g) (optimistic, constant g => 3 steps of g): average
    for i, lr in enumerate(lrs):
        torch.testing.assert_close(h.members[i][0], -3 * lr * g[0])
    avg = sum(w * (-3 * lr * g[0]) for w, lr in zip(h.weights.tolist(), lrs))
    torch.testing.assert_close(ps[0], avg.float())


def test_hedge_log_sum_exp_is_stable():
    h = HedgeEnsemble([torch.zeros(1)], [1e-3, 1e-2], eta=1.0)
    g = [torch.zeros(1)]
    h.step([g, g], [1e5, 1e5 + 2.0])  # exp(-1e5) underflows without log-sum-exp
    w = h.weights
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w[0] / w[1], torch.tensor(math.e ** 2, dtype=torch.float64))


def test_hedge_closure_measures_loss_before_update_and_restores_on_failure():
    x = [torch.zeros(1)]
    h = HedgeEnsemble(x, [0.1, 1.0], eta=1.0, member_factory=lambda q, lr: Optimistic(
        q, lr=lr, precondition="none"))
    seen = []

    def closure():  # loss (x - 1)^2, evaluated at the member's current weights
        seen.append(x[0].item())
        return (x[0].item() - 1) ** 2, [2 * (x[0] - 1)]

    h.step_closure(closure)
    assert seen == [0.0, 0.0]  # both members evaluated at their pre-update weights
    assert h.cum_loss.tolist() == [1.0, 1.0]
    before = [m[0].clone() for m in h.members]
    served = x[0].clone()

    def failing():
        if len(seen) >= 3:  # the second member fails, after the first was evaluated
            raise RuntimeError("boom")
        return closure()

    with pytest.raises(RuntimeError):
        h.step_closure(failing)
    assert all(torch.equal(m[0], b) for m, b in zip(h.members, before))
    assert torch.equal(x[0], served) and h.cum_loss.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("make", [
    lambda ps: OGD(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: Optimistic(ps, lr=1e-2),
    lambda ps: OptimisticMomentum(ps, lr=1e-2),
    lambda ps: HedgeEnsemble(ps, [3e-3, 1e-2, 3e-2], eta=0.5),
    lambda ps: HedgeEnsemble(ps, [3e-3, 1e-2, 3e-2], eta=0.5, share=0.05),
])
def test_state_dict_round_trip(make):
    a_params, b_params = params(), params()
    a, b = make(a_params), make(b_params)
    stream = grads_stream(8)
    for gs in stream[:5]:
        a.step_closure(lambda gs=gs: (float(gs[0].sum()), gs))
    sd = a.state_dict()
    for gs in stream[5:]:  # state_dict is a snapshot, not a live view
        a.step_closure(lambda gs=gs: (float(gs[0].sum()), gs))
    # restore b to the snapshot (params are the caller's: copy them too), replay the tail
    a2_params = params()
    a2 = make(a2_params)
    for gs in stream[:5]:
        a2.step_closure(lambda gs=gs: (float(gs[0].sum()), gs))
    with torch.no_grad():
        for p, q in zip(b_params, a2_params):
            p.copy_(q)
    b.load_state_dict(sd)
    for gs in stream[5:]:
        b.step_closure(lambda gs=gs: (float(gs[0].sum()), gs))
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)


def test_load_state_dict_rejects_mismatch():
    a = OGD(params(), lr=1e-2)
    a.step(grads_stream(1)[0])
    with pytest.raises(ValueError):
        Optimistic(params(), lr=1e-2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError):
        OGD(params(shapes=((2, 2), (4,))), lr=1e-2).load_state_dict(a.state_dict())


@pytest.mark.parametrize("algorithm", ["ogd", "optimistic", "optimistic_momentum", "ensemble"])
def test_reduces_online_regression_loss(algorithm):
    """Online linear regression on a stream from a fixed teacher: each rule must drive the
    loss on fresh samples well below where it started."""
    torch.manual_seed(0)
    d = 8
    w_true = torch.randn(d, 1)
    model = torch.nn.Linear(d, 1)
    ps = list(model.parameters())
    cfg = OnlineSpecConfig.from_any({"update": {"algorithm": algorithm, "lr": 3e-2,
                                                "ensemble_lrs": [1e-2, 3e-2, 1e-1],
                                                "hedge_lr": 0.5}})
    alg = make_algorithm(cfg, ps)

    def batch_loss(x, y):
        return torch.nn.functional.mse_loss(model(x), y)

    losses = []
    for t in range(300):
        x = torch.randn(16, d)
        y = x @ w_true + 0.01 * torch.randn(16, 1)

        def closure():
            loss = batch_loss(x, y)
            return loss.item(), torch.autograd.grad(loss, ps)

        losses.append(alg.step_closure(closure))
    first, last = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    assert last < 0.05 * first, (first, last)


def test_make_algorithm_types():
    ps = params()
    for name, cls in [("ogd", OGD), ("optimistic", Optimistic),
                      ("optimistic_momentum", OptimisticMomentum), ("ensemble", HedgeEnsemble)]:
        alg = make_algorithm(OnlineSpecConfig.from_any({"update": {"algorithm": name}}), ps)
        assert type(alg) is cls
    h = make_algorithm(OnlineSpecConfig.from_any({"update": {"algorithm": "ensemble"}}), ps)
    assert h.lrs == [3e-5, 1e-4, 3e-4]


def drift_losses(rounds_before: int, rounds_after: int) -> list[list[float]]:
    """Member 0 is the best for `rounds_before` rounds, then member 2 is (noisy, bounded)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for t in range(rounds_before + rounds_after):
        best = 0 if t < rounds_before else 2
        base = [1.0, 0.8, 1.0]
        base[best] = 0.2
        out.append([b + 0.1 * float(torch.rand(1, generator=g)) for b in base])
    return out


def hedge_after(losses, share: float, eta: float = 0.5) -> tuple[HedgeEnsemble, list[int]]:
    h = HedgeEnsemble([torch.zeros(1)], [1e-3, 1e-2, 1e-1], eta=eta, share=share)
    g = [torch.zeros(1)]
    leader = []
    for L in losses:
        h.step([g, g, g], L)
        leader.append(int(h.weights.argmax()))
    return h, leader


def test_fixed_share_follows_drift_plain_hedge_cannot():
    """300 rounds with member 0 best, then member 2 best. Fixed share moves the weight to the
    new best member within ~20 rounds; plain Hedge stays on the old leader for as long as it
    takes the cumulative losses to cross (about the 300 rounds it led)."""
    before, after = 300, 60
    losses = drift_losses(before, after)
    shared, lead_shared = hedge_after(losses, share=0.01)
    plain, lead_plain = hedge_after(losses, share=0.0)
    assert lead_shared[before - 1] == 0 and lead_plain[before - 1] == 0
    switch = next(t for t in range(before, before + after) if lead_shared[t] == 2) - before
    assert switch <= 20, switch
    assert shared.weights[2] > 0.9 and shared.weights.min() >= 0.01 / 3 * 0.99
    assert lead_plain[-1] == 0 and plain.weights[2] < 1e-6  # collapsed: cannot follow
    torch.testing.assert_close(shared.weights.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_fixed_share_one_round_closed_form():
    h = HedgeEnsemble([torch.zeros(1)], [0.1, 0.2], eta=2.0, share=0.1)
    g = [torch.zeros(1)]
    h.step([g, g], [1.0, 0.0])
    w = torch.tensor([math.exp(-2.0), 1.0], dtype=torch.float64)
    w = w / w.sum()
    torch.testing.assert_close(h.weights, 0.9 * w + 0.1 / 2, rtol=1e-12, atol=0)


def test_hedge_loads_checkpoints_from_before_fixed_share():
    """Old state dicts: `eps` instead of `eta`, no `share`, no `log_weights` (weights were a
    function of cum_loss). They load, keep their weights, and then follow this ensemble's
    share."""
    ps = params()
    h = HedgeEnsemble(ps, [1e-2, 3e-2], eta=0.5, share=0.05)
    sd = h.state_dict()
    old = {k: v for k, v in sd.items() if k not in ("eta", "share", "log_weights")}
    old["eps"] = 0.7
    old["cum_loss"] = torch.tensor([3.0, 1.0], dtype=torch.float64)
    h2 = HedgeEnsemble(params(), [1e-2, 3e-2], eta=0.5, share=0.05)
    h2.load_state_dict(old)
    assert h2.eta == 0.7 and h2.share == 0.05
    expect = torch.softmax(-0.7 * torch.tensor([3.0, 1.0], dtype=torch.float64), dim=0)
    torch.testing.assert_close(h2.weights, expect, rtol=1e-12, atol=0)
    # new checkpoints round-trip share and weights exactly
    h3 = HedgeEnsemble(params(), [1e-2, 3e-2], eta=0.1, share=0.0)
    h3.load_state_dict(h2.state_dict())
    assert h3.share == 0.05 and torch.equal(h3.log_weights, h2.log_weights)


def test_make_algorithm_passes_hedge_share_and_eta():
    cfg = OnlineSpecConfig.from_any({"update": {"algorithm": "ensemble", "hedge_lr": 0.3,
                                                "hedge_share": 0.02}})
    h = make_algorithm(cfg, params())
    assert h.eta == 0.3 and h.share == 0.02
    assert OnlineSpecConfig.from_any({}).update.hedge_share == 0.01


def test_all_finite_finds_any_inf_or_nan_in_any_tensor():
    from vllm_onlinespec.learner.algorithms import all_finite

    ts = [torch.randn(100, 7), torch.randn(3), torch.randn(2, 2, 2).bfloat16()]
    assert all_finite(ts) and all_finite([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for j in range(len(ts)):
            broken = [t.clone() for t in ts]
            broken[j].view(-1)[-1] = bad
            assert not all_finite(broken), (bad, j)
    mixed = [torch.tensor([float("inf"), float("-inf")])]  # sums to nan, still caught
    assert not all_finite(mixed)


def test_undo_buffers_are_reused_and_restores_stay_exact():
    """The snapshot copies live in buffers the next update reuses (no allocation per update),
    and a failed step still restores the previous update's result bit for bit."""
    ps = params()
    alg = OGD(ps, lr=1e-2)
    stream = grads_stream(4)
    alg.step_closure(lambda: (0.0, stream[0]))  # creates the Adam moments (lazy slots)
    alg.step_closure(lambda: (0.0, stream[3]))
    bufs = [b.data_ptr() for b in alg._undo_buffers]
    assert len(bufs) == 3 * len(ps)  # p, exp_avg, exp_avg_sq of each parameter
    before = [p.clone() for p in ps]
    state = [{k: v.clone() for k, v in st.items()} for st in alg.state]

    def fail():
        raise NonFiniteUpdate("refused")

    with pytest.raises(NonFiniteUpdate):
        alg.step_closure(lambda: (0.0, stream[1]), check=fail)
    assert [b.data_ptr() for b in alg._undo_buffers] == bufs
    assert all(torch.equal(a, b) for a, b in zip(ps, before))
    assert all(torch.equal(st[k], v) for st, old in zip(alg.state, state) for k, v in old.items())
    assert alg.t == 2
    alg.step_closure(lambda: (0.0, stream[2]))
    assert [b.data_ptr() for b in alg._undo_buffers] == bufs and alg.t == 3
