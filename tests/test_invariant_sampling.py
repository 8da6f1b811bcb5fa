"""sampling/invariant.py: Gumbel-max sampling keyed by (seed, position): exact in distribution,
reproducible, and independent of what was drafted."""

import math

import torch

import pytest

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.sampling.invariant import (PLACEHOLDER, accepted_lengths, invariant_tokens,
                                                keyed_gumbel, row_keys, splitmix64, verify_rows)


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
    ids = torch.arange(-5, 50)  # block ids (< 0) and token ids
    a = keyed_gumbel(row_keys(torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3]))[:, None], ids)
    b = keyed_gumbel(row_keys(torch.tensor([8, 7]), torch.tensor([3, 3]))[:, None], ids)
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])  # other batch, other order
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert bool(torch.isfinite(a).all())
    # standard Gumbel: mean Euler-Mascheroni (0.5772), variance pi^2 / 6
    g = keyed_gumbel(row_keys(torch.tensor([1]), torch.tensor([0]))[:, None],
                     torch.arange(200_000)).flatten()
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.var()) - math.pi ** 2 / 6) < 0.03


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


def test_tokens_across_vocabulary_blocks_follow_the_target_distribution():
    # A vocabulary of several sampling blocks (256 tokens each): the block is drawn by its mass,
    # then a token in it. Mass spread over 12 tokens in 4 blocks (one token alone in its
    # block, two blocks with several) plus a tail of 1000 near-impossible tokens.
    torch.manual_seed(2)
    vocab = 1100
    logits = torch.full((vocab,), -12.0)
    hot = torch.tensor([3, 7, 200, 255, 256, 300, 511, 700, 701, 702, 1050, 1099])
    logits[hot] = torch.randn(len(hot)) * 1.2
    logits[5] = -math.inf
    n = 20_000
    toks = invariant_tokens(logits.expand(n, -1), torch.arange(n) + 10_000, torch.full((n,), 9))
    p = torch.softmax(logits.double(), -1)
    counts = torch.bincount(toks, minlength=vocab).double()
    assert counts[5] == 0
    expected = n * p[hot]
    chi2 = float(((counts[hot] - expected) ** 2 / expected).sum())
    tail = float(counts.sum() - counts[hot].sum())
    assert chi2 < 32.9, chi2  # 11 degrees of freedom, p = 0.001
    assert abs(tail - n * float(1 - p[hot].sum())) < 5 * math.sqrt(n * float(1 - p[hot].sum())) + 3


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


def test_verify_rows_accept_the_matching_prefix_then_the_invariant_token():
    # request 1: drafts [5, 6, 7], tokens at its 4 positions [5, 6, 9, 3]: 2 accepted, then 9;
    # request 2: no drafts (a plain step or a cut to 0): its one token;
    # request 3: every draft matches: all of them and the bonus position's token.
    rows = verify_rows([[5, 6, 7], [], [1, 2]], [5, 6, 9, 3, 4, 1, 2, 8], width=4)
    assert rows == [[5, 6, 9, PLACEHOLDER], [4, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER],
                    [1, 2, 8, PLACEHOLDER]]
    with pytest.raises(ValueError, match="positions"):
        verify_rows([[5]], [5, 6, 7], width=4)
    with pytest.raises(ValueError, match="width"):
        verify_rows([[5, 6]], [5, 6, 7], width=2)


def test_the_mode_follows_what_changes_drafts():
    def mode(d):
        return OnlineSpecConfig.from_any(d).invariant_sampling

    assert mode({}) == "all"  # learning on, one rank: unseeded requests too
    assert mode({"enabled": False, "length_head": {"policy": "fixed"}}) == "off"
    assert mode({"enabled": False, "length_head": {"policy": "budget"}}) == "all"
    assert mode({"enabled": False, "length_head": {"policy": "fixed"},
                 "prompt_lookup": {"enabled": True}}) == "all"
    assert mode({"sampling": {"invariant": "all"}}) == "all"
    assert mode({"sampling": {"invariant": "seeded"}}) == "seeded"
    # under tensor parallelism an unseeded request's per-process seed would differ by rank
    assert OnlineSpecConfig.from_any({}).invariant_mode(tensor_parallel_size=2) == "seeded"
    assert OnlineSpecConfig.from_any({"enabled": False}).invariant_mode(2) == "off"
    with pytest.raises(ConfigError, match="sampling.invariant"):
        OnlineSpecConfig.from_any({"sampling": {"invariant": "sometimes"}})


