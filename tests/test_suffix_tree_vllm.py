"""The suffix-tree lookup source served by vLLM through this project's worker (float32): greedy
output equals the target's own greedy text while steps switch between tree drafts and the
DFlash drafter's blocks. vLLM's K is twice the drafter's block: the drafter drafts its own 4,
a confident tree match up to 8, and steps where the tree drafts every request skip the drafter
(context K/V only)."""

from __future__ import annotations

import pytest

from engine_checks import assert_greedy_equal

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

# The first two answers copy their prompts (the tree drafts long, confident matches), the last
# is free text.
PROMPTS = ["Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
           "kiwi, lemon, mango.",
           "Repeat after me: I like green apples. I like green apples. I like green apples.",
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
                                  "num_speculative_tokens": 2 * k},
              worker_cls="vllm_onlinespec.SpecDecodeWorker",
              additional_config={"onlinespec": {"enabled": False, "prompt_lookup": {
                  "enabled": True, "source": "suffix_tree", "suffix_min_score": 1.0}}})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    # Alone, a copying request has a tree draft in most steps: the drafter sits those out.
    outs += llm.chat([[{"role": "user", "content": PROMPTS[0]}]], params, use_tqdm=False)
    metrics = llm.get_metrics()
    found = {m.name: m.value for m in metrics if hasattr(m, "value")}
    per_pos = next((m.values for m in metrics
                    if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"), [])
    stats = fetch(llm)
    llm.llm_engine.engine_core.shutdown()
    return {"outs": outs, "stats": stats, "drafts": found.get("vllm:spec_decode_num_drafts", 0),
            "accepted_per_pos": list(per_pos), "k": k}


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


def test_suffix_tree_hybrid_is_lossless(served, hf_target):
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)
    assert served["stats"].hook_errors == 0


def test_steps_switch_between_tree_and_drafter(served):
    st = served["stats"]
    assert st.lookup_rows > 0 and st.lookup_accepted > 0  # the tree drafted and was accepted
    assert served["drafts"] > st.lookup_rows  # ... and the drafter drafted the other steps


def test_tree_drafts_past_the_drafters_block_and_skips_the_drafter(served):
    st, k = served["stats"], served["k"]
    per_pos = served["accepted_per_pos"]
    assert len(per_pos) == 2 * k and sum(per_pos[k:]) > 0, (per_pos, st)  # accepted past k
    assert st.lookup_skipped_steps > 0, st  # steps where the tree drafted every request
