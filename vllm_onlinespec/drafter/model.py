"""Plain-PyTorch DFlash drafter: the forward vLLM's qwen3_dflash computes (design.md §3).

    ctx   = hidden_norm(fc(concat(target aux features)))            one row per committed token
    block = [last committed token, MASK x K] at positions n..n+K     embedded with the target's table
    each layer: pre-norm Qwen3 block; its queries/keys/values for block rows come from
                input_layernorm(block), while context keys/values come from `ctx` itself
                (k_norm + RoPE on k_proj(ctx), v_proj(ctx)); attention is non-causal
    out   = norm(block)[1:]  -> the caller applies the target's LM head

State-dict names equal the checkpoint names vLLM loads. No embed_tokens/lm_head: both belong to
the target and are passed in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics like vLLM's kernel; bf16 squares would lose the small components.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(xf.dtype)).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin [..., head_dim/2] in fp32 for integer positions of any shape."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style rotation of x [B, S, heads, head_dim] by cos/sin [B, S, head_dim/2]."""
    x1, x2 = x.to(torch.promote_types(x.dtype, cos.dtype)).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        h, qd, kvd = cfg.hidden_size, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=False)
        self.k_proj = nn.Linear(h, kvd, bias=False)
        self.v_proj = nn.Linear(h, kvd, bias=False)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def kv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv, self.head_dim))
        return apply_rope(k, *rope), self.v_proj(x).view(b, s, self.n_kv, self.head_dim)

    def forward(self, x: Tensor, ctx_kv: tuple[Tensor, Tensor], rope_q: tuple[Tensor, Tensor],
                mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)), *rope_q)
        k_blk, v_blk = self.kv(x, rope_q)
        k_ctx, v_ctx = ctx_kv
        k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
        v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
        if self.n_kv != self.n_heads:
            # Expanded K/V keep SDPA on its masked memory-efficient kernel; enable_gqa would not.
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, ctx_kv: tuple[Tensor, Tensor], rope_q: tuple[Tensor, Tensor],
                mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, rope_q, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_train_mask(anchors: Tensor, seq_len: int, block_size: int) -> Tensor:
    """Boolean SDPA mask (True = may attend) for many blocks over one sequence, [B, A*bs, T + A*bs].

    Query rows are blocks in anchor order, block_size rows each; key columns are the T context
    rows (position t = column t) followed by the same block rows. Block j (anchor a_j) sees context
    at positions < a_j and its own block in both directions; never other blocks, never context at
    or after its anchor (the anchor token enters only as the block's first token, as at inference).
    Unused anchors (-1) see only their own block, which keeps their softmax rows finite.
    """
    b, a = anchors.shape
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    ctx_pos = torch.arange(seq_len, device=anchors.device)
    see_ctx = ctx_pos.view(1, 1, -1) < q_anchor.unsqueeze(-1)  # -1 anchors see nothing
    blk = torch.arange(a, device=anchors.device).repeat_interleave(block_size)
    see_blk = (blk.view(-1, 1) == blk.view(1, -1)).expand(b, -1, -1)
    return torch.cat([see_ctx, see_blk], dim=-1)


def block_labels(input_ids: Tensor, anchors: Tensor, num_draft_tokens: int,
                 lengths: Tensor | None = None, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Targets of each block's K draft rows: input_ids[a+1 .. a+K] -> (ids [B,A,K], valid [B,A,K]).

    Rows past the sequence end (`lengths`, default T) or of unused anchors are invalid and hold
    `ignore_index`.
    """
    b, t = input_ids.shape
    idx = anchors.unsqueeze(-1) + 1 + torch.arange(num_draft_tokens, device=anchors.device)
    limit = t if lengths is None else lengths.view(b, 1, 1)
    valid = (anchors.unsqueeze(-1) >= 0) & (idx < limit)
    ids = input_ids.gather(1, idx.clamp(0, t - 1).view(b, -1)).view_as(idx)
    return ids.masked_fill(~valid, ignore_index), valid


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, features: Tensor) -> Tensor:
        """ctx = hidden_norm(fc(features)): the rows every layer's context K/V are projected from."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def _embed(self, ids: Tensor, embed_weight: Tensor) -> Tensor:
        # The target's table is frozen: detach so no gradient is ever accumulated into it.
        return F.embedding(ids, embed_weight.detach()).to(self.dtype)

    def context_kv(self, features: Tensor, ctx_positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's context keys/values, what vLLM precomputes into the drafter's KV cache
        once per committed token (and keeps, across weight updates: see publish.kv_policy)."""
        cfg = self.config
        ctx = self.context(features)
        rope_ctx = rope_cos_sin(ctx_positions, cfg.head_dim, cfg.rope_theta)
        # context rows bypass input_layernorm (vLLM does too)
        return [layer.self_attn.kv(ctx, rope_ctx) for layer in self.layers]

    def _run(self, x: Tensor, pos: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
             mask: Tensor) -> Tensor:
        cfg = self.config
        rope_q = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        mask = mask.unsqueeze(1)  # broadcast over heads
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, kv, rope_q, mask)
        return self.norm(x)

    def draft_hidden(self, ctx_features: Tensor, ctx_positions: Tensor, ctx_valid_mask: Tensor,
                     first_token: Tensor, first_position: Tensor, embed_weight: Tensor) -> Tensor:
        """Hidden states of the K mask rows for a batch of independent requests, [B, K, H].

        ctx_features [B,T,n*Ht] / ctx_positions [B,T] / ctx_valid_mask [B,T]: padded context;
        only valid rows with position < first_position are attended. first_token/first_position
        [B]: the last committed token (no features yet) and its position n.
        """
        b, bs = first_token.shape[0], self.config.block_size
        ids = torch.full((b, bs), self.config.mask_token_id, dtype=torch.long, device=first_token.device)
        ids[:, 0] = first_token
        pos = first_position.view(b, 1) + torch.arange(bs, device=first_position.device)
        see_ctx = ctx_valid_mask & (ctx_positions < first_position.view(b, 1))
        mask = torch.cat([see_ctx.unsqueeze(1).expand(-1, bs, -1),
                          see_ctx.new_ones(b, bs, bs)], dim=-1)
        h = self._run(self._embed(ids, embed_weight), pos,
                      self.context_kv(ctx_features, ctx_positions), mask)
        return h[:, 1:]

    def train_hidden(self, features: Tensor, input_ids: Tensor, anchors: Tensor,
                     embed_weight: Tensor,
                     ctx_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """Many blocks per sequence in one forward, [B, A, K, H] (see build_train_mask).

        features [B,T,n*Ht] and input_ids [B,T]: row t is position t. anchors [B,A]: positions
        a_j < T, -1 = unused (its rows are garbage; mask them with block_labels' valid).
        ctx_kv: context keys/values to use instead of this drafter's own (e.g. computed by older
        weights, as a served request's draft KV cache holds them).
        """
        b, t = input_ids.shape
        a, bs = anchors.shape[1], self.config.block_size
        first = input_ids.gather(1, anchors.clamp(min=0))
        ids = torch.full((b, a, bs), self.config.mask_token_id, dtype=torch.long, device=input_ids.device)
        ids[..., 0] = first
        pos = anchors.clamp(min=0).unsqueeze(-1) + torch.arange(bs, device=anchors.device)
        ctx_pos = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = build_train_mask(anchors, t, bs)
        if ctx_kv is None:
            ctx_kv = self.context_kv(features, ctx_pos)
        h = self._run(self._embed(ids.view(b, a * bs), embed_weight), pos.view(b, a * bs),
                      ctx_kv, mask)
        return h.view(b, a, bs, -1)[:, :, 1:]
