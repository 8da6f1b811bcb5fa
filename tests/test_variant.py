"""The changed target's recipe (training/variant.py, training/lora.py) on a tiny model: the
style transform, LoRA identity at start, the adapter's round trip through PEFT-format files and
the merge, training lowering the answer loss, bad adapters in one line."""

import json

import pytest
import torch

from vllm_onlinespec import models
from vllm_onlinespec.training import lora
from vllm_onlinespec.training.data import Prompt
from vllm_onlinespec.training.variant import (VariantRecipe, answer_loss, build_examples,
                                              terse_steps, train_adapter)

ANSWER = ("The capital of France is Paris. It is a very beautiful city with a long history.\n\n"
          "Here are some facts:\n1. The Eiffel Tower is an iconic landmark.\n"
          "2. Paris has the Louvre, which is the largest art museum in the world.")


def test_terse_steps_numbers_sentences_and_drops_articles():
    assert terse_steps(ANSWER) == (
        "1. Capital of France is Paris\n2. It is beautiful city with long history\n"
        "3. Here are some facts:\n4. Eiffel Tower is iconic landmark\n"
        "5. Paris has Louvre, which is largest art museum in world")
    assert terse_steps("```python\nprint(1)\n```") is None  # code keeps its form
    assert terse_steps("Just one sentence here.") is None
    assert terse_steps(ANSWER, max_steps=2).count("\n") == 1


def _tiny(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


IDS = torch.tensor([[1, 17, 300, 4000, 29, 77, 5, 9]])


def test_attached_lora_starts_as_the_identity_and_trains_only_the_factors(tiny_target_path):
    model = _tiny(tiny_target_path)
    ref = model(IDS).logits
    wrappers = lora.attach(model, lora.LoRAConfig(r=4))
    assert len(wrappers) == 4 * 7  # every attention and MLP projection of 4 layers
    torch.testing.assert_close(model(IDS).logits, ref)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_adapter_round_trip_and_merge_equal_the_fine_tuned_model(tiny_target_path, tmp_path):
    model = _tiny(tiny_target_path)
    cfg = lora.LoRAConfig(r=4, alpha=8.0)
    wrappers = lora.attach(model, cfg)
    torch.manual_seed(1)
    for w in wrappers.values():  # a "trained" adapter: B no longer zero
        torch.nn.init.normal_(w.lora_B.weight, std=0.05)
    tuned = model(IDS).logits
    lora.save(wrappers, cfg, tmp_path / "ad", base="tiny", dtype=torch.float32)
    conf = json.loads((tmp_path / "ad" / lora.ADAPTER_CONFIG).read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    cfg2, factors = lora.load(tmp_path / "ad")
    assert cfg2 == cfg and any(k.endswith("self_attn.q_proj.lora_A") for k in factors)
    fresh = _tiny(tiny_target_path)
    assert lora.merge(fresh, cfg2, factors) == len(wrappers)
    torch.testing.assert_close(fresh(IDS).logits, tuned, atol=1e-4, rtol=1e-4)
    # the same through the model provisioning path: an ordinary HF folder
    merged = models.merge_adapter(tiny_target_path, tmp_path / "ad", tmp_path / "merged",
                                  dtype="float32")
    torch.testing.assert_close(_tiny(merged)(IDS).logits, tuned, atol=1e-4, rtol=1e-4)


def test_bad_adapters_fail_in_one_line(tiny_target_path, tmp_path):
    with pytest.raises(lora.AdapterError, match="lacks adapter_config.json"):
        lora.load(tmp_path)
    model = _tiny(tiny_target_path)
    cfg = lora.LoRAConfig(r=4)
    good = lora.state_dict(lora.attach(_tiny(tiny_target_path), cfg))
    factors = {k[len(lora.PEFT_PREFIX):-len(".weight")]: v for k, v in good.items()}
    wrong = dict(factors)
    key = next(k for k in wrong if k.endswith("q_proj.lora_A"))
    wrong[key] = torch.zeros(4, 7)
    with pytest.raises(lora.AdapterError, match=r"q_proj.*\(4, 64\)") as e:
        lora.merge(model, cfg, wrong)
    assert "\n" not in str(e.value)
    with pytest.raises(lora.AdapterError, match="does not have"):
        lora.merge(model, cfg, {"model.nowhere.lora_A": torch.zeros(4, 64),
                                "model.nowhere.lora_B": torch.zeros(64, 4)})
    with pytest.raises(models.ModelError, match="lacks adapter_model.safetensors"):
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / lora.ADAPTER_CONFIG).write_text("{}")
        models.merge_adapter(tiny_target_path, tmp_path / "half", tmp_path / "out")


def test_training_the_adapter_lowers_the_answer_loss(tiny_target_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    prompts = [Prompt(id=f"p{i}", source="test", text=f"Tell me about item {i}.") for i in range(8)]
    examples = build_examples(tok, prompts, [ANSWER] * 8, max_seq=128)
    assert len(examples) == 8 and all(e.start < len(e.ids) for e in examples)
    model = _tiny(tiny_target_path)
    before = answer_loss(model, examples, pad_id=0).item()
    recipe = VariantRecipe(steps=16, batch_size=2, lr=1e-2, r=4, heldout=0, layers_from=0.0)
    _, report = train_adapter(model, examples, recipe, pad_id=0, log=lambda s: None)
    after = answer_loss(model, examples, pad_id=0).item()
    assert after < before - 0.5, (before, after)
    assert report["train_examples"] == 8


def test_the_variant_is_a_known_model_built_from_a_shipped_adapter():
    m = models.KNOWN_MODELS["smollm2-135m-terse"]
    assert m.base == "smollm2-135m" and m.adapter


def test_attach_can_be_limited_to_upper_layers(tiny_target_path):
    model = _tiny(tiny_target_path)
    wrappers = lora.attach(model, lora.LoRAConfig(r=2), under=["model.layers.2", "model.layers.3"])
    assert len(wrappers) == 2 * 7 and all(p.startswith(("model.layers.2.", "model.layers.3."))
                                          for p in wrappers)
