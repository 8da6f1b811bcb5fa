"""The recovered-token noise of vLLM's rejection sampler, drawn only where a draft can read it.

vLLM 0.32's `sample_recovered_tokens` (rejection_sampler.py:678) draws one vocabulary-wide
exponential row for every request of the batch (`q.exponential_()`), then redraws the seeded
requests' rows from their generators. Only a request with draft tokens reads its row (the
recovered token replaces a rejected draft), so on a step where the budget drafts nothing, or
for the requests a step leaves without drafts, all of it is thrown away, and seeded rows are
drawn twice. On a CPU that noise is the costliest part of a sampled step: 11.6 of a 120 ms
step at 8 requests and SmolLM2's 49 152-token vocabulary (a step with no drafts at all).

`lean_sample_recovered_tokens` is vLLM's function with one change: rows are drawn only for
requests with drafts (seeded ones from their generators, exactly as vLLM consumes them, so a
seeded request's output is unchanged; unseeded ones in one batched draw, the same
distribution). It is active only inside `ours()`, which this project's runner enters around its
`_sample`: any other engine in the process keeps vLLM's own.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

_STATE = threading.local()
# Noise rows drawn and rows vLLM's own function would have drawn, by this process's runner;
# lean draws that raised (vLLM's own function drew instead).
COUNTS = {"drawn_rows": 0, "vllm_rows": 0, "errors": 0}
logger = logging.getLogger("vllm_onlinespec")


def lean_sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int],
                                 cu_num_draft_tokens: torch.Tensor,
                                 draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                                 target_probs: torch.Tensor, sampling_metadata: Any,
                                 device: torch.device, use_fp64_gumbel: bool = False
                                 ) -> torch.Tensor:
    from vllm.v1.sample.rejection_sampler import _sample_recovered_tokens

    batch_size = len(num_draft_tokens)
    gens = sampling_metadata.generators
    COUNTS["vllm_rows"] += batch_size + sum(1 for i in gens if num_draft_tokens[i] > 0)
    recovered = torch.empty_like(draft_token_ids)
    if draft_token_ids.numel() == 0:
        return recovered
    q = torch.ones((batch_size, target_probs.shape[-1]),
                   dtype=torch.float64 if use_fp64_gumbel else torch.float32, device=device)
    free = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in gens]
    if len(free) == batch_size:
        q.exponential_()
    elif free:
        idx = torch.tensor(free, dtype=torch.long, device=device)
        q.index_copy_(0, idx, torch.empty((len(free), q.shape[1]), dtype=q.dtype,
                                          device=device).exponential_())
    for i, generator in gens.items():
        if num_draft_tokens[i] > 0:  # vLLM's rule: no randomness for a request without drafts
            q[i].exponential_(generator=generator)
    COUNTS["drawn_rows"] += len(free) + sum(1 for i in gens if num_draft_tokens[i] > 0)
    _sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                             target_probs, q.reciprocal(), max_spec_len=max_spec_len)
    return recovered


def install() -> bool:
    """Route vLLM's `sample_recovered_tokens` through the lean draw inside `ours()` (once per
    process). False where vLLM has no such function (another version): nothing changes."""
    from vllm.v1.sample import rejection_sampler as rs

    orig = getattr(rs, "sample_recovered_tokens", None)
    if orig is None or not hasattr(rs, "_sample_recovered_tokens"):
        return False
    if getattr(orig, "_onlinespec_lean", False):
        return True

    def sample_recovered_tokens(*args, **kwargs):
        if getattr(_STATE, "active", False):
            try:
                return lean_sample_recovered_tokens(*args, **kwargs)
            except Exception as e:  # never stops vLLM's sampler: its own draw, counted
                # (a seeded request whose generator the failed draw advanced samples this
                # step from where it stopped: a valid sample, not the reproducible one)
                COUNTS["errors"] += 1
                if COUNTS["errors"] == 1 or COUNTS["errors"] % 1000 == 0:
                    logger.warning("onlinespec: lean recovery noise failed (%s: %s; errors #%d); "
                                   "vLLM's own draw used", type(e).__name__, e, COUNTS["errors"])
        return orig(*args, **kwargs)

    sample_recovered_tokens._onlinespec_lean = True
    sample_recovered_tokens._onlinespec_vllm = orig
    rs.sample_recovered_tokens = sample_recovered_tokens
    return True


@contextmanager
def ours() -> Iterator[None]:
    """The lean draw for the rejection sampling run inside this block (this thread only)."""
    before = getattr(_STATE, "active", False)
    _STATE.active = True
    try:
        yield
    finally:
        _STATE.active = before
