"""sampling/invariant.py: Gumbel-max sampling keyed by (seed, position): exact in distribution,
reproducible, and independent of what was drafted."""

import math

import torch

from vllm_onlinespec.sampling.invariant import (accepted_lengths, invariant_tokens, splitmix64,
                                                uniform_noise)


def test_splitmix64_matches_the_reference_on_uint64():
    def ref(x):  # splitmix64 finaliser on Python ints modulo 2^64
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    xs = [0, 1, 2, 12345, (1 << 63) - 1, -1, -(1 << 63)]
    got = splitmix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g % (1 << 64) for g in got] == [ref(x % (1 << 64)) for x in xs]


def test_noise_is_a_function_of_seed_position_and_token_only():
    a = uniform_noise(torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3]), 50)
    b = uniform_noise(torch.tensor([8, 7]), torch.tensor([3, 3]), 50)  # other batch, other order
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert float(a.min()) > 0 and float(a.max()) < 1


def test_tokens_follow_the_target_distribution():
    # 20 000 independent draws (seeds) from fixed logits: chi-square against softmax.
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    logits[3] = -math.inf  # a token a logits processor excluded: never drawn
    n = 20_000
    toks = invariant_tokens(logits.expand(n, -1), torch.arange(n), torch.full((n,), 5))
    counts = torch.bincount(toks, minlength=12).double()
    p = torch.softmax(logits.double(), -1)
    assert counts[3] == 0
    keep = p > 0
    chi2 = float((((counts - n * p) ** 2)[keep] / (n * p)[keep]).sum())
    assert chi2 < 31.3, chi2  # chi-square, 10 degrees of freedom, p = 0.001


def test_output_does_not_depend_on_the_drafts():
    torch.manual_seed(1)
    logits = torch.randn(4, 6, 30)  # 4 requests, positions 10..15
    seeds, pos = torch.tensor([1, 2, 3, 4]), torch.arange(10, 16)
    target = torch.stack([invariant_tokens(logits[:, j], seeds, pos[j].expand(4))
                          for j in range(6)], dim=1)
    for drafts in (target[:, :5].clone(), torch.zeros(4, 5, dtype=torch.long),
                   torch.randint(0, 30, (4, 5))):
        acc = accepted_lengths(drafts, target)
        # emitted: the accepted drafts, then the target's own token at the first mismatch
        emitted = [torch.cat([drafts[r, :a], target[r, a:a + 1]]) for r, a in enumerate(acc.tolist())]
        for r, e in enumerate(emitted):
            assert torch.equal(e, target[r, :len(e)])  # always a prefix of the same sequence
    assert accepted_lengths(target[:, :5], target).tolist() == [5, 5, 5, 5]
