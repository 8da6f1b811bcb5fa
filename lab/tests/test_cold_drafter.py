"""The cold-start drafter of the target-shift benchmark: the shipped drafter's shape and draft
vocabulary (target-owned rows), every trained weight fresh."""

import importlib.util
from pathlib import Path

import torch

from vllm_onlinespec.drafter.checkpoint import load_draft_vocab, load_drafter
from vllm_onlinespec.models import shipped_drafter


def test_cold_drafter_keeps_shape_and_vocab_and_drops_trained_weights(tmp_path):
    path = Path(__file__).resolve().parents[1] / "cold_drafter.py"
    spec = importlib.util.spec_from_file_location("cold_drafter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    like = shipped_drafter("smollm2-135m")
    out = mod.cold_drafter(like, tmp_path / "cold", seed=0)
    cfg, cold, head = load_drafter(out, dtype=torch.float32)
    cfg0, trained, _ = load_drafter(like, dtype=torch.float32)
    assert cfg.to_hf_dict() == cfg0.to_hf_dict() and head is None
    v, v0 = load_draft_vocab(out), load_draft_vocab(like)
    assert torch.equal(v.ids, v0.ids) and torch.equal(v.weight, v0.weight)
    for (name, p), p0 in zip(cold.named_parameters(), trained.parameters()):
        if p.dim() == 2:  # every trained matrix is fresh
            assert not torch.allclose(p, p0), name
    again = mod.cold_drafter(like, tmp_path / "again", seed=0)
    assert torch.equal(load_drafter(again)[1].fc.weight, load_drafter(out)[1].fc.weight)
