"""Verification of an all-greedy step on one max-with-index per row, in the model's dtype.

vLLM 0.32's RejectionSampler.forward (v1/sample/rejection_sampler.py:106) gathers the draft
rows of the target's logits, copies them to float32, clones them and takes their argmax; its
sampler does the same for the bonus rows. On CPU that is the slow way to the same tokens: over
140 rows of 49152 logits on 2 vCPUs, 24 ms in bf16 (8.3 in float32), against 2.6 ms (1.7) for
`max(dim=-1)`, whose indices are the first maximal value's, as argmax's are. Where every
request of the step is greedy and nothing rewrites logits (no logprobs, penalties,
allowed-token mask, bad words, min_tokens, thinking budget, synthetic acceptance), all the
verifier reads of the logits is each row's argmax; this path takes them in one pass over every
row, in the model's dtype (a bf16 -> float32 copy is exact), and applies vLLM's greedy rule:
each request keeps its drafts up to the first that is not its row's argmax, then the target's
token there, or the bonus row's where every draft passed. The tokens are vLLM's, bit for bit
(tests/test_greedy_verify.py, bf16 and float32, ties included); what it saves:
docs/results/greedy_verify.md. `VLLM_ONLINESPEC_GREEDY_VERIFY=0` leaves every step to vLLM
(the A/B arm suffix `+vllmgreedy`).
"""

from __future__ import annotations

import os
from typing import Any

DISABLE_ENV = "VLLM_ONLINESPEC_GREEDY_VERIFY"  # "0": vLLM's own verification in every step


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def eligible(rs: Any, sm: Any) -> bool:
    """True where vLLM's rejection sampler would read nothing of the target rows but their argmax:
    every request greedy, no logprobs, nothing that rewrites logits."""
    if not sm.all_greedy or sm.max_num_logprobs is not None or rs.synthetic_mode:
        return False
    if not sm.no_penalties or sm.allowed_token_ids_mask is not None or sm.bad_words_token_ids:
        return False
    if getattr(sm, "logprob_token_ids", None):
        return False
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    # Logits processors that can move an argmax: vLLM's min_tokens (applied to draft rows too,
    # rejection_sampler.py:350) and logit_bias (the bonus row's sampler), each idle when it
    # holds no request; any other (a user's) sends the step to vLLM's path.
    for proc in sm.logitsprocs.non_argmax_invariant:
        state = IDLE_WHEN_EMPTY.get(type(proc).__name__)
        if state is None or getattr(proc, state, None):
            return False
    return True


# vLLM's built-in non-argmax-invariant processors (v1/sample/logits_processor/builtin.py) and the
# per-request dict each keeps.
IDLE_WHEN_EMPTY = {"MinTokensLogitsProcessor": "min_toks", "LogitBiasLogitsProcessor": "biases"}


def verify(runner: Any, logits: Any, spec: Any) -> Any | None:
    """The step's SamplerOutput through the lean path, or None where the step is not eligible
    (vLLM's own path then runs)."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    rs = getattr(runner, "rejection_sampler", None)
    sm = runner.input_batch.sampling_metadata
    if rs is None or spec is None or logits is None or not eligible(rs, sm):
        return None
    best = logits.max(dim=-1).indices  # first of equal maxima, as argmax
    out = greedy_tokens(best[spec.target_logits_indices], best[spec.bonus_logits_indices],
                        spec.draft_token_ids, spec.cu_num_draft_tokens, spec.max_spec_len,
                        PLACEHOLDER_TOKEN_ID)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def greedy_tokens(target: Any, bonus: Any, drafts: Any, cu_drafts: Any, max_spec_len: int,
                  placeholder: int) -> Any:
    """vLLM's greedy rejection rule (rejection_greedy_sample_kernel) on argmax tokens:
    [requests, max_spec_len + 1] int32, each row the drafts up to the first that differs from
    the target's token at its position, then the target's token there, or the bonus token after
    a row of drafts that all passed; `placeholder` after. target [drafts]: the target's token at
    each draft position; bonus [requests]; cu_drafts [requests]: cumulative draft counts."""
    import torch

    dev = target.device
    cu = cu_drafts.to(torch.long)
    n = torch.diff(cu, prepend=cu.new_zeros(1))  # drafts per request
    start = cu - n
    miss = (drafts.to(torch.long) != target.to(torch.long)).to(torch.long)
    base = torch.cat([miss.new_zeros(1), torch.cumsum(miss, 0)])  # misses before position j
    tokens = torch.cat([target.to(torch.int32), target.new_zeros(1, dtype=torch.int32)])
    k = torch.arange(max_spec_len + 1, device=dev)
    j = (start[:, None] + k[None, :]).clamp(max=tokens.numel() - 1)  # absolute draft position
    in_draft = k[None, :] < n[:, None]
    # Output a draft position while nothing before it in its request missed: the drafts that
    # passed, then the first miss's position, where `tokens` holds the target's own token.
    keep = in_draft & (base[j] == base[start][:, None])
    all_passed = base[cu] == base[start]
    at_bonus = (k[None, :] == n[:, None]) & all_passed[:, None]
    out = torch.where(keep, tokens[j], torch.full_like(j, placeholder, dtype=torch.int32))
    return torch.where(at_bonus, bonus.to(torch.int32).reshape(-1, 1).expand_as(out), out)
