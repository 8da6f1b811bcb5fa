"""The budget's step gate in a live engine (float32, SmolLM2 + the shipped drafter, learning
off): steps switch between vLLM's K = 0 drafter path (gate shut) and full drafts (exploring),
with prompt lookup drafting K tokens where the text repeats, also in steps the gate shut, and
greedy output stays the target's, token for token."""

import pytest
import torch

from test_worker_parity import assert_greedy_equal

pytestmark = pytest.mark.vllm

K = 4
MAX_TOKENS = 40
PROMPTS = ["Write a short poem about the sea.", "Explain photosynthesis simply.",
           "List five fruits and their colors.", "What is the capital of France?",
           "Repeat after me: I like green apples. I like green apples. I like green apples."]


@pytest.fixture(scope="module")
def served(smollm2_path):
    from vllm import LLM, SamplingParams

    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.models import shipped_drafter
    from vllm_onlinespec.serving.stats import fetch

    llm = LLM(model=smollm2_path, dtype="float32", **engine_kwargs(max_model_len=512),
              speculative_config={"method": "dflash", "model": str(shipped_drafter("smollm2-135m")),
                                  "num_speculative_tokens": K},
              additional_config={"onlinespec": {
                  "enabled": False,
                  # explore often: the run must switch between drafting and K = 0 many times.
                  # rho 0.25 prices a verified token 4x: in float32 on a fast CPU the drafter
                  # can pay at full K in every step, and a gate that never shuts never explores
                  # (a run of 50 open steps failed the precondition below).
                  "length_head": {"policy": "budget", "k_min": 0, "explore_every": 3,
                                  "explore_requests": 4, "head_gate_labels": 8, "rho": 0.25},
                  "prompt_lookup": {"enabled": True, "min_n": 1, "min_tokens": 1}}})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = []
        for _ in range(2):
            outs += llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params,
                             use_tqdm=False)
        stats = fetch(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"outs": outs, "stats": stats}


@pytest.fixture(scope="module")
def hf_target(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def test_switching_between_k0_and_drafting_is_lossless(served, hf_target):
    c = served["stats"].cutter
    # steps below K (shut, or the gate's shorter drafts) and full exploring drafts both ran
    assert c.gate_shut_steps + c.gate_short_steps > 0 and c.gate_explore_steps > 0, c
    assert served["stats"].hook_errors == 0, served["stats"].hooks
    assert served["stats"].lookup_rows > 0 and served["stats"].lookup_accepted > 0
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)


def test_the_head_was_scored_on_real_verification(served):
    c = served["stats"].cutter
    assert c.head_labels > 0 and c.head_feedback_updates > 0, c
