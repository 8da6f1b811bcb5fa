"""Bounded, thread-safe buffer of verification feedback for the online learner.

The serving thread pushes one `FeedbackRecord` per request per engine step (the tokens it just
committed, with the target's features at those positions). The learner thread samples
`TrainingWindow`s: contiguous runs of a request's most recent tokens, ending at the newest one,
that contain tokens not yet trained on ("fresh"), so training blocks anchored before fresh
tokens still see the committed context before them.

Which tokens count. A token is *trainable* when serving ever asks the drafter to predict it and
the window holds what a block predicting it needs: it comes after the request's first
generated token (vLLM drafts only from generated tokens: prompt tokens and the first generated
token, which prefill samples, are never drafted; the offline trainer anchors the same way), and
the anchor row before it has >= CONTEXT_ROWS context rows inside the window. Every token that
arrives ends up counted exactly once as
  - context (`context_tokens`): never trainable: prompt, first generated token, window head;
  - trained (`trained_tokens`): handed to the learner as a block label (see
    sample_training_windows: a sampler that passes `max_fresh` gets only what its blocks cover);
  - dropped (`drops`): trainable but discarded before the learner took it;
  - fresh: trainable, still waiting.
Where prompt tokens end comes from `FeedbackRecord.prompt_len` when the serving layer sets it;
without it the buffer infers it: a request's leading records that drafted nothing and commit
more than one token are prefill (chunks), and the first other record starts at its first
generated token (a decode step that drafted nothing commits exactly one). A final prefill chunk
of one token is taken for a decode step: its prompt token then counts as generated.

Costs on the serving thread are O(1) per push: records are kept as-is (no concatenation) and only
the learner pays for `torch.cat` when it samples, outside the lock.

Memory is bounded three ways (config `buffer`): `window_tokens` per request, `max_tokens` and
`max_records` in total, `max_requests` requests. Over a bound, whole requests are evicted, least
recently updated first, finished ones before running ones. `drops` counts fresh tokens that were
discarded before the learner saw them (evicted, slid out of the window, or finished untrained).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import torch


@dataclass
class FeedbackRecord:
    """What one engine step taught us about one request.

    Row i of every per-token tensor belongs to `token_ids[i]` at position `start_pos + i`.
    Tensors must already be detached CPU clones (the runner's tensors are reused and live under
    inference_mode); the buffer keeps references, never copies.
    """

    req_id: str
    token_ids: torch.Tensor  # [n] int64, committed this step
    start_pos: int  # position of token_ids[0] in the request's sequence
    aux: torch.Tensor  # [n, F] the drafter's context features (concat of target aux layers)
    target_hidden: torch.Tensor | None = None  # [n, H] target final hidden (LM head input)
    num_draft: int = 0  # draft tokens verified this step
    num_accepted: int = 0  # of those, accepted
    drafter_version: int = 0  # weights version that produced the draft
    draft_hidden: torch.Tensor | None = None  # [num_draft, H] drafter post-norm block states
    # The request's prompt length in tokens (its first generated token is at this position),
    # when the serving layer knows it; None = inferred (see the module docstring).
    prompt_len: int | None = None

    def __post_init__(self) -> None:
        if self.token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D (got shape {tuple(self.token_ids.shape)})")
        n = self.token_ids.shape[0]
        if self.aux.dim() != 2 or self.aux.shape[0] != n:
            raise ValueError(f"aux must be [{n}, F] (got {tuple(self.aux.shape)})")
        if self.target_hidden is not None and (
                self.target_hidden.dim() != 2 or self.target_hidden.shape[0] != n):
            raise ValueError(f"target_hidden must be [{n}, H] (got "
                             f"{tuple(self.target_hidden.shape)})")
        if not (0 <= self.num_accepted <= self.num_draft):
            raise ValueError(f"need 0 <= num_accepted <= num_draft "
                             f"(got {self.num_accepted}, {self.num_draft})")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens

    def tail(self, n: int) -> "FeedbackRecord":
        """The last n tokens, cloned so the dropped head's storage is released."""
        k = self.num_tokens - n
        th = None if self.target_hidden is None else self.target_hidden[k:].clone()
        return replace(self, token_ids=self.token_ids[k:].clone(), start_pos=self.start_pos + k,
                       aux=self.aux[k:].clone(), target_hidden=th)

    def head(self, n: int) -> "FeedbackRecord":
        """The first n tokens (used when a request rolls back, e.g. after preemption)."""
        th = self.target_hidden
        return replace(self, token_ids=self.token_ids[:n].clone(), aux=self.aux[:n].clone(),
                       target_hidden=None if th is None else th[:n].clone())


