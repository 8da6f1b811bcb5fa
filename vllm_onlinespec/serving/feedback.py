"""Verification feedback: one engine step's target tensors -> one FeedbackRecord per request.

Rows of a request in a step are [last committed token, its drafts...] (or prompt chunk rows).
After verification the first 1 + accepted rows are committed: their aux features become context
for future blocks and their final hidden states give the target's distribution for the next
position. Rejected draft rows are dropped; the bonus token arrives as next step's first row.
"""

from __future__ import annotations

import torch

from vllm_onlinespec.learner.buffer import FeedbackRecord
from vllm_onlinespec.serving.compat.step_view import StepView


def committed_rows(view: StepView, accepted: list[int]) -> list[tuple[int, int]]:
    """(first row, number of committed rows) per request, in view.req_ids order."""
    out, start = [], 0
    for i, n in enumerate(view.num_scheduled):
        drafted = view.num_draft_tokens[i] if view.num_draft_tokens is not None else 0
        keep = n if drafted == 0 else min(n, 1 + accepted[i])
        out.append((start, keep))
        start += n
    return out


def records_from_step(view: StepView, accepted: list[int], version: int,
                      feature_dtype: torch.dtype | None = None) -> list[FeedbackRecord]:
    """Copy what the learner needs out of the runner's reused buffers. Call it outside
    inference mode: tensors made inside it can never join an autograd graph. `version`: the
    drafter version that proposed the drafts this step verified (each record's tag)."""
    if not view.aux_hidden_states:
        return []
    rows = committed_rows(view, accepted)
    take = torch.cat([torch.arange(s, s + k) for s, k in rows if k > 0]) if rows else None
    if take is None or take.numel() == 0:
        return []
    dtype = feature_dtype or view.hidden_states.dtype
    # One gather per tensor for the whole batch, then cheap splits per request.
    aux = torch.cat([h.index_select(0, take.to(h.device)) for h in view.aux_hidden_states], dim=-1)
    # index_select already copies; the buffer clones each request's slice on push.
    aux = aux.to("cpu", dtype)
    fin = view.hidden_states.index_select(0, take.to(view.hidden_states.device)).to("cpu", dtype)
    ids = view.input_ids.index_select(0, take.to(view.input_ids.device)).to("cpu", torch.long)
    pos = view.positions.index_select(0, take.to(view.positions.device)).to("cpu")
    records, off = [], 0
    for i, (_, k) in enumerate(rows):
        if k == 0:
            continue
        drafted = view.num_draft_tokens[i] if view.num_draft_tokens is not None else 0
        records.append(FeedbackRecord(
            req_id=view.req_ids[i], token_ids=ids[off:off + k], start_pos=int(pos[off]),
            aux=aux[off:off + k], target_hidden=fin[off:off + k], num_draft=drafted,
            num_accepted=accepted[i] if drafted else 0, drafter_version=version))
        off += k
    return records
