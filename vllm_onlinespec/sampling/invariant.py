"""Drafter-invariant sampling: the token at each position fixed by (seed, position) alone.

Gumbel-max with public randomness (Daliri, Musco, Suresh 2024, "Coupling without Communication
and Drafter-Invariant Speculative Decoding", arXiv 2408.07978): with noise G[v] drawn from a
counter-based stream keyed by (request seed, absolute position, token id), the target's token is
argmax_v(log p[v] + G[v]), an exact sample of p. A draft token is accepted iff it equals that
token, so what is emitted never depends on the drafter, K, a cut or a lookup draft: only on the
seed and the target's (processed) logits. A drafter that drafts argmax(log q + G) with the same
noise matches with probability >= (1 - TV) / (1 + TV).

Pure functions of tensors; the serving layer supplies the processed logits (after temperature,
top-k/top-p and every other logits processor), the seeds and the positions. Not yet wired into
vLLM's sampler.
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


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float64 uniforms in (0, 1), a pure function of (seed, position, token id):
    the same on any device, batch composition or call order."""
    row = splitmix64(splitmix64(seeds.to(torch.int64)) ^ positions.to(torch.int64))
    z = splitmix64(row[:, None] + torch.arange(vocab, dtype=torch.int64,
                                               device=row.device)[None, :] * _GOLDEN)
    # The top 53 bits, centred in their interval: never exactly 0 or 1.
    return (_shr(z, 11).to(torch.float64) + 0.5) * (2.0 ** -53)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] standard Gumbel noise keyed like uniform_noise."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))


def invariant_tokens(logits: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """[R] tokens, row r an exact sample of softmax(logits[r]) fixed by (seeds[r],
    positions[r]). `logits` are the processed ones (temperature applied; -inf where a processor
    excluded a token, which then never wins)."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return torch.argmax(logp + gumbel_noise(seeds, positions, logits.shape[-1]), dim=-1)


def accepted_lengths(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """[R] accepted draft tokens per row: the length of the prefix of drafts [R, K] equal to the
    target's invariant tokens at the same positions [R, >= K]."""
    k = drafts.shape[1]
    same = (drafts == target_tokens[:, :k]).to(torch.int64)
    return torch.cumprod(same, dim=1).sum(dim=1)
