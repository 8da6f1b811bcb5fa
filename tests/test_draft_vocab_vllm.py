"""A reduced draft vocabulary (draft_vocab_size + d2t) served by vLLM through this project's
worker, float32: output equal to the target's greedy text, vLLM's drafter equal to the twin,
and vLLM drafting only inside the vocabulary.

The vocabulary is the shipped drafter's with every token of the target's greedy answers taken
out: a drafter that (as vLLM does) takes its argmax inside the vocabulary can then never draft
a token the target accepts, so accepted tokens must be exactly 0 while drafts are made; the
same drafter over the whole vocabulary accepts some (test_shipped_drafter).
"""

from __future__ import annotations

import pytest
import torch

from engine_checks import assert_drafter_matches_twin, assert_greedy_equal

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


@pytest.fixture(scope="module")
def served(smollm2_path, hf_target, tmp_path_factory):
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_onlinespec import models
    from vllm_onlinespec.drafter import DraftVocab, load_drafter, save_drafter
    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.serving.stats import fetch

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    answers = set()
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = hf_target.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=MAX_TOKENS, do_sample=False)
        answers |= set(out[0, ids.shape[1]:].tolist())
    W = hf_target.lm_head.weight.detach()
    keep = torch.ones(W.shape[0], dtype=torch.bool)
    keep[list(answers)] = False
    vocab = DraftVocab.of(W, keep.nonzero().squeeze(1))
    cfg, drafter, head = load_drafter(models.shipped_drafter("smollm2-135m"), dtype=torch.float32)
    tmp = tmp_path_factory.mktemp("draft_vocab")
    path = save_drafter(tmp / "drafter", cfg, drafter, head, dtype=torch.float32,
                        draft_vocab=vocab)
    k = cfg.num_draft_tokens
    llm = LLM(model=smollm2_path, dtype="float32", disable_log_stats=False,
              **engine_kwargs(max_model_len=512),
              speculative_config={"method": "dflash", "model": str(path),
                                  "num_speculative_tokens": k},
              worker_cls="vllm_onlinespec.SpecDecodeWorker",
              additional_config={"onlinespec": {"enabled": False, "trace_dir": str(tmp / "trace")}})
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    stats = fetch(llm)
    llm.llm_engine.engine_core.shutdown()
    return {"outs": outs, "drafter": path, "trace": tmp / "trace", "k": k, "stats": stats,
            "answers": answers, "drafts": found.get("vllm:spec_decode_num_drafts", 0),
            "accepted": found.get("vllm:spec_decode_num_accepted_tokens", 0)}


def test_reduced_vocabulary_is_lossless(served, hf_target):
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)
    assert served["stats"].hook_errors == 0


def test_vllm_drafts_only_inside_the_vocabulary(served):
    outputs = {t for o in served["outs"] for t in o.outputs[0].token_ids}
    assert outputs <= served["answers"]  # what the vocabulary leaves out is what was served
    assert served["drafts"] > 0 and served["accepted"] == 0


def test_vllm_reduced_drafter_matches_the_twin(served, hf_target):
    assert_drafter_matches_twin(served["outs"], served["trace"], served["drafter"], hf_target,
                                k=served["k"])