def sequence_records(req_id: str, ids: torch.Tensor, start: int, aux: torch.Tensor,
                     final: torch.Tensor | None, k: int) -> list[FeedbackRecord]:
    """A whole answered sequence as the feedback serving would have pushed for it at K draft
    tokens per step: its prompt (ids[:start]) as one prefill record, then verify steps of K + 1
    committed tokens (nothing accepted: which drafts were right does not change the labels).
    For offline replays of the online learner (lab/)."""
    out = [FeedbackRecord(req_id, ids[:start], 0, aux[:start],
                          None if final is None else final[:start], prompt_len=start)]
    for s in range(start, len(ids), k + 1):
        e = min(s + k + 1, len(ids))
        out.append(FeedbackRecord(req_id, ids[s:e], s, aux[s:e],
                                  None if final is None else final[s:e], k, prompt_len=start))
    return out


def _owned(t: torch.Tensor | None) -> torch.Tensor | None:
    """t itself if it owns its storage, else a compact clone."""
    if t is None or t.untyped_storage().nbytes() <= t.numel() * t.element_size():
        return t
    return t.clone()


def _compact(rec: FeedbackRecord) -> FeedbackRecord:
    """Records are often row slices of one step-wide tensor: holding such a view would keep the
    whole step's storage alive and make the token bounds lie about memory. Clone those (a few
    rows each, cheap next to the step)."""
    return replace(rec, token_ids=_owned(rec.token_ids), aux=_owned(rec.aux),
                   target_hidden=_owned(rec.target_hidden), draft_hidden=_owned(rec.draft_hidden))


@dataclass
class TrainingWindow:
    """A contiguous slice of one request's context; tokens at index >= fresh_from are fresh."""

    req_id: str
    start_pos: int
    token_ids: torch.Tensor  # [T]
    aux: torch.Tensor  # [T, F]
    target_hidden: torch.Tensor | None  # [T, H], None if any record lacked it
    fresh_from: int  # first fresh index in this window
    fresh_to: int  # one past the last fresh index (< T when tokens were held back)
    records: list[FeedbackRecord]  # records overlapping the fresh range (length-head labels)
    finished: bool
    response_from: int = 0  # position (not index) of the request's first generated token

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start_pos, self.start_pos + self.token_ids.shape[0])

    @property
    def num_fresh(self) -> int:
        return self.fresh_to - self.fresh_from


# A block anchored at window row a sees the context rows < a; at least this many must exist.
CONTEXT_ROWS = 1


@dataclass
class _Request:
    records: deque = field(default_factory=deque)
    tokens: int = 0  # tokens held (sum over records)
    next_pos: int = -1  # position the next record should start at
    trained_to: int = -1  # positions < trained_to have been handed to the learner
    response_from: int = 0  # position of the first generated token (as far as known)
    response_known: bool = False  # response_from is final (prompt_len given or decode seen)
    fresh_seq: int = 0  # arrival order of the oldest fresh token, for FIFO fairness
    finished: bool = False
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def start_pos(self) -> int:
        return self.records[0].start_pos if self.records else self.next_pos

    @property
    def trainable_from(self) -> int:
        """First position a block can be trained to predict (module docstring): its anchor,
        the row before it, is a generated token with CONTEXT_ROWS rows before it."""
        return max(self.response_from + 1, self.start_pos + CONTEXT_ROWS + 1)

    def fresh_lo(self) -> int:
        return max(self.trained_to, self.trainable_from)

    def fresh(self, holdback: int = 0) -> int:
        if not self.records:
            return 0
        hi = self.next_pos - (0 if self.finished else holdback)
        return max(0, hi - self.fresh_lo())

    def note_response_start(self, rec: FeedbackRecord) -> None:
        """Learn where the prompt ends from a record about to be appended."""
        if rec.prompt_len is not None:  # the serving layer knows: authoritative
            self.response_from, self.response_known = rec.prompt_len, True
        elif self.response_known:
            pass
        elif rec.num_draft == 0 and rec.num_tokens > 1:
            # Prefill (a chunk of it): a decode step commits one token when nothing was
            # drafted. Nothing is generated yet, so the response starts after this chunk.
            self.response_from = rec.end_pos
        else:  # the first decode step: its first row is the first generated token
            self.response_from, self.response_known = rec.start_pos, True


