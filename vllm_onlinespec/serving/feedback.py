"""Verification feedback: one engine step's target tensors -> one FeedbackRecord per request.

Rows of a request in a step are [last committed token, its drafts...] (or prompt chunk rows).
After verification the first 1 + accepted rows are committed: their aux features become context
for future blocks and their final hidden states give the target's distribution for the next
position. Rejected draft rows are dropped; the bonus token arrives as next step's first row.

On a GPU the rows are gathered on the device and copied into pinned host memory without
blocking the serving thread: the gather index goes up from pinned memory, every download
(features, ids, each record's first position: vLLM 0.32 keeps `positions` on the GPU only) is a
non-blocking copy, and nothing between them and the event recorded after them reads a device
value on the host. The step's feedback is handed on one step later (FeedbackPipe), when those
copies have long finished; only then are the records' start positions read. On CPU the copy is
an ordinary gather, handed on at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_onlinespec.learner.buffer import FeedbackRecord
from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving import guard as G
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


@dataclass
class StepFeedback:
    """One step's records and the requests that finished in it, usable once `ready` fired."""

    records: list[FeedbackRecord]
    finished: list[str] = field(default_factory=list)
    ready: Any = None  # CUDA event recorded after the device-to-host copies; None: usable now
    # Each record's start position, a host tensor being copied until `ready` fires (the
    # records carry -1 until then); None: the records have theirs.
    starts: torch.Tensor | None = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        if self.starts is not None:
            for rec, pos in zip(self.records, self.starts.tolist()):
                rec.start_pos = pos
            self.starts = None


class FeedbackPipe:
    """Hands each step's feedback on: at once when its copies were synchronous, one step later
    when they were issued asynchronously, so the serving thread never waits for a copy it has
    just started (by the next step it has long finished and `wait` returns at once)."""

    def __init__(self) -> None:
        self._held: StepFeedback | None = None

    def submit(self, fb: StepFeedback) -> list[StepFeedback]:
        out = [self._held] if self._held is not None else []
        self._held = None
        if fb.ready is None:
            out.append(fb)
        else:
            self._held = fb
        for f in out:
            f.wait()
        return out

    def flush(self) -> list[StepFeedback]:
        """What is held, ready (shutdown: nothing may be lost)."""
        out, self._held = ([self._held] if self._held is not None else []), None
        for f in out:
            f.wait()
        return out

    def drop(self) -> int:
        """Forget what is held (the target's weights changed); returns the records dropped."""
        n = len(self._held.records) if self._held is not None else 0
        self._held = None
        return n


