"""Real vLLM on CPU: offline greedy chat equals HF transformers, token for token (float32)."""

import pytest

pytestmark = pytest.mark.vllm

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from vllm import LLM

    from vllm_onlinespec.engine import engine_kwargs

    engine = LLM(model=smollm2_path, dtype="float32", **engine_kwargs(max_model_len=512))
    yield engine
    del engine


def test_chat_greedy_matches_transformers(llm, smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        assert list(out.prompt_token_ids) == ids[0].tolist()
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected = gen[0, ids.shape[1]:].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == expected[: len(got)] and len(got) == len(expected), (prompt, got, expected)
        assert out.outputs[0].text.strip()
