"""A pushed policy (tensors, no folder) is checked against the served architecture before
anything reaches vLLM: every name a checkpoint weight, every shape the served one, another
vocabulary named as such, nothing missing; each problem is one line (serving/target_swap.py)."""

import pytest
import torch

from vllm_onlinespec.serving.target_swap import SwapError, check_push


@pytest.fixture(scope="module")
def served():
    """A tiny Llama: its HF config dict (what vLLM serves) and a matching state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    return cfg.to_dict(), state


def one_line(weights, current) -> str:
    with pytest.raises(SwapError) as e:
        check_push(current, weights)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_whole_policy_passes_as_a_dict_or_pairs(served):
    current, state = served
    assert [n for n, _ in check_push(current, state)] == list(state)
    assert len(check_push(current, list(state.items()))) == len(state)
    # The tied head may come too (a state_dict() with it).
    assert len(check_push(current, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})) \
        == len(state) + 1


def test_bad_pushes_fail_in_one_line_naming_the_problem(served):
    current, state = served
    name = "model.layers.0.mlp.up_proj.weight"
    assert "model.layers.9.mlp.up_proj.weight is not a weight of the served LlamaForCausalLM" in \
        one_line({**state, "model.layers.9.mlp.up_proj.weight": state[name]}, current)
    assert f"{name} has shape (64, 16); the served model's is (64, 32)" in \
        one_line({**state, name: torch.zeros(64, 16)}, current)
    other_vocab = {**state, "model.embed_tokens.weight": torch.zeros(128, 32)}
    assert "another vocabulary (the served model has vocab_size = 96)" in one_line(other_vocab, current)
    missing = {k: v for k, v in state.items() if k != name}
    assert f"push misses 1 of the served model's" in one_line(missing, current)
    assert name in one_line(missing, current)
    assert "not a floating-point tensor" in one_line({**state, name: torch.zeros(64, 32, dtype=torch.int64)}, current)
    assert "empty" in one_line({}, current)
    assert "(name, tensor) pairs" in one_line([("x",)], current)


def test_the_push_travels_as_one_safetensors_buffer(served):
    """What push_target sends through vLLM's RPC (msgpack, no pickle) comes back whole in the
    worker; a buffer that is not safetensors is one line."""
    from safetensors.torch import save

    from vllm_onlinespec.serving.target_swap import unpack_push

    current, state = served
    back = unpack_push(save({n: t.contiguous() for n, t in state.items()}))
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
    assert len(check_push(current, back)) == len(state)
    with pytest.raises(SwapError) as e:
        unpack_push(b"not safetensors")
    assert "not a safetensors buffer" in str(e.value) and "\n" not in str(e.value)