def _to_host(t: torch.Tensor, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """t on the CPU in dtype; from a CUDA tensor with `pinned`, an asynchronous copy into page-
    locked memory (valid once an event recorded after it has fired)."""
    if not pinned or t.device.type != "cuda":
        return t.to("cpu", dtype)
    out = torch.empty(t.shape, dtype=dtype, pin_memory=True)
    out.copy_(t.to(dtype), non_blocking=True)
    return out


def _to_device(idx: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    """A host index on `device`; with `pinned`, staged in page-locked memory and copied without
    blocking (a pageable host-to-device copy waits for the stream)."""
    if not pinned or device.type != "cuda":
        return idx.to(device)
    staged = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    staged.copy_(idx)
    return staged.to(device, non_blocking=True)


def records_from_step(view: StepView, accepted: list[int], version: int,
                      feature_dtype: torch.dtype | None = None,
                      async_copy: bool = False) -> StepFeedback:
    """Copy what the learner needs out of the runner's reused buffers. Call it outside
    inference mode: tensors made inside it can never join an autograd graph. `version`: the
    drafter version that proposed the drafts this step verified (each record's tag).
    `async_copy` (CUDA views only): the copies do not block; the result's `ready` event says
    when its tensors are valid, and `wait()` fills the records' start positions."""
    if not view.aux_hidden_states:
        return StepFeedback([])
    rows = [(i, s, k) for i, (s, k) in enumerate(committed_rows(view, accepted)) if k > 0]
    if not rows:
        return StepFeedback([])
    dtype = feature_dtype or view.hidden_states.dtype
    pinned = async_copy and view.hidden_states.device.type == "cuda"
    # One gather per tensor for the whole batch, then cheap splits per request. index_select
    # already copies; the buffer clones each request's slice on push. The indices go up once
    # per device (vLLM's input ids may be its host buffer while the states are on the GPU).
    committed = torch.cat([torch.arange(s, s + k) for _, s, k in rows])
    firsts = torch.tensor([s for _, s, _ in rows])
    up: dict[tuple[int, torch.device], torch.Tensor] = {}

    def pick(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if (id(idx), t.device) not in up:
            up[id(idx), t.device] = _to_device(idx, t.device, pinned)
        return t.index_select(0, up[id(idx), t.device])

    aux = _to_host(torch.cat([pick(h, committed) for h in view.aux_hidden_states], dim=-1),
                   dtype, pinned)
    fin = _to_host(pick(view.hidden_states, committed), dtype, pinned)
    ids = _to_host(pick(view.input_ids, committed), torch.long, pinned)
    starts = _to_host(pick(view.positions, firsts), torch.long, pinned)
    ready = None
    if pinned:
        ready = torch.cuda.Event()
        ready.record()
    records, off = [], 0
    for i, _, k in rows:
        drafted = view.num_draft_tokens[i] if view.num_draft_tokens is not None else 0
        records.append(FeedbackRecord(
            req_id=view.req_ids[i], token_ids=ids[off:off + k], start_pos=-1,
            aux=aux[off:off + k], target_hidden=fin[off:off + k], num_draft=drafted,
            num_accepted=accepted[i] if drafted else 0, drafter_version=version))
        off += k
    fb = StepFeedback(records, ready=ready, starts=starts)
    if ready is None:
        fb.wait()  # host copies: the positions are there now
    return fb


class FeedbackStage:
    """One step's verification -> the verify-length policy's statistics, the draft tracer, and
    the committed rows -> the feature log and the learner's buffer (then the learner is
    woken). `learner` / `buffer` / `feature_log` / `tracer` may be None."""

    def __init__(self, cutter: Any, lookup: Any, tracer: Any, feature_log: Any, learner: Any,
                 buffer: Any, guard: Any) -> None:
        self.cutter, self.lookup, self.tracer = cutter, lookup, tracer
        self.feature_log, self.learner, self.buffer, self.guard = feature_log, learner, buffer, guard
        self.pipe = FeedbackPipe()  # a step's feedback, held one step on GPU
        self.last_yield: int | None = None  # tokens the last step produced (None: unknown)
        self.last_accepted: list[int] | None = None  # its accepted drafts per request (rows)

    def observe(self, view: StepView | None, sampled: Any, drafted_by: int) -> None:
        """drafted_by: the drafter version that proposed the drafts this step verified (vLLM
        drafts at the end of a step, before that step's publish)."""
        self.last_yield = self.last_accepted = None
        if view is None:
            return
        if self.lookup is not None:  # before any early return: finished texts must not pile up
            self.lookup.finish(view.finished_req_ids)
        if sampled is None:
            self.guard.skip(G.NO_SAMPLER_OUTPUT)
            return
        accepted = compat.accepted_counts(sampled, view.num_draft_tokens)
        self.last_yield = len(accepted) + sum(accepted)  # tokens this step produced
        self.last_accepted = accepted
        self.cutter.observe(self._drafter_rows(view, accepted), accepted, view.req_ids)
        self.cutter.forget(view.finished_req_ids)
        if self.tracer is not None:
            self.tracer.record(view, accepted, sampled)
        if self.buffer is None and self.feature_log is None:
            return
        with torch.inference_mode(False):  # the learner trains on these: no inference tensors
            fb = records_from_step(view, accepted, drafted_by, async_copy=not compat.is_cpu())
        fb.finished = list(view.finished_req_ids)
        self.deliver(self.pipe.submit(fb))

    def deliver(self, ready: list[StepFeedback]) -> None:
        for fb in ready:
            for rec in fb.records:
                if self.feature_log is not None:
                    self.feature_log.add(rec.req_id, rec.start_pos, rec.token_ids, rec.aux,
                                         rec.target_hidden)
                if self.buffer is not None:
                    self.buffer.push(rec)
            if self.buffer is not None:
                for rid in fb.finished:
                    self.buffer.finish(rid)
        if self.buffer is not None and ready:
            self.learner.notify()

    def _drafter_rows(self, view: StepView, accepted: list[int]) -> list[int] | None:
        """Draft tokens verified per request, 0 where prompt lookup drafted (counted apart):
        the verify-length policy and the head score the drafter's blocks only."""
        if self.lookup is None:
            return view.num_draft_tokens
        return self.lookup.drafter_rows(view.req_ids, view.num_draft_tokens, accepted)
