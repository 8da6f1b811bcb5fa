"""Drafter-invariant verification inside vLLM's sampler (vLLM 0.32.0).

For every covered request (sampled, and seeded unless the mode is "all") the runner's `_sample`
result is rewritten: the token at each position this step samples is the Gumbel-max sample
fixed by (request seed, absolute position) (sampling/invariant.py), computed on the logits as
vLLM processes them for a draft position (penalties and bad words with the earlier drafts
counted as output, allowed token ids, min_tokens, temperature, top-k/top-p), and the request's
drafts are accepted as long as they equal those tokens. A plain step (no drafts) and the bonus
position go through the same processing as a draft position, so a position's token never
depends on whether it was drafted, by whom, or at which K.

Not covered, and left to vLLM's own sampling (counted in `fallbacks`): batches with a custom
logits processor (this module cannot tell whether it treats a draft position like the bonus
one) or with thinking-budget state (its processing has side effects). min_p and logit_bias
never reach a speculative engine (vLLM's SamplingParams refuses them). Greedy requests are
never touched. Logprobs are recomputed for the rewritten tokens (raw logprobs modes; the
processed ones are refused at start-up by validate.py).

A step's rewrite is committed only where it succeeded on every tensor-parallel rank (a vote,
all-reduce MIN over vLLM's TP CPU group): a rank that fails (e.g. out of memory on a logits
copy) makes every rank keep vLLM's own sample for that step (counted in `fallbacks` as
"rewrite failed"), so the ranks never commit different tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch

from vllm_onlinespec.sampling.invariant import invariant_tokens, verify_rows

_SAMPLING_EPS = 1e-5  # vLLM's: below it a temperature means greedy
_SEED_MASK = (1 << 63) - 1  # seeds travel as int64


def _constrained(x: torch.Tensor, counts: list[int], sm: Any) -> torch.Tensor:
    """vLLM's temperature and top-k/top-p on rows laid out `counts[i]` per batch request i
    (request-major), as its rejection sampler applies them to draft positions.

    vLLM spreads each request's parameters over its rows with `expand_kernel`, which writes at
    most MAX_SPEC_LEN (128) rows per request and leaves the rest uninitialised: at K = 128 a
    request's bonus row is its 129th. Rows past that bound are processed in further passes of
    at most MAX_SPEC_LEN rows per request; the parameters are per request, so a row's result
    does not depend on its pass."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN, apply_sampling_constraints

    def one_pass(rows: torch.Tensor, cs: list[int]) -> torch.Tensor:
        cu = torch.tensor(cs, dtype=torch.int64).cumsum(0).to(torch.int32).to(rows.device)
        return apply_sampling_constraints(rows, cu, sm)

    cap = int(MAX_SPEC_LEN)
    longest = max(counts, default=0)
    if longest <= cap:
        return one_pass(x, counts)
    starts = [0, *itertools.accumulate(counts)][:-1]
    for p in range(0, longest, cap):
        part = [min(max(c - p, 0), cap) for c in counts]
        idx = torch.tensor([s + p + j for s, n in zip(starts, part) for j in range(n)],
                           dtype=torch.long, device=x.device)
        x = x.index_copy(0, idx, one_pass(x.index_select(0, idx), part).to(x.dtype))
    return x


@dataclass
class _Pending:
    """What `before` saw of one step, for `after`."""
    rows: list[int]  # covered batch indices
    seeds: list[int]
    positions: list[int]  # absolute index of the first token each covered request samples
    drafts: list[list[int]]  # each covered request's drafts this step ([] on a plain step)
    raw: torch.Tensor | None  # [sum(len(d) + 1), V] raw logits of the covered rows, in order
    full_raw: torch.Tensor | None  # every logits row, kept only when logprobs are asked for
    error: Exception | None = None  # `before` failed on this rank: `after` votes to fall back


