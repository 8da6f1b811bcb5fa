"""The rejection sampler's recovery noise drawn only for requests with drafts
(serving/compat/recovery_noise.py), against vLLM's own `sample_recovered_tokens`, without an
engine: seeded requests recover the same tokens and leave their generators in the same state,
a step without drafts draws nothing, unseeded rows keep vLLM's distribution, outside `ours()`
vLLM's function runs, and a lean draw that raises leaves vLLM's own to draw (counted)."""

import random
from types import SimpleNamespace

import pytest
import torch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform

    from vllm_onlinespec.serving.compat import recovery_noise as R

    current_platform.register_triton_kernel_overrides()  # the CPU kernels, as a worker has them
    from vllm.v1.sample import rejection_sampler

    assert R.install()
    return rejection_sampler


def vllm_own(rs):
    return rs.sample_recovered_tokens._onlinespec_vllm


def step(counts, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    drafts = torch.randint(0, vocab, (n,), generator=g)
    probs = torch.softmax(torch.randn(n, vocab, generator=g) * 3, -1)
    return cu, drafts, probs


def generators(rows, base):
    return {i: torch.Generator().manual_seed(base + i) for i in rows}


def test_seeded_rows_recover_vllms_tokens_and_consume_the_same_randomness(rs):
    from vllm_onlinespec.serving.compat import recovery_noise as R

    rng = random.Random(0)
    for trial in range(30):
        b = rng.randint(1, 7)
        counts = [rng.choice([0, 0, 1, 3, 5]) for _ in range(b)]
        seeded = [i for i in range(b) if rng.random() < 0.6]
        cu, drafts, probs = step(counts, 64, trial)
        own = SimpleNamespace(generators=generators(seeded, 100 * trial))
        lean = SimpleNamespace(generators=generators(seeded, 100 * trial))
        want = vllm_own(rs)(5, counts, cu, drafts, None, probs, own, CPU)
        with R.ours():
            got = rs.sample_recovered_tokens(5, counts, cu, drafts, None, probs, lean, CPU)
        starts = [0, *cu.tolist()]
        for i in seeded:
            assert torch.equal(got[starts[i]:starts[i + 1]], want[starts[i]:starts[i + 1]]), (
                trial, counts, seeded, i)
            assert torch.equal(own.generators[i].get_state(), lean.generators[i].get_state())


def test_a_step_without_drafts_draws_no_noise(rs):
    from vllm_onlinespec.serving.compat import recovery_noise as R

    counts = [0, 0, 0, 0]
    cu, drafts, probs = step(counts, 49152, 1)
    gens = generators([1, 3], 7)
    states = {i: g.get_state() for i, g in gens.items()}
    global_state = torch.get_rng_state()
    drawn = R.COUNTS["drawn_rows"]
    with R.ours():
        out = rs.sample_recovered_tokens(0, counts, cu, drafts, None, probs,
                                         SimpleNamespace(generators=gens), CPU)
    assert out.shape == (0,)
    assert R.COUNTS["drawn_rows"] == drawn
    assert torch.equal(torch.get_rng_state(), global_state)
    assert all(torch.equal(gens[i].get_state(), states[i]) for i in gens)


def test_unseeded_rows_keep_vllms_distribution(rs):
    """Without draft probabilities the recovered token is a sample of the target's
    distribution with the draft token removed (the kernel masks it)."""
    from vllm_onlinespec.serving.compat import recovery_noise as R

    vocab, rows = 4, 6000
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = [1 if i % 3 else 0 for i in range(rows)]  # every third request has no draft
    n = sum(counts)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    drafts = torch.zeros(n, dtype=torch.int64)  # token 0 drafted: recovered ~ p[1:] renormalised
    torch.manual_seed(0)
    with R.ours():
        out = rs.sample_recovered_tokens(1, counts, cu, drafts, None, p.expand(n, vocab).clone(),
                                         SimpleNamespace(generators={}), CPU)
    freq = torch.bincount(out, minlength=vocab).double() / n
    want = torch.tensor([0.0, 0.5, 1 / 3, 1 / 6], dtype=torch.float64)
    sigma = (want * (1 - want) / n).sqrt()
    assert freq[0] == 0
    assert ((freq - want).abs() <= 4 * sigma + 1e-12).all(), (freq, want)


def test_outside_ours_vllms_own_function_runs(rs):
    from vllm_onlinespec.serving.compat import recovery_noise as R

    counts = [2, 0]
    cu, drafts, probs = step(counts, 16, 3)
    before = dict(R.COUNTS)
    rs.sample_recovered_tokens(2, counts, cu, drafts, None, probs,
                               SimpleNamespace(generators={}), CPU)
    assert R.COUNTS == before
    with R.ours():
        rs.sample_recovered_tokens(2, counts, cu, drafts, None, probs,
                                   SimpleNamespace(generators={}), CPU)
    assert R.COUNTS["drawn_rows"] == before["drawn_rows"] + 1
    assert R.COUNTS["vllm_rows"] == before["vllm_rows"] + 2


def test_a_lean_draw_that_raises_falls_back_to_vllms_own(rs, monkeypatch):
    from vllm_onlinespec.serving.compat import recovery_noise as R

    counts = [2, 1]
    cu, drafts, probs = step(counts, 16, 4)
    gens = generators([0, 1], 40)

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(R, "lean_sample_recovered_tokens", boom)
    before = R.COUNTS["errors"]
    with R.ours():
        got = rs.sample_recovered_tokens(2, counts, cu, drafts, None, probs,
                                         SimpleNamespace(generators=gens), CPU)
    want = vllm_own(rs)(2, counts, cu, drafts, None, probs,
                        SimpleNamespace(generators=generators([0, 1], 40)), CPU)
    assert R.COUNTS["errors"] == before + 1
    assert torch.equal(got, want)  # vLLM's own draw, from the same generators
