"""The suffix-tree lookup source served by vLLM through this project's worker (float32): greedy
output equals the target's own greedy text while steps switch between tree drafts and the
DFlash drafter's blocks."""

from __future__ import annotations

import pytest
import torch

from test_worker_parity import assert_greedy_equal

pytestmark = pytest.mark.vllm

# The first asks for repeated text (the tree drafts once it has seen it), the second is free text.
PROMPTS = ["Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
           "Name three colors."]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def served(smollm2_path):
    from vllm import LLM, SamplingParams

    from vllm_onlinespec import models
    from vllm_onlinespec.drafter import load_drafter
    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.serving.stats import fetch

    drafter = str(models.shipped_drafter("smollm2-135m"))
    k = load_drafter(drafter)[0].num_draft_tokens
    llm = LLM(model=smollm2_path, dtype="float32", disable_log_stats=False,
              **engine_kwargs(max_model_len=512),
              speculative_config={"method": "dflash", "model": drafter,
                                  "num_speculative_tokens": k},
              worker_cls="vllm_onlinespec.SpecDecodeWorker",
              additional_config={"onlinespec": {"enabled": False, "prompt_lookup": {
                  "enabled": True, "source": "suffix_tree", "suffix_min_score": 1.0}}})
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    stats = fetch(llm)
    llm.llm_engine.engine_core.shutdown()
    return {"outs": outs, "stats": stats, "drafts": found.get("vllm:spec_decode_num_drafts", 0)}


@pytest.fixture(scope="module")
def hf_target(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def test_suffix_tree_hybrid_is_lossless(served, hf_target):
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)
    assert served["stats"].hook_errors == 0


def test_steps_switch_between_tree_and_drafter(served):
    st = served["stats"]
    assert st.lookup_rows > 0 and st.lookup_accepted > 0  # the tree drafted and was accepted
    assert served["drafts"] > st.lookup_rows  # ... and the drafter drafted the other steps
