"""Verification of an all-greedy step on one max-with-index per row, in the model's dtype.

vLLM 0.32's RejectionSampler.forward (v1/sample/rejection_sampler.py:106) gathers the draft
rows of the target's logits, copies them to float32, clones them and takes their argmax; its
sampler does the same for the bonus rows. On CPU that is the slow way to the same tokens: over
140 rows of 49152 logits on 2 vCPUs, 24 ms in bf16 (8.3 in float32), against 2.6 ms (1.7) for
`max(dim=-1)`, whose indices are the first maximal value's, as argmax's are. Where every
request of the step is greedy and nothing rewrites logits (no logprobs, penalties, allowed-token
mask, bad words, min_tokens or logit_bias in use, no other argmax-moving logits processor,
thinking budget, synthetic acceptance), all the verifier reads of the logits is each row's
argmax: this path takes them in one pass over every row in the model's dtype (a bf16 -> float32
copy is exact) and hands them to vLLM's own greedy rejection kernel, so the tokens are vLLM's,
bit for bit (tests/test_greedy_verify.py, bf16 and float32, ties included); what it saves:
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
    import torch
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, _rejection_greedy_sample

    rs = getattr(runner, "rejection_sampler", None)
    sm = runner.input_batch.sampling_metadata
    if rs is None or spec is None or logits is None or not eligible(rs, sm):
        return None
    best = logits.max(dim=-1).indices  # first of equal maxima, as argmax
    out = torch.full((len(spec.num_draft_tokens), spec.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                     dtype=torch.int32, device=logits.device)
    # vLLM's own greedy rule (rejection_sampler.py:469), on these argmax tokens.
    _rejection_greedy_sample(out, spec.cu_num_draft_tokens, spec.draft_token_ids,
                             best[spec.target_logits_indices],
                             best[spec.bonus_logits_indices].reshape(-1, 1).contiguous(),
                             None, spec.max_spec_len, None, None)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)
