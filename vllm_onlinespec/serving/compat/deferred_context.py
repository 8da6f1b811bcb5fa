"""The DFlash drafter's context K/V of steps that drafted nothing, written when it next drafts.

Every step vLLM's DFlash proposer writes the step's tokens into the drafter's K/V cache (fc over
the target's features, the K/V projections, norms, RoPE, the cache insert: what later drafts
attend to), also when the budget asked it for no draft at all. In sampled rollouts the budget
drafts with the drafter in 2-4 % of steps and that write cost 2.4 ms of a ~130 ms step at 16
requests on a 2-vCPU CPU (most of it per call, not per token). Deferred, a step that drafts
nothing keeps the accepted tokens' target features, positions and request ids, and the next
step that drafts writes all of them in one pass before vLLM's own propose; a request that left
the batch in between is dropped, so its freed blocks are never written.

The slots are computed when they are written, from that step's block table (slot = block *
block_size + position % block_size, as vLLM's `_copy_and_expand_dflash_inputs` computes them),
and only for positions the request has computed: a request preempted and resumed in between
gets its positions' K/V in its new blocks, the same values its recompute writes. Rejected draft
rows of a step are never kept (vLLM writes them and overwrites them the next step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("vllm_onlinespec")

# Tokens kept before a step that drafts nothing writes them anyway: 4096 rows of a 3-layer
# 576-wide target's features are 28 MB in float32.
MAX_DEFERRED_TOKENS = 4096


@dataclass
class _Chunk:
    """One step's deferred context rows."""
    hidden: torch.Tensor  # [n, the drafter's input width]: the target's features, not combined
    positions: torch.Tensor  # [n]
    rows: torch.Tensor  # [n] index into req_ids
    req_ids: list[str]  # the step's batch, in batch order


@dataclass
class DeferredContext:
    chunks: list[_Chunk] = field(default_factory=list)
    tokens: int = 0  # rows kept now
    written: int = 0  # rows written by catch-ups
    dropped: int = 0  # rows of requests gone before their catch-up
    catch_ups: int = 0
    errors: int = 0

    def defer(self, runner: Any, *, target_positions: torch.Tensor,
              target_hidden_states: torch.Tensor, common_attn_metadata: Any,
              num_rejected_tokens_gpu: torch.Tensor | None = None, **_unused) -> None:
        """Keep this step's accepted context rows (a step vLLM asked for 0 drafts)."""
        cad = common_attn_metadata
        n = int(target_positions.shape[0])
        starts = cad.query_start_loc[:cad.batch_size() + 1].to(torch.int64)
        idx = torch.arange(n, device=starts.device)
        rows = torch.searchsorted(starts[1:], idx, right=True)
        ends = starts[1:]
        if num_rejected_tokens_gpu is not None:
            ends = ends - num_rejected_tokens_gpu[:cad.batch_size()].to(torch.int64)
        keep = idx < ends[rows]
        req_ids = list(runner.input_batch.req_ids[:cad.batch_size()])
        chunk = _Chunk(hidden=target_hidden_states[keep],  # a copy (boolean index)
                       positions=target_positions[:n][keep].to(torch.int64),
                       rows=rows[keep], req_ids=req_ids)
        self.chunks.append(chunk)
        self.tokens += int(chunk.positions.shape[0])

    @property
    def full(self) -> bool:
        return self.tokens >= MAX_DEFERRED_TOKENS

    def catch_up(self, proposer: Any, runner: Any, common_attn_metadata: Any) -> int:
        """Write every kept row whose request is still in the batch into the drafter's K/V
        cache, with this step's block table. Returns the rows written; never raises (a failure
        drops the rows, is counted and logged once: later drafts are worse, never wrong)."""
        if not self.chunks:
            return 0
        chunks, self.chunks, self.tokens = self.chunks, [], 0
        try:
            return self._write(proposer, runner, common_attn_metadata, chunks)
        except Exception as e:  # noqa: BLE001 - vLLM's propose runs next: never break it
            self.errors += 1
            if self.errors == 1:
                logger.warning("onlinespec: writing the deferred drafter context failed (%s: "
                               "%s); those rows are dropped (drafts degrade, output does not)",
                               type(e).__name__, e)
            return 0

    def _write(self, proposer: Any, runner: Any, cad: Any, chunks: list[_Chunk]) -> int:
        batch = runner.input_batch
        now = batch.req_id_to_index
        computed = torch.as_tensor(batch.num_computed_tokens_cpu[:cad.batch_size()],
                                   dtype=torch.int64)
        hidden, positions, rows = [], [], []
        for c in chunks:
            lut = torch.tensor([now.get(r, -1) for r in c.req_ids], dtype=torch.int64)
            at = lut[c.rows.cpu()]
            # gone, or (preempted and resumed) past what its recompute has reached
            live = (at >= 0) & (c.positions.cpu() < computed[at.clamp(min=0)])
            self.dropped += int((~live).sum())
            live_dev = live.to(c.positions.device)
            hidden.append(c.hidden[live_dev])
            positions.append(c.positions[live_dev])
            rows.append(at[live].to(c.positions.device))
        pos = torch.cat(positions)
        if pos.numel() == 0:
            return 0
        row = torch.cat(rows)
        bs = int(proposer.block_size)
        table = cad.block_table_tensor
        slots = table[row, pos // bs].to(torch.int64) * bs + pos % bs
        model = proposer.model
        feats = model.combine_hidden_states(torch.cat(hidden))
        model.precompute_and_store_context_kv(feats, pos, slots)
        n = int(pos.numel())
        self.written += n
        self.catch_ups += 1
        return n

    def stats(self) -> dict:
        return {"kept": self.tokens, "written": self.written, "dropped": self.dropped,
                "catch_ups": self.catch_ups, "errors": self.errors}
