"""Reduced draft vocabulary (vLLM's draft_vocab_size + d2t): config, checkpoint round trip,
one-line errors, the twin's logits, the trainer's export and the learner's loss vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_onlinespec.drafter import (DFlashConfig, DFlashDrafter, DraftVocab, load_draft_vocab,
                                     load_drafter, load_drafter_config, save_drafter)


def _cfg(**kw):
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 1],
                mask_token_id=0, block_size=4, rope_theta=10000.0, torch_dtype="float32")
    base.update(kw)
    return DFlashConfig(**base)


def _vocab(head):
    return DraftVocab.of(head, torch.tensor([2, 7, 9, 30, 31, 49]))


def test_d2t_round_trip_in_vllms_format(tmp_path):
    torch.manual_seed(0)
    cfg, head = _cfg(), torch.randn(50, 32)
    vocab = _vocab(head)
    assert vocab.d2t().tolist() == [2, 6, 7, 27, 27, 44]  # target id = draft id + d2t
    save_drafter(tmp_path / "d", cfg, DFlashDrafter(cfg), draft_vocab=vocab)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 6 and raw["vocab_size"] == 50
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and list(tensors["lm_head.weight"].shape) == [6, 32]
    index = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    assert {"d2t", "lm_head.weight"} <= set(index["weight_map"])
    assert load_drafter_config(tmp_path / "d").draft_vocab_size == 6
    load_drafter(tmp_path / "d")  # the drafter itself still loads (lm_head/d2t set aside)
    back = load_draft_vocab(tmp_path / "d", dtype=torch.float32)
    assert torch.equal(back.ids, vocab.ids) and torch.equal(back.weight, vocab.weight)
    # A full-vocabulary checkpoint has none.
    save_drafter(tmp_path / "full", cfg, DFlashDrafter(cfg))
    assert load_draft_vocab(tmp_path / "full") is None
    assert "draft_vocab_size" not in json.loads((tmp_path / "full" / "config.json").read_text())


def test_reduced_logits_are_the_full_head_restricted_to_d2t():
    torch.manual_seed(1)
    head, h = torch.randn(50, 32), torch.randn(5, 32)
    vocab = _vocab(head)
    full = h @ head.T
    got = vocab.full_logits(h, 50)
    torch.testing.assert_close(got[:, vocab.ids], full[:, vocab.ids])
    outside = torch.ones(50, dtype=torch.bool)
    outside[vocab.ids] = False
    assert torch.isinf(got[:, outside]).all()
    # The argmax is the best subset token, a target id (what vLLM's compute_logits gives).
    assert torch.equal(got.argmax(-1), vocab.ids[full[:, vocab.ids].argmax(-1)])


@pytest.mark.parametrize("edit, msg", [
    (lambda t: t.pop("d2t"), "no 'd2t'"),
    (lambda t: t.__setitem__("d2t", t["d2t"][:4]), "d2t has shape"),
    (lambda t: t.__setitem__("d2t", t["d2t"] + 40), "outside the target vocabulary"),
    (lambda t: t.__setitem__("d2t", torch.zeros(6, dtype=torch.int64)), None),  # valid: 0..5
    (lambda t: t.__setitem__("d2t", torch.tensor([0, 0, 0, 0, 0, -1])), "distinct, ascending"),
    (lambda t: t.__setitem__("d2t", t["d2t"].float()), "integer offsets"),
    (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:, :16].contiguous()), "lm_head.weight has shape"),
])
def test_bad_draft_vocabulary_fails_in_one_line(tmp_path, edit, msg):
    cfg, head = _cfg(), torch.randn(50, 32)
    save_drafter(tmp_path / "d", cfg, DFlashDrafter(cfg), draft_vocab=_vocab(head))
    path = tmp_path / "d" / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    if msg is None:
        assert load_draft_vocab(tmp_path / "d").ids.tolist() == list(range(6))
        return
    with pytest.raises(ValueError, match=msg) as e:
        load_draft_vocab(tmp_path / "d")
    assert "\n" not in str(e.value)


def test_config_validates_the_size():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _cfg(draft_vocab_size=51)
    d = _cfg().to_hf_dict()
    d["draft_vocab_size"] = "many"
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DFlashConfig.from_hf_dict(d)
    d["draft_vocab_size"] = 50  # the whole vocabulary: not a reduced one
    assert DFlashConfig.from_hf_dict(d).draft_vocab_size is None
    with pytest.raises(ValueError, match="no draft_vocab was given"):
        save_drafter("/tmp/unused-dv", _cfg(draft_vocab_size=6), DFlashDrafter(_cfg()))


def test_most_frequent_keeps_the_top_counts_and_forced_tokens():
    head = torch.randn(10, 4)
    counts = torch.tensor([5, 0, 9, 1, 9, 0, 0, 3, 0, 0])
    v = DraftVocab.most_frequent(head, counts, 3, always=torch.tensor([8]))
    assert v.ids.tolist() == [2, 4, 8]
    assert torch.equal(v.index_of(torch.tensor([4, 5, 8])), torch.tensor([1, -1, 2]))


def test_learner_objective_trains_the_served_rows(tmp_path):
    from vllm_onlinespec.config import LossConfig
    from vllm_onlinespec.learner.factory import DistillObjective

    head = torch.randn(50, 32)
    vocab = _vocab(head)
    obj = DistillObjective(torch.randn(50, 32), head, LossConfig(vocab="seen"), "cpu",
                           draft_vocab=vocab)
    got = obj.vocab_for(torch.tensor([[1, 3, 4]]))  # tokens outside: the served rows anyway
    assert got is not None and torch.equal(got.ids, vocab.ids)