@dataclass
class InvariantVerifier:
    mode: str  # "seeded" or "all"
    salt: int = field(default_factory=lambda: secrets.randbits(62))
    covered_steps: int = 0  # request-steps rewritten
    replaced_steps: int = 0  # engine steps every row of which was sampled here, not by vLLM
    coupled_rows: int = 0  # request-steps whose drafts were drawn with the verifier's noise
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> request-steps not covered
    # The tensor-parallel group whose ranks must agree on each step's rewrite: "auto" resolves
    # vLLM's TP group (None without TP) at the first rewrite; tests pass one.
    group: Any = field(default="auto", repr=False)

    # -- which requests ---------------------------------------------------------------------------
    def _seed_of(self, req_id: str, generator: torch.Generator | None) -> int:
        if generator is not None:
            return int(generator.initial_seed()) & _SEED_MASK
        # "all" mode, no seed: one drawn per request (its id, salted per engine), fixed for
        # the request's lifetime across steps, preemption and K.
        h = hashlib.blake2b(req_id.encode(), digest_size=8).digest()
        return (int.from_bytes(h, "little") ^ self.salt) & _SEED_MASK

    def _skip(self, reason: str, n: int = 1) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + n

    @staticmethod
    def _position_independent(sm: Any) -> bool:
        """Whether every active logits processor is one this module processes the same at every
        position: vLLM's own (min_tokens per draft position; min_p and logit_bias never reach
        a speculative engine: SamplingParams refuses them). A custom processor or thinking-
        budget state (its processing has side effects) leaves the batch to vLLM."""
        from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                              MinPLogitsProcessor,
                                                              MinTokensLogitsProcessor)

        holder = getattr(sm, "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            return False
        known = (MinTokensLogitsProcessor, MinPLogitsProcessor, LogitBiasLogitsProcessor)
        procs = sm.logitsprocs
        return all(isinstance(p, known) for p in (*procs.argmax_invariant,
                                                  *procs.non_argmax_invariant))

    def _covered(self, batch: Any, sm: Any, count: bool = False) -> list[int]:
        """Batch indices of the requests this mode verifies invariantly this step."""
        if sm.all_greedy or sm.temperature is None:
            return []
        n = len(batch.req_ids)
        temp = sm.temperature[:n].tolist()
        rows = [i for i in range(n) if temp[i] >= _SAMPLING_EPS
                and (self.mode == "all" or i in sm.generators)]
        if rows and not self._position_independent(sm):
            if count:
                self._skip("logits processor", len(rows))
            return []
        return rows

    # -- the drafter: the same noise -------------------------------------------------------------
    def couple(self, runner: Any, proposer: Any, hidden: torch.Tensor,
               draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids with the covered requests' rows redrawn as argmax(log q + G): the drafter's
        distribution q (temperature and top-k/top-p as the request asks) under the same keyed
        noise G the verifier will use at those positions. A greedy draft is accepted with
        probability p(draft); how often a coupled one matches the verifier's token depends on
        how close q is to p (no (1 - TV) / (1 + TV) floor for this two-level draw:
        sampling/invariant.py).
        hidden: [B*K, H], the drafter's rows request-major, as vLLM samples them."""
        from vllm_onlinespec.sampling.invariant import PLACEHOLDER

        batch, sampled = runner.input_batch, getattr(runner, "_onlinespec_sampled", None)
        sm = batch.sampling_metadata
        n = len(batch.req_ids)
        if sampled is None or n == 0 or hidden.shape[0] % n or draft_ids.numel() != hidden.shape[0]:
            return draft_ids
        rows = self._covered(batch, sm)
        if not rows:
            return draft_ids
        k = hidden.shape[0] // n
        dev = hidden.device
        sel = torch.tensor([i * k + j for i in rows for j in range(k)], dtype=torch.long,
                           device=dev)
        q = proposer.model.compute_logits(hidden.index_select(0, sel)).to(torch.float32)
        covered = set(rows)
        q = _constrained(q, [k if i in covered else 0 for i in range(n)], sm)
        # The drafts follow this step's committed tokens: position = tokens before this step
        # + tokens it committed (vLLM drafts DFlash before its bookkeeping) + j.
        committed = (sampled[rows] != PLACEHOLDER).sum(dim=1).tolist()
        positions = torch.tensor([int(batch.num_tokens_no_spec[i]) + c + j
                                  for i, c in zip(rows, committed) for j in range(k)],
                                 dtype=torch.int64, device=dev)
        seeds = torch.tensor([self._seed_of(batch.req_ids[i], sm.generators.get(i))
                              for i in rows for _ in range(k)], dtype=torch.int64, device=dev)
        out = draft_ids.clone()
        out.view(-1)[sel] = invariant_tokens(q, seeds, positions).to(out.dtype)
        self.coupled_rows += len(rows)
        return out

    # -- the step ------------------------------------------------------------------------------
    def before(self, runner: Any, logits: torch.Tensor, spec: Any) -> _Pending | None:
        """Called before vLLM samples: picks the covered requests and keeps their raw logits
        (vLLM's sampler may process `logits` in place)."""
        batch = runner.input_batch
        sm = batch.sampling_metadata
        if getattr(runner, "rejection_sampler", None) is None:
            return None
        rows = self._covered(batch, sm, count=True)
        if not rows:
            return None
        # From here on a failure (e.g. out of memory on the copies) is not raised but carried
        # to `after`, which every rank then reaches: the rows above are a function of the batch,
        # the same on every TP rank, so the ranks' `after` calls meet in its vote. (Choosing
        # them allocates nothing but a host copy of the temperatures; a failure there is not
        # voted on.)
        try:
            gens = sm.generators
            if spec is None:  # a plain step: row i is request i's one position
                drafts, take = [[] for _ in rows], list(rows)
            else:  # request i: its target rows, then its bonus row
                counts = list(spec.num_draft_tokens)
                starts = [0, *itertools.accumulate(counts)]
                flat = spec.draft_token_ids.tolist()
                tgt = spec.target_logits_indices.tolist()
                bonus = spec.bonus_logits_indices.tolist()
                drafts = [flat[starts[i]:starts[i + 1]] for i in rows]
                take = [j for i in rows for j in (*tgt[starts[i]:starts[i + 1]], bonus[i])]
            return _Pending(
                rows=rows,
                seeds=[self._seed_of(batch.req_ids[i], gens.get(i)) for i in rows],
                positions=[int(batch.num_tokens_no_spec[i]) for i in rows],
                drafts=drafts,
                raw=logits.index_select(0, torch.tensor(take, dtype=torch.long,
                                                        device=logits.device)).to(torch.float32),
                full_raw=(logits.to(torch.float32).clone() if sm.max_num_logprobs is not None
                          else None))
        except Exception as e:  # noqa: BLE001 - re-raised by `after`, after the vote
            return _Pending(rows=rows, seeds=[], positions=[], drafts=[], raw=None,
                            full_raw=None, error=e)

    def after(self, runner: Any, pending: _Pending, spec: Any, out: Any) -> None:
        """Rewrites the covered requests' rows of vLLM's SamplerOutput `out` in place, if the
        rewrite succeeded on every tensor-parallel rank. Otherwise every rank keeps vLLM's own
        sample (the same on every rank: same seeds, same logits), the request-steps are counted
        in `fallbacks` ("rewrite failed"), and a rank whose own rewrite failed re-raises its
        error (the runner's guard counts and logs it)."""
        result = self._voted(runner, pending, spec, out)
        if result is None:
            return
        sampled, logprobs = result
        out.sampled_token_ids.copy_(sampled)
        out.logprobs_tensors = logprobs
        self.covered_steps += len(pending.rows)

    def _voted(self, runner: Any, pending: _Pending, spec: Any, out: Any
               ) -> tuple[torch.Tensor, Any] | None:
        """The rewrite of `out`, where it succeeded on every tensor-parallel rank; else None,
        counted, and this rank's own error (if it failed here) re-raised."""
        error, result = pending.error, None
        if error is None:
            try:
                result = self._rewrite(runner, pending, spec, out)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the vote
                error = e
        if not self._agreed(error is None):
            self._skip("rewrite failed", len(pending.rows))
            if error is not None:
                raise error
            return None
        return result

    def replaces(self, runner: Any, pending: _Pending | None) -> bool:
        """Whether this step can skip vLLM's sampler: every request of the batch is covered
        (its sample would be rewritten anyway) and no logprobs mode needs vLLM's own tensors
        (the full-vocabulary one, -1, or specific token ids). Seeded sampled rollouts (RL:
        every request seeded, temperature 1) are such batches; at batch 32 on a 2-vCPU box
        vLLM's sampler costs ~55 ms of a ~330 ms step there, all of it thrown away."""
        if pending is None or pending.error is not None:
            return False
        sm = runner.input_batch.sampling_metadata
        return (len(pending.rows) == len(runner.input_batch.req_ids)
                and sm.max_num_logprobs != -1 and not getattr(sm, "logprob_token_ids", None))

    def sample(self, runner: Any, pending: _Pending, spec: Any) -> Any:
        """The step's SamplerOutput without vLLM's sampler (only where `replaces`): every row
        the invariant one, exactly what `after` writes over vLLM's sample. None where the
        rewrite failed on any tensor-parallel rank: then every rank samples with vLLM (counted
        as "rewrite failed"), and a rank whose own rewrite failed re-raises its error."""
        from vllm.v1.outputs import SamplerOutput

        from vllm_onlinespec.sampling.invariant import PLACEHOLDER

        update = getattr(runner.input_batch, "update_async_output_token_ids", None)
        if update is not None:  # what vLLM's _sample does first (gpu_model_runner.py:3446)
            update()
        # The output vLLM's sampler would allocate: [requests, max drafts + 1], int32, every
        # slot a placeholder until the rewrite fills each row.
        empty = None
        try:
            width = 1 if spec is None else int(spec.max_spec_len) + 1
            empty = SimpleNamespace(logprobs_tensors=None, sampled_token_ids=torch.full(
                (len(runner.input_batch.req_ids), width), PLACEHOLDER, dtype=torch.int32,
                device=pending.raw.device))
        except Exception as e:  # noqa: BLE001 - every rank must still reach the vote
            pending.error = e
        result = self._voted(runner, pending, spec, empty)
        if result is None:
            return None
        sampled, logprobs = result
        self.covered_steps += len(pending.rows)
        self.replaced_steps += 1
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    def _agreed(self, ok: bool) -> bool:
        """Whether every rank of the TP group has `ok` (all-reduce MIN over vLLM's CPU (gloo)
        group; one collective per covered step, only under TP). Without TP: `ok`."""
        if isinstance(self.group, str):  # "auto"
            from vllm_onlinespec.serving.compat.parallel import tp_group

            self.group = tp_group()
        if self.group is None:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        return bool(flag.item())

    def _rewrite(self, runner: Any, pending: _Pending, spec: Any, out: Any
                 ) -> tuple[torch.Tensor, Any]:
        """The rewritten sampled_token_ids and logprobs; `out` untouched."""
        batch = runner.input_batch
        sm = batch.sampling_metadata
        n = len(batch.req_ids)
        processed = self._processed(runner.rejection_sampler, sm, pending, n)
        counts = [len(d) + 1 for d in pending.drafts]
        # Noise on the sampler's device: a pure function of (seed, position, token id), so the
        # same on CPU and GPU; only the R chosen ids travel back.
        dev = processed.device
        seeds = torch.tensor([s for s, c in zip(pending.seeds, counts) for _ in range(c)],
                             dtype=torch.int64, device=dev)
        positions = torch.tensor([p + j for p, c in zip(pending.positions, counts)
                                  for j in range(c)], dtype=torch.int64, device=dev)
        tokens = invariant_tokens(processed, seeds, positions)
        sampled = out.sampled_token_ids.clone()
        rows = verify_rows(pending.drafts, tokens.tolist(), sampled.shape[1])
        sampled[torch.tensor(pending.rows, dtype=torch.long, device=sampled.device)] = torch.tensor(
            rows, dtype=sampled.dtype, device=sampled.device)
        logprobs = (self._logprobs(runner, sm, spec, pending.full_raw, sampled)
                    if pending.full_raw is not None else out.logprobs_tensors)
        return sampled, logprobs

    def _processed(self, rs: Any, sm: Any, pending: _Pending, n: int) -> torch.Tensor:
        """The covered rows' logits processed as vLLM processes a draft position: every
        position (the bonus one and a plain step's included) is treated as one, with the
        request's earlier drafts counted as output."""
        per_row = dict(zip(pending.rows, pending.drafts))
        counts = [len(per_row[i]) + 1 if i in per_row else 0 for i in range(n)]
        # spec tokens: the drafts and one placeholder, so that vLLM's penalty and bad-words
        # helpers build output + drafts[:j] for positions j = 0..len(drafts).
        spec_ids = [per_row[i] + [0] if i in per_row else [] for i in range(n)]
        sm_j = replace(sm, spec_token_ids=spec_ids)
        meta = SimpleNamespace(num_draft_tokens=counts)
        x = rs.apply_logits_processors(pending.raw.clone(), sm_j, meta)
        return _constrained(x, counts, sm_j)

    @staticmethod
    def _logprobs(runner: Any, sm: Any, spec: Any, raw: torch.Tensor, sampled: torch.Tensor):
        """Logprobs of the rewritten tokens, computed as vLLM's raw logprobs modes do."""
        sampler = runner.sampler
        if spec is None:
            lp = raw if sampler.logprobs_mode == "raw_logits" else sampler.compute_logprobs(raw)
            return sampler.gather_logprobs(lp, sm.max_num_logprobs,
                                           token_ids=sampled[:, 0].to(torch.int64))
        rs = runner.rejection_sampler
        return rs._get_logprobs_tensors(sm.max_num_logprobs, spec, raw,
                                        raw[spec.target_logits_indices],
                                        raw[spec.bonus_logits_indices], sampled)
