"""Target feature extraction: vLLM's aux-layer convention on an HF Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_onlinespec.training.features import target_features


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def test_layer_index_convention_and_final_hidden(llama):
    ids = torch.randint(0, 1024, (3, 11))
    layer_ids = [0, 2, 3]
    aux, final = target_features(llama, ids, None, layer_ids)
    h = llama.config.hidden_size
    assert aux.shape == (3, 11, 3 * h) and final.shape == (3, 11, h)
    assert not aux.requires_grad and not torch.is_inference(aux)

    with torch.no_grad():
        out = llama(ids, output_hidden_states=True)
    hs = out.hidden_states  # [0] = embeddings, [i+1] = after layer i (last one post-norm in HF)
    for j, i in enumerate(layer_ids[:2]):
        torch.testing.assert_close(aux[..., j * h:(j + 1) * h], hs[i + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(aux[..., :h], hs[0])  # not off by one towards the embeddings
    # Last layer: vLLM's aux layer L is the pre-norm stream; the final norm of it is final_hidden.
    last = aux[..., 2 * h:]
    assert not torch.allclose(last, hs[4], atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(llama.model.norm(last), final, rtol=0, atol=1e-5)
        torch.testing.assert_close(final @ llama.lm_head.weight.T, out.logits, rtol=1e-5, atol=1e-5)


def test_chunking_and_right_padding(llama):
    ids = torch.randint(0, 1024, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 6:] = 0
    aux, final = target_features(llama, ids, mask, [1, 2])
    aux2, final2 = target_features(llama, ids, mask, [1, 2], batch_chunk=3)
    torch.testing.assert_close(aux, aux2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final2, rtol=1e-5, atol=1e-5)
    alone, _ = target_features(llama, ids[1:2, :6], None, [1, 2])
    torch.testing.assert_close(aux[1:2, :6], alone, rtol=1e-5, atol=1e-5)


def test_rejects_out_of_range_layers(llama):
    with pytest.raises(ValueError, match="out of range"):
        target_features(llama, torch.zeros(1, 3, dtype=torch.long), None, [1, 4])


def test_shared_prefix_equals_full_forward(llama):
    """Running a prompt once for all of its answers gives each answer's own full-sequence
    features (the prompt's KV cache repeated, the answers right-padded on top)."""
    from vllm_onlinespec.training.features import shared_prefix_features

    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 1024, (7,), generator=g).tolist()
    conts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 2, 9)]
    got = shared_prefix_features(llama, prefix, conts, [0, 3])
    for c, (aux, final) in zip(conts, got):
        ref_aux, ref_final = target_features(llama, torch.tensor([prefix + c]), None, [0, 3])
        assert aux.shape == ref_aux[0].shape and final.shape == ref_final[0].shape
        torch.testing.assert_close(aux, ref_aux[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final, ref_final[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        shared_prefix_features(llama, prefix, conts, [4])
