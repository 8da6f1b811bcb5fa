"""Drafter-invariant sampling: the token at each position fixed by (seed, position) alone.

Gumbel-max with public randomness (Daliri, Musco, Suresh 2024, "Coupling without Communication
and Drafter-Invariant Speculative Decoding", arXiv 2408.07978): with noise G[v] drawn from a
counter-based stream keyed by (request seed, absolute position, token id), the target's token is
argmax_v(log p[v] + G[v]), an exact sample of p (taken in two levels, a block of the vocabulary
then a token in it, so that only a few hundred noise values are drawn per position). A draft token is accepted iff it equals that
token, so what is emitted never depends on the drafter, K, a cut or a lookup draft: only on the
seed and the target's (processed) logits. A deterministic (greedy) draft d is accepted with
probability p(d), as under rejection sampling without draft probabilities. A drafter that
drafts with the same two-level noise (argmax(log q + G)) matches at a rate that depends on how
close q is to p; the paper's (1 - TV) / (1 + TV) floor is for one-level Gumbel-max over the
whole vocabulary and does not carry over to the two-level draw (a 5-token, 2-block
counterexample: TV 0.351, floor 0.480, match rate 0.444 over 20 000 seeds).

Pure functions of tensors; the serving layer supplies the processed logits (after temperature,
top-k/top-p and every other logits processor), the seeds and the positions
(serving/compat/invariant_sampling.py).
"""

from __future__ import annotations

import torch

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic on CPU).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise on int64 (multiplication wraps modulo 2^64)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


# The vocabulary is cut into blocks of _BLOCK tokens and sampled in two Gumbel-max levels: a
# block with probability its mass (Gumbel noise on the blocks' log-masses), then a token of that
# block with probability proportional to its own (noise on the block's logits). The product is
# exactly p, and a row draws noise for vocab / _BLOCK + _BLOCK keys instead of the whole
# vocabulary (448 instead of 49 152 for SmolLM2), so the cost is one logsumexp pass.
_BLOCK = 256


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int64 stream key per (seed, position)."""
    return splitmix64(splitmix64(seeds.to(torch.int64)) ^ positions.to(torch.int64))


def keyed_gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float64) for ids `ids` (token ids >= 0, block ids < 0) under
    stream keys `keys` (broadcast together): a pure function of (seed, position, id), the same
    on any device, batch composition or call order."""
    z = splitmix64(keys + ids.to(torch.int64) * _GOLDEN)
    # The top 53 bits, centred in their interval: never exactly 0 or 1.
    u = (_shr(z, 11).to(torch.float64) + 0.5) * (2.0 ** -53)
    return -torch.log(-torch.log(u))


def invariant_tokens(logits: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """[R] tokens, row r an exact sample of softmax(logits[r]) fixed by (seeds[r],
    positions[r]). `logits` are the processed ones (temperature applied; -inf where a processor
    excluded a token, which then never wins)."""
    x = logits.to(torch.float32)
    r_all, vocab = x.shape
    nb = -(-vocab // _BLOCK)
    if nb * _BLOCK != vocab:
        x = torch.nn.functional.pad(x, (0, nb * _BLOCK - vocab), value=float("-inf"))
    xb = x.view(r_all, nb, _BLOCK)
    keys = row_keys(seeds, positions).to(x.device)[:, None]
    block_ids = -1 - torch.arange(nb, device=x.device)  # negative: their own noise stream
    mass = torch.logsumexp(xb, dim=-1).double()  # log-mass per block, -inf where all excluded
    block = torch.argmax(mass + keyed_gumbel(keys, block_ids[None, :]), dim=-1)
    inner = xb[torch.arange(r_all, device=x.device), block].double()  # [R, _BLOCK]
    ids = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=x.device)[None, :]
    pick = torch.argmax(inner + keyed_gumbel(keys, ids), dim=-1)
    return ids.gather(1, pick[:, None]).squeeze(1)


def accepted_lengths(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """[R] accepted draft tokens per row: the length of the prefix of drafts [R, K] equal to the
    target's invariant tokens at the same positions [R, >= K]."""
    k = drafts.shape[1]
    same = (drafts == target_tokens[:, :k]).to(torch.int64)
    return torch.cumprod(same, dim=1).sum(dim=1)


PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: no token at this slot


def verify_rows(drafts: list[list[int]], tokens: list[int], width: int) -> list[list[int]]:
    """The sampler's output row per request: the drafts up to the first that differs from the
    invariant token at its position, then that position's invariant token, padded with
    PLACEHOLDER to `width`. `tokens` holds, request after request, the invariant tokens at the
    len(drafts) + 1 positions the request samples this step."""
    rows, off = [], 0
    for d in drafts:
        t = tokens[off:off + len(d) + 1]
        off += len(d) + 1
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        row = d[:a] + [t[a]]
        if len(row) > width:
            raise ValueError(f"{len(row)} tokens for an output row of width {width}")
        rows.append(row + [PLACEHOLDER] * (width - len(row)))
    if off != len(tokens):
        raise ValueError(f"{len(tokens)} invariant tokens for {off} positions")
    return rows
