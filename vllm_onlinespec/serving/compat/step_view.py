"""Reading one engine step: runner state between execute_model and sample_tokens (V1 runner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepView:
    """What one target step saw, in input_batch row order. Tensors are views: clone to keep."""

    req_ids: list[str]
    num_scheduled: list[int]  # rows per request in the flattened batch
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    hidden_states: torch.Tensor  # [num_tokens, H], post final norm
    aux_hidden_states: list[torch.Tensor] | None  # n_layers x [num_tokens, H]
    num_draft_tokens: list[int] | None  # per request; None without spec metadata (a list of
    # zeros when a speculative engine's step verified nothing)
    finished_req_ids: set[str]


def step_view(runner: Any) -> StepView | None:
    """None when the runner kept no state for this step (gpu_model_runner.py:451 is only set
    by a step that ran the model): the caller counts that as a skipped step."""
    state = getattr(runner, "execute_model_state", None)
    if state is None:
        return None
    so = state.scheduler_output
    req_ids = list(runner.input_batch.req_ids)
    num_scheduled = [int(so.num_scheduled_tokens.get(r, 0)) for r in req_ids]
    n = sum(num_scheduled)
    sdm = state.spec_decode_metadata
    return StepView(
        req_ids=req_ids,
        num_scheduled=num_scheduled,
        input_ids=_rows(runner.input_ids, n),
        positions=_rows(runner.positions, n),
        hidden_states=state.hidden_states[:n],
        aux_hidden_states=[h[:n] for h in state.aux_hidden_states] if state.aux_hidden_states else None,
        num_draft_tokens=list(sdm.num_draft_tokens) if sdm is not None else None,
        finished_req_ids=set(getattr(so, "finished_req_ids", ()) or ()),
    )


def own_features(view: StepView) -> StepView:
    """The view with copies of its tensors, taken now: call it before vLLM's drafter runs.

    On GPU the target's `hidden_states` / `aux_hidden_states` are the output of a captured CUDA
    graph, which vLLM keeps only as weak references into the global graph pool
    (compilation/cuda_graph.py:200 `get_global_graph_pool`, :326-337 `weak_ref_tensors`); the
    drafter's graphs replay into the same pool during `propose_draft_token_ids`
    (gpu_model_runner.py:4362-4409, inside `sample_tokens`), so after the step those rows may
    hold the drafter's activations. vLLM copies the aux states itself before drafting
    (gpu_model_runner.py:4952-4993 `torch.cat`), never the final hidden states. The clones are
    queued on the current stream, ahead of the sampler's and the drafter's kernels: no host
    sync. Every scheduled row is copied (which rows commit is known only after sampling); the
    feedback then gathers the committed ones from these copies."""
    import dataclasses

    return dataclasses.replace(
        view,
        input_ids=view.input_ids.clone(),
        positions=view.positions.clone(),
        hidden_states=view.hidden_states.clone(),
        aux_hidden_states=([h.clone() for h in view.aux_hidden_states]
                           if view.aux_hidden_states else view.aux_hidden_states))


def _rows(buf: Any, n: int) -> torch.Tensor:
    """First n rows of a runner buffer: a CpuGpuBuffer (use its host side) or a plain tensor."""
    return (buf.cpu if hasattr(buf, "cpu") and not isinstance(buf, torch.Tensor) else buf)[:n]


def accepted_counts(sampled_token_ids: torch.Tensor | list, num_draft: list[int] | None) -> list[int]:
    """Accepted draft tokens per request: entries != -1 in the sampler's row, minus the bonus."""
    if isinstance(sampled_token_ids, torch.Tensor):
        valid = (sampled_token_ids != -1).sum(dim=1).tolist()
    else:
        valid = [sum(1 for t in row if t != -1) for row in sampled_token_ids]
    if num_draft is None:
        return [0] * len(valid)
    return [max(0, min(v - 1, d)) for v, d in zip(valid, num_draft)]


def draft_token_ids_type() -> type:
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds


