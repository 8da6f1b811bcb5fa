"""One training step on DFlash blocks, shared by the offline trainer and the online learner.

A block is anchored at a committed token a: the drafter sees the target's features of positions
< a, the token ids[a] and K mask rows, and predicts ids[a+1 .. a+K]. Draft row k (1..K) is
distilled towards the target's own next-token distribution at that position, which the target
computed from position a+k-1: logits = final_hidden[a+k-1] @ lm_head.T.

Greedy acceptance here means what greedy verification would accept: the leading draft tokens
equal to the target's argmax. The target's argmax at row k is only known along the sequence we
have, so past a row where the data itself left the target's greedy path (sampled responses,
bf16-vs-fp32 near-ties) the count stops and the block is "censored": a lower bound, exact for the
target's own greedy text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import LossConfig
from ..drafter.length_head import LengthHead, length_loss
from ..drafter.model import DFlashDrafter, block_labels
from ..drafter.vocab import DraftVocab

__all__ = ["LossConfig", "BlockStats", "LossVocab", "block_loss", "cached_ce_loss",
           "greedy_accepted", "target_argmax",
           "position_weights", "response_mask", "sample_anchors", "target_block_states",
           "walk_acceptance", "walk_steps"]


# -- anchors ---------------------------------------------------------------------------------------

def response_mask(starts: Tensor, lengths: Tensor, seq_len: int) -> Tensor:
    """[B, T] positions allowed as anchors: inside the response (t >= start) and with at least one
    label (t < length - 1). The first response token is the first anchor vLLM ever drafts from
    (prefill commits it), so anchors before it would train blocks serving never runs."""
    t = torch.arange(seq_len, device=starts.device)
    return (t >= starts.view(-1, 1)) & (t < lengths.view(-1, 1) - 1)


def sample_anchors(allowed: Tensor, lengths: Tensor | None, num_anchors: int,
                   num_draft_tokens: int, generator: torch.Generator | None = None) -> Tensor:
    """Up to `num_anchors` distinct anchors per row drawn uniformly from `allowed` [B, T], [B, A].

    Anchors whose K labels all exist (a + K < length) are taken first; partial windows only fill
    rows that have too few full ones. Unused slots are -1 and sort last; used ones ascend.
    """
    b, t = allowed.shape
    if lengths is None:
        lengths = torch.full((b,), t, dtype=torch.long, device=allowed.device)
    pos = torch.arange(t, device=allowed.device)
    full = pos.view(1, -1) + num_draft_tokens < lengths.view(-1, 1)
    # Random score in [0, 1), +1 for allowed, +1 more for a full window: top-k then picks full
    # windows first, partial ones next, disallowed ones never (checked below).
    score = torch.rand(b, t, generator=generator, device=allowed.device)
    score = score + allowed.float() + (allowed & full).float()
    k = min(num_anchors, t)
    top, idx = score.topk(k, dim=1)
    idx = torch.where(top >= 1, idx, torch.full_like(idx, t))  # disallowed -> sentinel, sorts last
    idx = idx.sort(dim=1).values
    idx = torch.where(idx == t, torch.full_like(idx, -1), idx)
    if k < num_anchors:
        idx = torch.cat([idx, idx.new_full((b, num_anchors - k), -1)], dim=1)
    return idx


# -- pieces of the loss -----------------------------------------------------------------------------

def position_weights(num_draft_tokens: int, gamma: float, device: torch.device | str = "cpu") -> Tensor:
    """w_k = exp(-(k-1)/gamma), k = 1..K: later rows only count if the earlier ones were accepted."""
    k = torch.arange(num_draft_tokens, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def target_block_states(final_hidden: Tensor, anchors: Tensor, num_draft_tokens: int) -> Tensor:
    """final_hidden at a+k-1 for k = 1..K, [B, A, K, H] (clamped where out of range: mask it)."""
    b, t, h = final_hidden.shape
    idx = anchors.clamp(min=0).unsqueeze(-1) + torch.arange(num_draft_tokens, device=anchors.device)
    idx = idx.clamp(max=t - 1)
    return final_hidden.gather(1, idx.view(b, -1, 1).expand(-1, -1, h)).view(*idx.shape, h)


def greedy_accepted(draft: Tensor, target: Tensor, labels: Tensor, valid: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """(accepted [..], censored [..]) for draft/target argmax ids and labels/valid [.., K].

    Row k counts if draft == target there and every earlier row's label was the target's argmax
    (otherwise the target's argmax at row k was computed on a context greedy decoding never sees).
    censored: the true count may be higher (the window ran out, or the data left the greedy path
    right after a match).
    """
    k = draft.shape[-1]
    on_path = (labels == target) & valid
    prev_on_path = torch.cat([torch.ones_like(on_path[..., :1]), on_path[..., :-1]], dim=-1)
    ok = (draft == target) & valid & prev_on_path.cumprod(dim=-1).bool()
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)
    # The row after the last accepted one decides the count only if it was observable.
    nxt = accepted.clamp(max=k - 1).unsqueeze(-1)
    decided = (accepted < k) & valid.gather(-1, nxt).squeeze(-1) & prev_on_path.gather(-1, nxt).squeeze(-1)
    censored = (accepted < k) & ~decided
    return accepted, censored


@dataclass
class BlockStats:
    """Float statistics of one block_loss call; `as_dict()` is what loggers and the learner get."""

    loss: float
    distill: float
    length: float
    blocks: int  # anchors used
    rows: int  # labelled draft rows
    full_blocks: int  # blocks with all K labels, the ones acceptance is measured on
    accepted: float  # mean greedy accepted drafts over full blocks (a lower bound, see module doc)
    match: list[float]  # per draft row k: P(draft argmax == target argmax) over valid rows
    # [B, A] accepted drafts per block (-1 where the block is not full); not in as_dict()
    per_block: Tensor | None = None

    @property
    def acceptance(self) -> float:
        """Tokens per target step, vLLM's 'mean acceptance length': accepted drafts + the bonus."""
        return self.accepted + 1.0

    def as_dict(self) -> dict[str, float]:
        d = {"loss": self.loss, "distill": self.distill, "length": self.length,
             "blocks": float(self.blocks), "rows": float(self.rows),
             "full_blocks": float(self.full_blocks), "accepted": self.accepted,
             "acceptance": self.acceptance}
        d.update({f"match_{k + 1}": m for k, m in enumerate(self.match)})
        return d


def walk_steps(accepted_at: Sequence[int], num_draft_tokens: int) -> list[int]:
    """Drafts accepted at each verify step of greedy speculative decoding walking one answer.

    accepted_at[i]: drafts accepted by a block anchored at the answer's i-th position (-1 or the
    end of the list = no full window there: the walk stops). A step at i commits
    accepted_at[i] + 1 tokens (the bonus included) and the next block is anchored right after
    them, as in serving.
    """
    out, i = [], 0
    while i < len(accepted_at) and accepted_at[i] >= 0:
        a = min(int(accepted_at[i]), num_draft_tokens)
        out.append(a)
        i += a + 1
    return out


def walk_acceptance(accepted_at: Sequence[int], num_draft_tokens: int) -> tuple[int, int]:
    """(verify steps, tokens) of the walk (walk_steps). tokens / steps is what vLLM's "mean
    acceptance length" reports. Over stretches of similar acceptance it is a harmonic rather
    than an arithmetic mean of (accepted + 1), so it is usually below the mean over uniformly
    placed anchors: a walk crosses an easy stretch in few steps and a hard one in many.
    """
    steps = walk_steps(accepted_at, num_draft_tokens)
    return len(steps), sum(steps) + len(steps)


# -- the loss vocabulary ---------------------------------------------------------------------------

# The LM-head rows the training loss projects onto (drafter.vocab.DraftVocab). Why a subset:
# the vocabulary projection is ~3/4 of a training step on a CPU, while a chat/code corpus uses a
# few thousand of SmolLM2's 49 152 tokens; a drafter served with a reduced vocabulary (d2t)
# must also be trained against exactly those rows. A token outside the subset can never be a
# loss label: its row is neither pulled up nor pushed down.
LossVocab = DraftVocab


# -- cached labels ---------------------------------------------------------------------------------

@torch.no_grad()
def target_argmax(final_hidden: Tensor, lm_head_w: Tensor, chunk: int = 2048) -> Tensor:
    """The target's greedy next token after each position, [T] int64: argmax of
    final_hidden[t] @ lm_head_w.T over the whole vocabulary (float32 logits).

    A CE-only loss needs nothing else from the target, so the trainer computes this once per
    sequence instead of the target's [rows, V] logits at every step."""
    out = torch.empty(final_hidden.shape[0], dtype=torch.long)
    w = lm_head_w.float()
    for s in range(0, final_hidden.shape[0], chunk):
        out[s:s + chunk] = (final_hidden[s:s + chunk].float() @ w.T).argmax(-1)
    return out


def cached_ce_loss(h: Tensor, labels: Tensor, w: Tensor, pw: Tensor,
                   vocab: LossVocab | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy of draft rows h [N, H] to the target's cached argmax `labels` [N] (token
    ids), position-weighted by pw [N] and normalised by sum(pw) like kernels.distill_loss's
    "ce" mode. With `vocab`, logits span its rows only and a label outside it adds no loss
    (it stays in the normaliser: the drafter cannot get such a row right).
    Returns (loss, labels, draft argmax token ids)."""
    logits = (h @ (w if vocab is None else vocab.weight).T).float()
    idx = labels if vocab is None else vocab.index_of(labels)
    known = idx >= 0
    ce = torch.nn.functional.cross_entropy(logits, idx.clamp(min=0), reduction="none")
    loss = (ce * pw * known).sum() / pw.sum().clamp(min=1e-12)
    draft = logits.detach().argmax(-1)
    return loss, labels, draft if vocab is None else vocab.ids[draft]


# -- the step ---------------------------------------------------------------------------------------

def block_loss(drafter: DFlashDrafter, ids: Tensor, aux: Tensor, final_hidden: Tensor,
               anchors: Tensor, embed_w: Tensor, lm_head_w: Tensor, *, loss_cfg: LossConfig | None = None,
               length_head: LengthHead | None = None, lengths: Tensor | None = None,
               impl: str = "auto", ctx_kv: list[tuple[Tensor, Tensor]] | None = None,
               vocab: LossVocab | None = None,
               target_ids: Tensor | None = None) -> tuple[Tensor, BlockStats]:
    """Distillation loss of the drafter on the blocks at `anchors` (+ the length head's MSE).

    ids [B,T], aux [B,T,F], final_hidden [B,T,H]: right-padded, row t = position t; lengths [B]
    (default T). anchors [B,A] from sample_anchors (-1 = unused). embed_w/lm_head_w: the target's
    frozen embedding table and LM head (the same tensor for tied models).
    ctx_kv: per-layer context keys/values to draft against instead of the drafter's own.
    vocab: project onto these LM-head rows only (LossVocab; argmaxes and acceptance are then
    taken within it); None = the whole vocabulary.
    target_ids [B,T]: the target's argmax after each position (target_argmax), cached; with
    loss mode "ce" the step then never runs the target's head (final_hidden is not read).
    Returns (loss with graph, BlockStats). The length head sees detached drafter states, so its
    MSE trains the head only and the sum is safe to backprop as one loss.
    """
    from ..kernels import distill_loss  # kernels/ installs as vllm_onlinespec.kernels

    cfg = loss_cfg or LossConfig()
    k = drafter.config.num_draft_tokens
    h = drafter.train_hidden(aux, ids, anchors, embed_w, ctx_kv)  # [B,A,K,H]
    labels, valid = block_labels(ids, anchors, k, lengths)
    pw = position_weights(k, cfg.gamma, h.device).expand_as(valid)

    # Only labelled rows go through the vocabulary projection: it is most of the step's cost.
    rows = valid.nonzero(as_tuple=True)
    n_rows = int(rows[0].numel())
    if n_rows and target_ids is not None and cfg.mode == "ce":
        tgt = target_block_states(target_ids.unsqueeze(-1), anchors, k).squeeze(-1)
        distill, tgt_rows, draft_rows = cached_ce_loss(h[rows], tgt[rows], lm_head_w, pw[rows],
                                                       vocab)
    elif n_rows:
        ht = target_block_states(final_hidden, anchors, k)
        w = lm_head_w if vocab is None else vocab.weight
        out = distill_loss(h[rows], ht[rows].to(h.dtype), w, pw[rows], alpha=cfg.alpha,
                           temperature=cfg.temperature, clip=cfg.clip, mode=cfg.mode, impl=impl,
                           miss_weight=cfg.miss_weight, return_argmax=True)
        distill, tgt_rows, draft_rows = out.loss, out.target_ids, out.draft_ids
        if vocab is not None:  # subset positions -> token ids, comparable with the labels
            tgt_rows, draft_rows = vocab.ids[tgt_rows], vocab.ids[draft_rows]
    else:
        distill = h.sum() * 0.0  # keeps a graph, so callers can always backward()
        tgt_rows = draft_rows = labels.new_empty(0)
    target = labels.new_full(valid.shape, -1)
    draft = labels.new_full(valid.shape, -2)
    target[rows], draft[rows] = tgt_rows, draft_rows

    accepted, censored = greedy_accepted(draft, target, labels, valid)
    block_ok = valid[..., 0]
    full = valid.all(dim=-1)

    length = torch.zeros((), device=h.device)
    if length_head is not None:
        # The head's MSE wants float32 (see build_learner) even when the drafter's matmuls
        # run under bf16 autocast.
        with torch.autocast(h.device.type, enabled=False):
            pred = length_head(h.detach().float())
        known = block_ok & ~censored  # a censored block's label would teach a wrong, low length
        length = length_loss(pred, accepted, drafter.config.block_size, known)
    loss = distill + length

    with torch.no_grad():
        match = draft == target
        per_k = [(match[..., i] & valid[..., i]).sum().item() / max(1, valid[..., i].sum().item())
                 for i in range(k)]
        n_full = int(full.sum())
        stats = BlockStats(
            loss=float(loss.detach()), distill=float(distill.detach()), length=float(length),
            blocks=int(block_ok.sum()), rows=n_rows, full_blocks=n_full,
            accepted=float(accepted[full].float().mean()) if n_full else math.nan, match=per_k,
            per_block=accepted.masked_fill(~full, -1))
    return loss, stats
