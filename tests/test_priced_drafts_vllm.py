"""The budget's estimators and pricing inside vLLM (CPU, float32): the confidence estimator
reads vLLM's draft logits, the suffix tree's drafts are priced, and greedy output stays the
target's own. Verify tokens are made dear (rho 0.3) so both cut drafts in this short run."""

from __future__ import annotations

import pytest

from engine_checks import assert_greedy_equal

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

PROMPTS = ["Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
           "kiwi, lemon, mango.",
           "Repeat after me: I like green apples. I like green apples. I like green apples.",
           "Name three colors.", "What is 12 times 7? Explain step by step."]
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
    llm = LLM(model=smollm2_path, dtype="float32", **engine_kwargs(max_model_len=512),
              speculative_config={"method": "dflash", "model": drafter,
                                  "num_speculative_tokens": 2 * k},
              worker_cls="vllm_onlinespec.SpecDecodeWorker",
              additional_config={"onlinespec": {
                  "enabled": False,
                  "length_head": {"policy": "budget", "k_min": 0, "rho": 0.3, "gate": False,
                                  "estimator": "confidence"},
                  "prompt_lookup": {"enabled": True, "source": "suffix_tree"}}})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    stats = fetch(llm)
    llm.llm_engine.engine_core.shutdown()
    return {"outs": outs, "stats": stats}


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


def test_priced_and_estimated_drafts_are_lossless(served, hf_target):
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)
    assert served["stats"].hook_errors == 0, served["stats"].hooks


def test_the_estimator_learned_from_verification_and_the_tree_was_priced(served):
    st = served["stats"]
    assert st.cutter.estimator_labels > 0, st.cutter
    assert "no_draft_confidence" not in st.hooks.skips, st.hooks
    assert 0 < st.cutter.verified < st.cutter.drafted, st.cutter
    assert st.lookup_rows > 0 and st.lookup_priced_cut > 0, st
