"""The trained default drafter that ships inside the package: present, small, documented, and
lossless when vLLM serves it (float32 greedy output equals the target's own, token for token)."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_onlinespec import models
from vllm_onlinespec.drafter import load_drafter

# The engine test runs vLLM's in-process engine core (conftest: ~20 s less per start).
pytestmark = pytest.mark.engine_in_process

MAX_BYTES = 40 * 2**20  # the 3-layer drafter is 33 MB in bf16


def test_shipped_drafter_is_installed_small_and_documented(smollm2_path):
    from transformers import AutoConfig

    path = models.shipped_drafter("smollm2-135m")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size <= MAX_BYTES, f"{path}: {size} bytes"
    cfg, drafter, head = load_drafter(path)
    assert cfg.torch_dtype == "bfloat16" and next(drafter.parameters()).dtype == torch.bfloat16
    tcfg = AutoConfig.from_pretrained(smollm2_path)
    assert cfg.target_hidden_size == tcfg.hidden_size and cfg.vocab_size == tcfg.vocab_size
    assert max(cfg.target_layer_ids) < tcfg.num_hidden_layers
    meta = json.loads((path / "train_meta.json").read_text())
    # The demo's shifted domain must stay out of the shipped drafter's training data.
    assert "math_reasoning" in meta["excluded_categories"]
    assert meta["command"].startswith("vllm-onlinespec train --recipe smollm2-")
    assert meta["train_response_tokens"] > 0 and meta["evals"]
    # A trained drafter, not a fresh one: norms moved away from their init of 1.
    assert not torch.allclose(drafter.norm.weight.float(), torch.ones_like(drafter.norm.weight.float()))


def test_shipped_drafter_lists_its_held_out_prompts():
    """The prompts its recipe held out by hash, readable as a prompt file (the domain-shift
    benchmark's own-domain stream): never the demo's domain, as many as the recipe evaluated."""
    from vllm_onlinespec.bench.prompts import from_file

    path = models.shipped_drafter("smollm2-135m")
    held = from_file(path / "heldout_prompts.jsonl")
    meta = json.loads((path / "train_meta.json").read_text())
    assert len(held) == meta["prompts"]["heldout"] >= 20
    assert not any(p.category == "math_reasoning" for p in held)
    assert len({p.text for p in held}) == len(held)


def test_unknown_or_missing_shipped_drafter(monkeypatch, tmp_path):
    with pytest.raises(models.ModelError, match="unknown model"):
        models.shipped_drafter("nope")
    monkeypatch.setitem(models.SHIPPED_DRAFTERS, "smollm2-135m", "not-there")
    with pytest.raises(models.ModelError, match="incomplete"):
        models.shipped_drafter("smollm2-135m")


PROMPTS = ["Give me three tips for a good night's sleep.", "Write a Python function that "
           "reverses a string.", "What is the capital of France? Answer in one sentence."]


@pytest.mark.vllm
def test_shipped_drafter_is_lossless_in_vllm_fp32(smollm2_path, hf_smollm2):
    from vllm import LLM, SamplingParams

    from engine_checks import assert_greedy_equal
    from vllm_onlinespec.engine import engine_kwargs

    drafter = str(models.shipped_drafter("smollm2-135m"))
    k = load_drafter(drafter)[0].num_draft_tokens
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    llm = LLM(model=smollm2_path, dtype="float32", disable_log_stats=False,
              **engine_kwargs(max_model_len=1024),
              speculative_config={"method": "dflash", "model": drafter,
                                  "num_speculative_tokens": k})
    try:
        outs = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
        found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    finally:
        llm.llm_engine.engine_core.shutdown()
    # The target's own greedy continuation (HF, float32), as test_serving_faults compares.
    assert_greedy_equal(outs, hf_smollm2, 48)
    # the drafter drafts something the target accepts
    assert found.get("vllm:spec_decode_num_accepted_tokens", 0) > 0