def step_token_counts(scheduler_output: Any) -> tuple[int, int]:
    """(requests, tokens besides drafts) of a step, from vLLM's SchedulerOutput: the budget's
    estimate of the next step, whose prefill chunks are not scheduled yet (a server's prefill
    load changes slowly next to a step)."""
    B = len(scheduler_output.num_scheduled_tokens)
    spec = sum(len(v) for v in (scheduler_output.scheduled_spec_decode_tokens or {}).values())
    return B, max(B, int(scheduler_output.total_num_scheduled_tokens) - spec)


def step_admits(scheduler_output: Any) -> bool:
    """Whether a step schedules a request for the first time (sched/output.py
    `scheduled_new_reqs`)."""
    return bool(getattr(scheduler_output, "scheduled_new_reqs", None))


def tokens_left(runner: Any, req_ids: list[str]) -> list[int | None]:
    """Each request's tokens left to its max_tokens before this step samples (None: no limit
    known), from the runner's request state and the input batch's counts."""
    ib = runner.input_batch
    out: list[int | None] = []
    for r in req_ids:
        params = getattr(runner.requests.get(r), "sampling_params", None)
        limit = getattr(params, "max_tokens", None)
        i = ib.req_id_to_index.get(r)
        if limit is None or i is None:
            out.append(None)
            continue
        out.append(int(limit) - (int(ib.num_tokens_no_spec[i]) - int(ib.num_prompt_tokens[i])))
    return out


def step_req_ids(scheduler_output: Any) -> frozenset:
    """The ids of the requests a step schedules."""
    return frozenset(scheduler_output.num_scheduled_tokens)


def with_spec_tokens(scheduler_output: Any, k: int) -> Any:
    """A copy asking the drafter for k tokens (the field vLLM's dynamic K sets per step,
    sched/output.py:309, read by the runner at gpu_model_runner.py:4763). A copy: with an
    in-process executor the original is the scheduler's own object."""
    import dataclasses

    return dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=k)


def batch_req_ids(runner: Any) -> list[str]:
    """The running batch's request ids in the order vLLM's drafts will have (the input batch's
    rows; take_draft_token_ids reports `input_batch.req_ids`, gpu_model_runner.py:4681)."""
    return [r for r in runner.input_batch.req_ids if r is not None]


def tokens_before_bookkeeping(runner: Any, req_ids: list[str], sampled: Any) -> list[Any]:
    """Each request's tokens as `request_tokens` will read them after this step, from inside
    vLLM's DFlash propose call, which runs before the step's bookkeeping
    (gpu_model_runner.py:4397-4409): the committed tokens plus this step's sampled ones
    (`sampled`: [B, 1 + K] in batch order, -1 where rejected; a host copy on GPU)."""
    import numpy as np
    import torch

    rows = sampled.tolist() if isinstance(sampled, torch.Tensor) else sampled
    out = []
    for i, old in enumerate(request_tokens(runner, req_ids)):
        new = [t for t in (rows[i] if i < len(rows) else []) if t >= 0]
        out.append(np.concatenate([old, np.asarray(new, dtype=old.dtype)]) if new else old)
    return out


def request_tokens(runner: Any, req_ids: list[str]) -> list[Any]:
    """Each request's committed token ids (prompt + output, this step's sampled tokens
    included: `_bookkeeping_sync` writes them before vLLM drafts), as views of the input
    batch's host array (gpu_model_runner.py, what vLLM's own ngram proposer reads)."""
    ib = runner.input_batch
    rows = [ib.req_id_to_index[r] for r in req_ids]
    return [ib.token_ids_cpu[i, : int(ib.num_tokens_no_spec[i])] for i in rows]


def seeded_requests(runner: Any, req_ids: list[str]) -> list[bool]:
    """Whether each request carries its own seed (vLLM keeps a generator only for those,
    gpu_input_batch.py `generators`)."""
    ib = runner.input_batch
    gens = getattr(ib, "generators", None) or {}
    return [ib.req_id_to_index[r] in gens for r in req_ids]
