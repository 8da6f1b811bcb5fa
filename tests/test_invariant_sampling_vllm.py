"""Seeded requests reproduce on a learning engine: drafter-invariant verification inside vLLM
(float32, SmolLM2 target, the shipped drafter learning, adaflash cutting drafts, prompt lookup
drafting where the text repeats; one engine for the module).

- the same seeded requests give the same tokens before and after the learner publishes new
  weights, in another batch and order, with a chunk-prefilled prompt among them, and those
  tokens are the no-speculation reference's (a PyTorch loop: the target's logits, temperature
  and top-k/top-p as vLLM applies them, the Gumbel-max token fixed by seed and position);
- drafts of sampled requests, drawn by the drafter with the verifier's noise (coupled
  drafts), are accepted (the prefix rule runs, not only the fallback token);
- greedy rows batched with them stay the target's greedy output;
- the second token follows the target's distribution (chi-square over distinct seeds);
- an unseeded request keeps vLLM's sampling (mode 'seeded').
"""

from __future__ import annotations

import time

import pytest
import torch

from test_sampled_lossless import (N_DRAWS, P_FLOOR, chat, fit, hf_greedy, hf_target,  # noqa: F401
                                   long_prompt, make_llm)

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

LOOKUP = {"enabled": True, "min_n": 1, "min_tokens": 1}
ONLINE = {"update": {"lr": 1e-3}, "min_new_tokens_per_update": 8,
          "pacing": {"learner_cpu_share": 0.8},
          "length_head": {"policy": "adaflash"}, "prompt_lookup": LOOKUP,
          "sampling": {"invariant": "seeded", "coupled_drafts": True}}
MAX_TOKENS = 24
SEEDED = [  # (prompt, sampling kwargs)
    ("Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
     dict(temperature=0.7, seed=11)),
    ("Write a short poem about the sea.", dict(temperature=1.0, seed=12)),
    ("List five fruits and their colors.", dict(temperature=0.8, top_k=40, seed=13)),
    ("Explain photosynthesis simply.", dict(temperature=0.9, top_p=0.9, seed=14)),
    (long_prompt(), dict(temperature=0.7, top_k=20, top_p=0.95, seed=15)),  # chunk-prefilled
]
GREEDY = ["What is 2+2?", "Name three colors."]


def spec_counters(llm) -> tuple[float, float]:
    m = {x.name: x for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_accepted_tokens"].value, m["vllm:spec_decode_num_draft_tokens"].value


def stats(llm):
    from vllm_onlinespec.serving.stats import fetch

    return fetch(llm)


def seeded_params():
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw) for _, kw in SEEDED]


def reference(hf, prompt_ids: list[int], kw: dict, n: int) -> list[int]:
    """No speculation: one token per target forward, processed like vLLM's sampler, chosen by
    the invariant Gumbel-max rule at its absolute position."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from vllm_onlinespec.sampling.invariant import invariant_tokens

    ids, out, past = torch.tensor([prompt_ids]), [], None
    with torch.no_grad():
        for _ in range(n):
            res = hf(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[:, -1].float() / kw["temperature"]
            k = torch.tensor([kw["top_k"]]) if "top_k" in kw else None
            p = torch.tensor([kw["top_p"]]) if "top_p" in kw else None
            logits = apply_top_k_top_p(logits, k, p)
            tok = int(invariant_tokens(logits, torch.tensor([kw["seed"]]),
                                       torch.tensor([ids.shape[1]]))[0])
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return out


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from vllm_onlinespec.models import shipped_drafter

    engine = make_llm(smollm2_path, str(shipped_drafter("smollm2-135m")), ONLINE)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def runs(llm):
    """Pass A: the seeded requests beside greedy ones. Then other traffic until the learner
    has published. Pass B: the seeded requests alone, in reverse order."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    convs = [chat(p) for p, _ in SEEDED] + [chat(p) for p in GREEDY]
    outs_a = llm.chat(convs, seeded_params() + [greedy] * len(GREEDY), use_tqdm=False)
    version_a = stats(llm).published_version
    deadline = time.time() + 240
    while stats(llm).published_version <= version_a and time.time() < deadline:
        llm.chat([chat("Tell me about the history of Rome."), chat("How do airplanes fly?")],
                 SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    version_b = stats(llm).published_version
    a0, d0 = spec_counters(llm)
    whole0 = stats(llm).invariant_whole_steps
    outs_b = llm.chat(convs[:len(SEEDED)][::-1], seeded_params()[::-1], use_tqdm=False)[::-1]
    a1, d1 = spec_counters(llm)
    return {"a": outs_a, "b": outs_b, "versions": (version_a, version_b),
            "accepted_b": a1 - a0, "drafted_b": d1 - d0, "stats": stats(llm),
            "whole_steps_b": stats(llm).invariant_whole_steps - whole0}


def test_seeded_requests_reproduce_across_published_versions(runs, hf_target):
    """Pass A (beside greedy rows: vLLM samples, the seeded rows are rewritten) and pass B
    (seeded rows only: every step sampled here, vLLM's sampler skipped) give the same tokens."""
    va, vb = runs["versions"]
    assert vb > va, "the learner published nothing between the two passes"
    assert runs["whole_steps_b"] > 0, runs["stats"]
    for (prompt, kw), a, b in zip(SEEDED, runs["a"], runs["b"]):
        got_a, got_b = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        assert got_a == got_b, (prompt[:40], kw)
        assert got_a == reference(hf_target, list(a.prompt_token_ids), kw, MAX_TOKENS), kw


def test_sampled_drafts_are_accepted_and_counted(runs):
    # Pass B holds sampled requests only: accepted drafts there went through the prefix rule.
    assert runs["drafted_b"] > 0 and runs["accepted_b"] > 0, runs
    st = runs["stats"]
    assert st.invariant_mode == "seeded" and st.invariant_rows > 0, st
    assert st.coupled_rows > 0, st  # the drafter drew its drafts with the verifier's noise
    assert st.hook_errors == 0, st.hooks


def test_greedy_rows_beside_them_stay_the_targets(runs, hf_target):
    for o in runs["a"][len(SEEDED):]:
        got = list(o.outputs[0].token_ids)
        assert got == hf_greedy(hf_target, list(o.prompt_token_ids), len(got)), o.prompt


def test_second_tokens_follow_the_target_distribution(llm, hf_target):
    before = spec_counters(llm)[1]
    res = fit(llm, hf_target, "T1")
    assert spec_counters(llm)[1] - before >= N_DRAWS, "too few drafts verified"
    assert stats(llm).invariant_rows >= N_DRAWS
    assert res.bins >= 5 and res.p_value > P_FLOOR and abs(res.z_top) < 4, res.summary()


def test_unseeded_requests_keep_vllms_sampling_in_seeded_mode(llm):
    from vllm import SamplingParams

    before = stats(llm).invariant_rows
    out = llm.chat([chat("Name a bird.")], SamplingParams(temperature=1.0, max_tokens=8,
                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert stats(llm).invariant_rows == before


def test_a_processor_applies_before_the_noise(llm, hf_target):
    """top_k = 1 leaves one token per position: whatever the noise, the output is greedy's."""
    from vllm import SamplingParams

    out = llm.chat([chat("Name three colors.")],
                   SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=16),
                   use_tqdm=False)[0]
    got = list(out.outputs[0].token_ids)
    assert got == hf_greedy(hf_target, list(out.prompt_token_ids), len(got))