def test_all_mode_is_refused_under_tensor_parallelism():
    from types import SimpleNamespace

    from vllm_onlinespec.serving.validate import config_from_vllm

    def vllm_config(mode, tp):
        spec = SimpleNamespace(method="dflash", num_speculative_tokens=4, draft_sample_method="greedy")
        return SimpleNamespace(speculative_config=spec,
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                               additional_config={"onlinespec": {"sampling": {"invariant": mode}}})

    assert config_from_vllm(vllm_config("all", 1)).invariant_sampling == "all"
    assert config_from_vllm(vllm_config("seeded", 2)).invariant_sampling == "seeded"
    assert config_from_vllm(vllm_config("auto", 2)).invariant_mode(2) == "seeded"  # not refused
    with pytest.raises(ConfigError, match="tensor parallelism"):
        config_from_vllm(vllm_config("all", 2))


def test_a_deterministic_draft_is_accepted_as_often_as_under_rejection_sampling():
    """A greedy (deterministic) draft d is accepted with probability p(d) under both rules:
    vLLM's rejection sampling without draft probabilities accepts iff u <= p(d) (u uniform,
    rejection_sampler.py's NO_DRAFT_PROBS path), the invariant rule iff argmax(log p + G) = d.
    Per position, and for the accepted length of two drafts: n seeds each, tolerance 4
    binomial standard errors."""
    torch.manual_seed(3)
    vocab, n = 600, 40_000  # three sampling blocks
    logits = torch.full((2, vocab), -9.0)
    logits[:, :8] = torch.randn(2, 8) * 1.5
    logits[:, 300:303] = torch.randn(2, 3)
    p = torch.softmax(logits.double(), -1)
    seeds, pos = torch.arange(n) + 77, torch.tensor([40, 41])
    inv = torch.stack([invariant_tokens(logits[j].expand(n, -1), seeds, pos[j].expand(n))
                       for j in range(2)], dim=1)  # [n, 2]
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for d in (int(p[0].argmax()), 300, 5):  # the mode, a token in another block, a rare one
        pd = float(p[0, d])
        se = math.sqrt(pd * (1 - pd) / n)
        f_inv = float((inv[:, 0] == d).double().mean())
        f_rej = float((u[:, 0] <= pd).double().mean())
        assert abs(f_inv - pd) < 4 * se and abs(f_rej - pd) < 4 * se, (d, pd, f_inv, f_rej)
        assert abs(f_inv - f_rej) < 4 * math.sqrt(2) * se, (d, f_inv, f_rej)
    # two drafts (the positions' modes): accepted length 0, 1 or 2, the same distribution
    drafts = p.argmax(-1)
    a_inv = accepted_lengths(drafts.expand(n, -1), inv).double()
    a_rej = torch.cumprod((u <= p.gather(1, drafts[:, None]).squeeze(1)).long(), 1).sum(1).double()
    p1, p2 = float(p[0, drafts[0]]), float(p[1, drafts[1]])
    probs = {0: 1 - p1, 1: p1 * (1 - p2), 2: p1 * p2}
    mean = sum(a * q for a, q in probs.items())
    var = sum(a * a * q for a, q in probs.items()) - mean ** 2
    se = math.sqrt(var / n)
    assert abs(float(a_inv.mean()) - mean) < 4 * se and abs(float(a_rej.mean()) - mean) < 4 * se
    assert abs(float(a_inv.mean() - a_rej.mean())) < 4 * math.sqrt(2) * se
