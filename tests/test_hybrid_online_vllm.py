"""The README's recipe inside vLLM (CPU, float32): learning on, the budget verify policy, the
suffix tree as lookup source and vLLM's K twice the drafter's block. The learner trains the
drafter's own positions while tree drafts run longer; output stays the target's across
publishes, no hook fails, and the drafter sits some steps out."""

from __future__ import annotations

import pytest

from test_online import (MAX_TOKENS, PROMPTS, assert_lossless,
                         online_cfg, run_pass, wait_learned)
from engine_checks import K, make_drafter

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory, greedy_reference):
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs

    tmp = tmp_path_factory.mktemp("hybrid_online")
    drafter = make_drafter(smollm2_path, str(tmp / "drafter"))  # block K + 1
    cfg = {**online_cfg(str(tmp / "ckpt")),
           "length_head": {"policy": "budget", "k_min": 0},
           "prompt_lookup": {"enabled": True, "source": "suffix_tree"}}
    llm = LLM(model=smollm2_path, dtype="float32", **engine_kwargs(max_model_len=1024),
              disable_log_stats=False,
              speculative_config={"method": "dflash", "model": drafter,
                                  "num_speculative_tokens": 2 * K},
              additional_config={"onlinespec": cfg})
    passes = []
    try:
        for _ in range(3):  # the tree sees the earlier passes' answers: later passes draft more
            passes.append(run_pass(llm))
            st = wait_learned(llm)
        # Alone, a prompt whose answer the tree has seen: the tree drafts it in most steps.
        again = llm.chat([[{"role": "user", "content": PROMPTS[0]}]],
                         SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        st = wait_learned(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"passes": passes, "stats": st, "again": again}


def test_recipe_learns_losslessly_with_tree_drafts_past_the_block(served, greedy_reference):
    for outs, _ in served["passes"]:
        assert_lossless(outs, greedy_reference)
    assert list(served["again"][0].outputs[0].token_ids) == greedy_reference[PROMPTS[0]]
    st = served["stats"]
    assert st.hook_errors == 0, st.hooks
    assert st.learner.updates > 0 and st.learner.errors == 0 and st.published_version > 0, st
    assert st.lookup_rows > 0 and st.lookup_accepted > 0, st
    # Repeated prompts: the drafter sits some steps out, where the tree drafts every request or
    # where the budget's gate found its drafts not worth their price (which of the two depends on
    # the box's step timings; test_suffix_tree_vllm.py pins the tree's skip alone).
    assert st.lookup_skipped_steps + st.cutter.gate_shut_steps > 0, st
