"""DFlash drafter core: names, checkpoint layout, config parsing, masks, forward semantics."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from vllm_onlinespec.drafter import (
    DFlashConfig,
    DFlashDrafter,
    LengthHead,
    accepted_length,
    block_labels,
    build_train_mask,
    default_target_layer_ids,
    length_label,
    length_loss,
    load_drafter,
    save_drafter,
    state_dict_for_vllm,
)

BS = 4  # block_size -> K = 3


def tiny_config(**kw) -> DFlashConfig:
    # head_dim * heads != hidden and target_hidden != hidden, so shape mix-ups cannot hide.
    args = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=64, target_layer_ids=[0, 2, 3],
                mask_token_id=63, block_size=BS, rope_theta=10_000.0, target_hidden_size=24,
                num_target_layers=6, torch_dtype="float32")
    args.update(kw)
    return DFlashConfig(**args)


def random_drafter(cfg: DFlashConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            # Non-unit norm weights: a norm applied with the wrong weight must show.
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return d.eval()


def vllm_names(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    names = {"fc.weight": (h, cfg.fc_in_features), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg.num_hidden_layers):
        p = f"layers.{n}."
        names |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                  p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                  p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                  p + "mlp.down_proj.weight": (h, i)}
    return names


# ---------------------------------------------------------------- names and checkpoints


def test_state_dict_names_are_vllm_names():
    cfg = tiny_config()
    d = DFlashDrafter(cfg)
    got = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert got == vllm_names(cfg)
    assert [n for n, _ in state_dict_for_vllm(d)] == list(d.state_dict())
    assert d.num_parameters() == sum(math.prod(s) for s in got.values())


def test_save_load_roundtrip_and_layout(tmp_path):
    cfg = tiny_config()
    d, head = random_drafter(cfg), LengthHead(cfg.hidden_size, width=16)
    out = tmp_path / "ckpt"
    save_drafter(out, cfg, d, head, dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "model.safetensors.index.json", "length_head.safetensors"])
    assert not list(tmp_path.glob(".ckpt.*"))  # temp folders cleaned up

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: "model.safetensors" for k in vllm_names(cfg)}
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(vllm_names(cfg))
    with safe_open(out / "length_head.safetensors", "pt") as f:
        assert f.keys() and all(k.startswith("length_head.") for k in f.keys())

    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"] == {"target_layer_ids": [0, 2, 3], "mask_token_id": 63}
    assert hf["layer_types"] == ["full_attention"] * 2
    assert hf["attention_bias"] is False and hf["tie_word_embeddings"] is False
    assert hf["torch_dtype"] == "float32" and hf["block_size"] == BS
    # vLLM parses it through transformers as a Qwen3Config: check what it will see.
    from transformers import AutoConfig

    q3 = AutoConfig.from_pretrained(out)
    assert type(q3).__name__ == "Qwen3Config" and q3.head_dim == cfg.head_dim
    assert q3.rope_parameters["rope_theta"] == cfg.rope_theta and q3.target_hidden_size == 24
    assert q3.dflash_config["target_layer_ids"] == [0, 2, 3]

    cfg2, d2, head2 = load_drafter(out)
    assert cfg2 == cfg
    for (k, v), (k2, v2) in zip(d.state_dict().items(), d2.state_dict().items(), strict=True):
        assert k == k2 and v.dtype == v2.dtype and torch.equal(v, v2)
    for k, v in head.state_dict().items():
        assert torch.equal(v, head2.state_dict()[k])

    # Overwriting an existing checkpoint in bf16 (the serving dtype) replaces it wholesale.
    save_drafter(out, cfg, d, dtype=torch.bfloat16)
    cfg3, d3, head3 = load_drafter(out)
    assert head3 is None and cfg3.torch_dtype == "bfloat16"
    assert all(torch.equal(v.to(torch.bfloat16), d3.state_dict()[k]) for k, v in d.state_dict().items())


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such drafter checkpoint"):
        load_drafter(tmp_path / "nope")
    out = tmp_path / "ckpt"
    save_drafter(out, tiny_config(), DFlashDrafter(tiny_config()))
    (out / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable safetensors") as e:
        load_drafter(out)
    assert "\n" not in str(e.value)
    (out / "config.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_drafter(out)
    # Weights that do not fit the config are named.
    save_drafter(out, tiny_config(), DFlashDrafter(tiny_config()))
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["layer_types"] = 3, ["full_attention"] * 3
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing \['layers\.2\."):
        load_drafter(out)


# ---------------------------------------------------------------- configs

ZLAB_QWEN3_8B_B16 = {  # z-lab/Qwen3-8B-DFlash-b16 config.json (b16-era layout)
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "bos_token_id": 151643, "dflash_config": {"mask_token_id": 151669,
                                              "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
    "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
ZLAB_QWEN35_STYLE = {  # newer layout: block_size in dflash_config, rope_parameters, no layer_types
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
    "hidden_size": 3072, "num_hidden_layers": 6, "vocab_size": 248320,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 9216, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                      "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]},
}


def test_zlab_configs_parse():
    c = DFlashConfig.from_hf_dict(ZLAB_QWEN3_8B_B16)
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim, c.block_size, c.num_draft_tokens) == (
        4096, 5, 128, 16, 15)
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.mask_token_id == 151669
    assert c.rope_theta == 1e6 and c.torch_dtype == "bfloat16" and c.fc_in_features == 5 * 4096
    assert c.target_layer_ids == default_target_layer_ids(36, 5)  # the z-lab recipe
    c = DFlashConfig.from_hf_dict(ZLAB_QWEN35_STYLE)
    assert c.rope_theta == 1e7 and c.block_size == 16 and c.num_target_features == 8
    assert DFlashConfig.from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("edit, field", [
    ({"dflash_config": {"target_layer_ids": [1, 2]}}, "mask_token_id"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"dflash_config": {"mask_token_id": 10**6, "target_layer_ids": [1]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [9, 1]}}, "target_layer_ids"),
])
def test_bad_config_names_the_field(edit, field):
    with pytest.raises(ValueError, match=field) as e:
        DFlashConfig.from_hf_dict({**ZLAB_QWEN3_8B_B16, **edit})
    assert "\n" not in str(e.value)


def test_default_target_layer_ids():
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 3) == [1, 14, 27]
    for layers, n in [(4, 3), (4, 4), (2, 2), (5, 2)]:  # tiny targets: distinct and in range
        ids = default_target_layer_ids(layers, n)
        assert len(ids) == n and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < layers
    with pytest.raises(ValueError, match="num_features"):
        default_target_layer_ids(4, 5)


def test_for_target_derives_sizes():
    from transformers import LlamaConfig

    t = LlamaConfig(num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    rope_theta=100000.0, max_position_embeddings=8192)
    c = DFlashConfig.for_target(t, num_layers=2, num_target_features=3, block_size=5, mask_token_id=16)
    assert (c.hidden_size, c.head_dim, c.num_key_value_heads, c.vocab_size) == (576, 64, 3, 49152)
    assert c.rope_theta == 100000.0 and c.target_layer_ids == [1, 14, 27]
    assert c.fc_in_features == 3 * 576 and c.num_draft_tokens == 4
    from_dict = DFlashConfig.for_target(t.to_dict(), mask_token_id=16)
    assert from_dict == DFlashConfig.for_target(t, mask_token_id=16)


# ---------------------------------------------------------------- forward semantics


def reference_block(d: DFlashDrafter, feats, ctx_pos, first_token, first_pos, embed):
    """Float64 per-head loop over design.md §3 for one request (context = given rows)."""
    cfg, sd = d.config, {k: v.double() for k, v in d.state_dict().items()}
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rope(x, pos):  # x [S, heads, hd], rotate_half form
        inv = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos.double()[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    ctx = rms(feats.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    ids = torch.tensor([first_token] + [cfg.mask_token_id] * cfg.num_draft_tokens)
    pos = first_pos + torch.arange(cfg.block_size)
    x = embed.double()[ids]
    for n in range(cfg.num_hidden_layers):
        p = lambda s: sd[f"layers.{n}.{s}.weight"]  # noqa: E731
        h = rms(x, p("input_layernorm"))
        q = rope(rms((h @ p("self_attn.q_proj").T).view(-1, nh, hd), p("self_attn.q_norm")), pos)
        k = torch.cat([rope(rms((src @ p("self_attn.k_proj").T).view(-1, nkv, hd), p("self_attn.k_norm")), ps)
                       for src, ps in ((ctx, ctx_pos), (h, pos))])
        v = torch.cat([(src @ p("self_attn.v_proj").T).view(-1, nkv, hd) for src in (ctx, h)])
        heads = []
        for i in range(nh):
            j = i // (nh // nkv)
            w = torch.softmax(q[:, i] @ k[:, j].T / math.sqrt(hd), dim=-1)
            heads.append(w @ v[:, j])
        x = x + torch.cat(heads, -1) @ p("self_attn.o_proj").T
        h = rms(x, p("post_attention_layernorm"))
        x = x + (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return rms(x, sd["norm.weight"])[1:]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    d = random_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    feats = torch.randn(2, 12, cfg.fc_in_features, generator=g)
    ids = torch.randint(0, cfg.vocab_size - 1, (2, 12), generator=g)
    return cfg, d, embed, feats, ids


def test_draft_hidden_matches_reference_with_padding(setup):
    cfg, d, embed, feats, ids = setup
    # Two requests, context lengths 5 and 9, padded to 11; request 0 also carries valid rows at
    # positions >= its first position, which must be ignored.
    n = torch.tensor([5, 9])
    ctx_pos = torch.arange(11).expand(2, 11)
    valid = torch.tensor([[True] * 7 + [False] * 4, [True] * 9 + [False] * 2])
    junk = feats[:, :11].clone()
    junk[~valid] = 1e3
    out = d.draft_hidden(junk, ctx_pos, valid, ids[torch.arange(2), n], n, embed)
    assert out.shape == (2, cfg.num_draft_tokens, cfg.hidden_size)
    for b in range(2):
        ref = reference_block(d, feats[b, :n[b]], torch.arange(n[b]), ids[b, n[b]].item(), n[b].item(), embed)
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-4, atol=1e-4)


def test_train_hidden_single_anchor_equals_draft_hidden(setup):
    cfg, d, embed, feats, ids = setup
    for a in (0, 1, 6, 11):
        tr = d.train_hidden(feats, ids, torch.tensor([[a], [a]]), embed)[:, 0]
        dr = d.draft_hidden(feats[:, :a], torch.arange(a).expand(2, a), torch.ones(2, a, dtype=torch.bool),
                            ids[:, a], torch.tensor([a, a]), embed)
        torch.testing.assert_close(tr, dr, rtol=1e-5, atol=1e-5)


def test_context_kv_override_is_what_the_block_attends(setup):
    """ctx_kv stands in for the drafter's own context K/V (vLLM's cached draft KV): its own K/V
    change nothing; another drafter's K/V (stale weights) change the drafts, but only through
    the context rows the blocks can see."""
    cfg, d, embed, feats, ids = setup
    anchors = torch.tensor([[3, 8], [5, 10]])
    pos = torch.arange(12).expand(2, 12)
    own = d.train_hidden(feats, ids, anchors, embed)
    torch.testing.assert_close(d.train_hidden(feats, ids, anchors, embed, d.context_kv(feats, pos)), own)
    other = random_drafter(cfg, seed=7)
    old = other.context_kv(feats, pos)
    stale = d.train_hidden(feats, ids, anchors, embed, old)
    assert not torch.allclose(stale, own, atol=1e-3)
    # Rows at or after position 10 are seen by no block but the one anchored at 10 (row 10 is
    # its first token, not context): splicing stale K/V there changes nothing.
    new = d.context_kv(feats, pos)
    late = pos.ge(10).view(2, 12, 1, 1)
    mixed = [(torch.where(late, ko, kn), torch.where(late, vo, vn))
             for (ko, vo), (kn, vn) in zip(old, new)]
    torch.testing.assert_close(d.train_hidden(feats, ids, anchors, embed, mixed), own)


def test_train_mask_entries():
    t, anchors = 10, torch.tensor([[2, 7, -1]])
    m = build_train_mask(anchors, t, BS)
    assert m.shape == (1, 3 * BS, t + 3 * BS) and m.dtype == torch.bool
    ctx, blk = m[0, :, :t], m[0, :, t:]
    for j, a in enumerate([2, 7, -1]):
        rows = slice(j * BS, (j + 1) * BS)
        expect_ctx = torch.arange(t) < a  # strictly before the anchor; none for unused
        assert torch.equal(ctx[rows], expect_ctx.expand(BS, t))
        expect_blk = torch.zeros(3 * BS, dtype=torch.bool)
        expect_blk[rows] = True  # own block, both directions; no other block
        assert torch.equal(blk[rows], expect_blk.expand(BS, -1))


def test_train_blocks_are_isolated(setup):
    cfg, d, embed, feats, ids = setup
    anchors = torch.tensor([[3, 7, -1], [8, 2, 5]])
    base = d.train_hidden(feats, ids, anchors, embed)

    def run(f=feats, i=ids, a=anchors):
        return d.train_hidden(f, i, a, embed)

    for b, j in [(0, 0), (0, 1), (1, 0), (1, 2)]:
        a = anchors[b, j].item()
        f = feats.clone(); f[b, a:] += 5.0  # context at/after the anchor
        torch.testing.assert_close(run(f=f)[b, j], base[b, j], rtol=0, atol=1e-6)
        i = ids.clone()  # the other blocks' first tokens
        for k in range(anchors.shape[1]):
            if k != j and anchors[b, k] >= 0 and anchors[b, k] != a:
                i[b, anchors[b, k]] = (i[b, anchors[b, k]] + 1) % (cfg.vocab_size - 1)
        torch.testing.assert_close(run(i=i)[b, j], base[b, j], rtol=0, atol=1e-6)
        if a > 0:  # context before the anchor does matter
            f = feats.clone(); f[b, a - 1] += 5.0
            assert (run(f=f)[b, j] - base[b, j]).abs().max() > 1e-3
        i = ids.clone(); i[b, a] = (i[b, a] + 1) % (cfg.vocab_size - 1)  # and so does its own token
        assert (run(i=i)[b, j] - base[b, j]).abs().max() > 1e-3
    # Removing the other blocks changes nothing for block (0, 0).
    alone = d.train_hidden(feats[:1], ids[:1], anchors[:1, :1], embed)
    torch.testing.assert_close(alone[0, 0], base[0, 0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(base).all()  # the unused anchor's rows stay finite


def test_block_labels():
    ids = torch.arange(10).view(1, 10) + 100
    labels, valid = block_labels(ids, torch.tensor([[2, 8, -1]]), 3)
    assert labels.tolist() == [[[103, 104, 105], [109, -100, -100], [-100, -100, -100]]]
    assert valid.tolist() == [[[True] * 3, [True, False, False], [False] * 3]]
    labels, _ = block_labels(ids, torch.tensor([[2]]), 3, lengths=torch.tensor([5]))
    assert labels.tolist() == [[[103, 104, -100]]]


def test_bf16_embedding_and_drafter(setup):
    cfg, d, embed, feats, ids = setup
    d16 = random_drafter(cfg).to(torch.bfloat16)
    out = d16.draft_hidden(feats[:, :4], torch.arange(4).expand(2, 4), torch.ones(2, 4, dtype=torch.bool),
                           ids[:, 4], torch.tensor([4, 4]), embed.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out = d16.train_hidden(feats, ids, torch.tensor([[1, 5], [2, -1]]), embed.bfloat16())
    assert out.dtype == torch.bfloat16


def test_train_hidden_gradients_flow_to_drafter_only(setup):
    cfg, _, embed, feats, ids = setup
    d = random_drafter(cfg).train()
    emb = embed.clone().requires_grad_(True)
    d.train_hidden(feats, ids, torch.tensor([[1, 5], [2, -1]]), emb).square().mean().backward()
    assert emb.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())


# ---------------------------------------------------------------- length head


def test_length_head_shapes_labels_loss():
    head = LengthHead(32, width=16)
    pred = head(torch.randn(2, 5, BS - 1, 32))
    assert pred.shape == (2, 5) and ((pred > 0) & (pred < 1)).all()
    acc = torch.tensor([0, 1, 3, 7])
    assert torch.allclose(length_label(acc, BS), torch.tensor([0.25, 0.5, 1.0, 1.0]))
    loss = length_loss(torch.full((4,), 0.5), acc, BS)
    assert torch.isclose(loss, torch.tensor((0.0625 + 0 + 0.25 + 0.25) / 4))
    masked = length_loss(torch.full((4,), 0.5), acc, BS, mask=torch.tensor([1, 1, 0, 0]))
    assert torch.isclose(masked, torch.tensor(0.0625 / 2))
    length_loss(head(torch.randn(3, BS - 1, 32)), acc[:3], BS).backward()
    assert head.inp.weight.grad is not None


def test_accepted_length():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 9, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    assert accepted_length(draft, target).tolist() == [3, 3, 0, 1]
    assert accepted_length(draft, target[:, :3]).tolist() == [3, 3, 0, 1]