class FeedbackBuffer:
    """Per-request sliding context windows of verification feedback, bounded and thread-safe."""

    def __init__(self, window_tokens: int = 512, max_tokens: int = 32768,
                 max_requests: int = 64, max_records: int = 16384,
                 max_versions_tracked: int = 4096) -> None:
        if window_tokens < 1 or max_tokens < window_tokens or max_requests < 1 or max_records < 1:
            raise ValueError("need 1 <= window_tokens <= max_tokens, max_requests >= 1, "
                             "max_records >= 1")
        self.window_tokens = window_tokens
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.max_records = max_records
        self._lock = threading.Lock()
        self._reqs: OrderedDict[str, _Request] = OrderedDict()  # LRU order: oldest update first
        self._seq = itertools.count()
        self._tokens = 0
        self._records = 0
        # counters (read without the lock: plain ints, a torn read is impossible in CPython)
        self.records_in = 0
        self.tokens_in = 0
        self.drops = 0  # fresh tokens discarded untrained
        self.trained_tokens = 0  # fresh tokens handed to the learner
        self.context_tokens = 0  # tokens that can never be trained on (see module docstring)
        self.evictions = 0  # requests evicted to respect a bound
        self.gaps = 0  # records whose start_pos broke the request's continuity
        self.total_drafted = 0
        self.total_accepted = 0
        self._by_version: OrderedDict[int, list[int]] = OrderedDict()
        self._max_versions = max_versions_tracked

    @classmethod
    def from_config(cls, cfg) -> "FeedbackBuffer":
        """From an OnlineSpecConfig (or its `buffer` section)."""
        b = getattr(cfg, "buffer", cfg)
        return cls(window_tokens=b.window_tokens, max_tokens=b.max_tokens,
                   max_requests=b.max_requests, max_records=b.max_records)

    # -- serving side ---------------------------------------------------------------------------
    def push(self, rec: FeedbackRecord) -> None:
        with self._lock:
            self.records_in += 1
            self.tokens_in += rec.num_tokens
            self.total_drafted += rec.num_draft
            self.total_accepted += rec.num_accepted
            v = self._by_version.setdefault(rec.drafter_version, [0, 0])
            v[0] += rec.num_draft
            v[1] += rec.num_accepted
            while len(self._by_version) > self._max_versions:
                self._by_version.popitem(last=False)

            r = self._reqs.get(rec.req_id)
            if r is None:
                r = self._reqs[rec.req_id] = _Request(next_pos=rec.start_pos,
                                                      trained_to=rec.start_pos,
                                                      response_from=rec.start_pos)
            self._reqs.move_to_end(rec.req_id)
            r.drafted += rec.num_draft
            r.accepted += rec.num_accepted
            r.steps += 1
            if rec.num_tokens == 0 or r.finished:  # stats only (late records after finish too)
                self.drops += rec.num_tokens
                self._enforce_bounds(keep=rec.req_id)
                return
            if rec.start_pos != r.next_pos:
                self.gaps += 1
                self._realign(r, rec.start_pos)
            if rec.num_tokens > self.window_tokens:  # e.g. a long prompt: keep its tail
                self.drops += rec.num_tokens - self.window_tokens
                rec = rec.tail(self.window_tokens)
            else:
                rec = _compact(rec)
            before = r.fresh()
            if before == 0:
                r.fresh_seq = next(self._seq)
            r.note_response_start(rec)
            r.records.append(rec)
            r.tokens += rec.num_tokens
            r.next_pos = rec.end_pos
            self._tokens += rec.num_tokens
            self._records += 1
            # Whatever of this record did not become fresh can never be trained on (a later
            # slide of the window that loses fresh tokens counts them as drops instead).
            self.context_tokens += rec.num_tokens - (r.fresh() - before)
            self._trim_window(r)
            self._enforce_bounds(keep=rec.req_id)

    def finish(self, req_id: str, keep_fresh: bool = True) -> None:
        """The request is done. Its untrained tokens stay until sampled (then it is released)
        unless keep_fresh is False; finished requests are the first evicted under pressure."""
        with self._lock:
            r = self._reqs.get(req_id)
            if r is None:
                return
            r.finished = True
            if not keep_fresh or r.fresh() == 0:
                self._release(req_id, count_drops=True)

    def clear(self) -> int:
        """Drop everything held (the target's weights changed: features and labels logged from
        the old target would train the drafter towards it). Requests still running start
        over with their next record, as after an eviction. Returns the fresh tokens dropped."""
        with self._lock:
            before = self.drops
            for rid in list(self._reqs):
                self._release(rid, count_drops=True)
            return self.drops - before

    # -- learner side ---------------------------------------------------------------------------
    def sample_training_windows(self, max_windows: int, min_fresh: int = 1,
                                holdback: int = 0, max_fresh: int | None = None
                                ) -> list[TrainingWindow]:
        """Up to `max_windows` windows (one per request, oldest fresh data first), each ending at
        the request's newest token and holding up to `window_tokens` tokens.

        The window's fresh range [fresh_from, fresh_to) is marked trained: that is the promise
        the caller makes by taking it, so a caller should take only what it trains on.
        `max_fresh` caps the range at the oldest `max_fresh` fresh tokens (a batcher that covers
        at most that many labels per request passes it); the rest stay fresh for later.
        `holdback` keeps the newest tokens of running requests fresh for a later update (so a
        block anchored there can see its labels); finished requests are drained (over several
        calls when capped) and then released."""
        if max_fresh is not None and max_fresh < 1:
            raise ValueError(f"max_fresh must be >= 1 (got {max_fresh})")
        picked: list[tuple[_Request, str, list[FeedbackRecord], int, int, int]] = []
        with self._lock:
            cands = [(r.fresh_seq, rid, r) for rid, r in self._reqs.items()
                     if r.fresh(holdback) >= min_fresh]
            cands.sort(key=lambda c: c[0])
            for _, rid, r in cands[:max_windows]:
                lo = r.fresh_lo()
                n = r.fresh(holdback)
                if max_fresh is not None:
                    n = min(n, max_fresh)
                picked.append((r, rid, list(r.records), r.start_pos, lo, lo + n))
                r.trained_to = lo + n
                self.trained_tokens += n
                r.fresh_seq = next(self._seq)  # whatever stays fresh queues behind the others
                if r.finished and r.fresh() == 0:
                    self._release(rid, count_drops=False)
        # Concatenate outside the lock: records are immutable once pushed.
        return [self._window(rid, recs, start, lo, hi, r.finished, r.response_from)
                for r, rid, recs, start, lo, hi in picked]

    @staticmethod
    def _window(rid: str, recs: list[FeedbackRecord], start: int, lo: int, hi: int,
                finished: bool, response_from: int) -> TrainingWindow:
        th = None
        if all(rec.target_hidden is not None for rec in recs):
            th = torch.cat([rec.target_hidden for rec in recs])
        fresh_recs = [rec for rec in recs if rec.end_pos > lo and rec.start_pos < hi]
        return TrainingWindow(
            req_id=rid, start_pos=start, token_ids=torch.cat([rec.token_ids for rec in recs]),
            aux=torch.cat([rec.aux for rec in recs]), target_hidden=th,
            fresh_from=lo - start, fresh_to=hi - start, records=fresh_recs, finished=finished,
            response_from=response_from)

    # -- statistics -----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Tokens held."""
        return self._tokens

    @property
    def num_records(self) -> int:
        return self._records

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    @property
    def fresh_tokens(self) -> int:
        """Trainable, untrained tokens held (including any a sampler would hold back)."""
        return self.fresh_count(0)

    def fresh_count(self, holdback: int = 0) -> int:
        """Trainable, untrained tokens that `sample_training_windows(..., holdback)` would hand
        out now (without a max_fresh cap)."""
        with self._lock:
            return sum(r.fresh(holdback) for r in self._reqs.values())

    def __len__(self) -> int:
        return self._tokens

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def acceptance(self, req_id: str) -> tuple[int, int] | None:
        """(drafted, accepted) summed over the request's steps, while it is held."""
        with self._lock:
            r = self._reqs.get(req_id)
            return None if r is None else (r.drafted, r.accepted)

    def acceptance_by_version(self) -> dict[int, tuple[int, int]]:
        """(drafted, accepted) per drafter version that produced the drafts."""
        with self._lock:
            return {v: (d, a) for v, (d, a) in self._by_version.items()}

    def stats(self) -> dict[str, float]:
        with self._lock:
            fresh = sum(r.fresh() for r in self._reqs.values())
            return {"size": self._tokens, "records": self._records, "requests": len(self._reqs),
                    "fresh": fresh, "records_in": self.records_in, "tokens_in": self.tokens_in,
                    "drops": self.drops, "evictions": self.evictions, "gaps": self.gaps,
                    "trained": self.trained_tokens, "context": self.context_tokens,
                    "drafted": self.total_drafted, "accepted": self.total_accepted,
                    "acceptance": self.total_accepted / max(1, self.total_drafted)}

    # -- internals (lock held) ------------------------------------------------------------------
    def _realign(self, r: _Request, start: int) -> None:
        """A record does not continue the request. Going back (preemption, recompute): cut the
        context to before `start`. Jumping ahead: the context in between is unknown, so clear."""
        lost = r.fresh()
        if start > r.next_pos or start <= r.start_pos:
            self._drop_records(r, len(r.records))
        else:
            while r.records and r.records[-1].start_pos >= start:
                old = r.records.pop()
                r.tokens -= old.num_tokens
                self._tokens -= old.num_tokens
                self._records -= 1
            if r.records and r.records[-1].end_pos > start:
                old = r.records.pop()
                keep = old.head(start - old.start_pos)
                r.records.append(keep)
                r.tokens -= old.num_tokens - keep.num_tokens
                self._tokens -= old.num_tokens - keep.num_tokens
        r.next_pos = start
        r.trained_to = min(r.trained_to, start)
        self.drops += max(0, lost - r.fresh())

    def _trim_window(self, r: _Request) -> None:
        before = r.fresh()
        while r.tokens > self.window_tokens:
            over = r.tokens - self.window_tokens
            head = r.records[0]
            if head.num_tokens <= over:
                self._drop_records(r, 1)
            else:
                r.records[0] = head.tail(head.num_tokens - over)
                r.tokens -= over
                self._tokens -= over
        self.drops += max(0, before - r.fresh())

    def _drop_records(self, r: _Request, n: int) -> None:
        for _ in range(n):
            old = r.records.popleft()
            r.tokens -= old.num_tokens
            self._tokens -= old.num_tokens
            self._records -= 1

    def _release(self, req_id: str, count_drops: bool) -> None:
        r = self._reqs.pop(req_id)
        if count_drops:
            self.drops += r.fresh()
        self._tokens -= r.tokens
        self._records -= len(r.records)

    def _enforce_bounds(self, keep: str) -> None:
        def over() -> bool:
            return (self._tokens > self.max_tokens or self._records > self.max_records
                    or len(self._reqs) > self.max_requests)

        while over() and len(self._reqs) > 1:
            victim = next((rid for rid, r in self._reqs.items() if r.finished and rid != keep),
                          None)
            if victim is None:
                victim = next(rid for rid in self._reqs if rid != keep)
            self._release(victim, count_drops=True)
            self.evictions += 1
        # One request alone can still exceed max_records (many 1-token steps): shorten it.
        r = self._reqs.get(keep)
        while r is not None and self._records > self.max_records and len(r.records) > 1:
            before = r.fresh()
            self._drop_records(r, 1)
            self.drops += max(0, before - r.fresh())
