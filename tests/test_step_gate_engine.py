"""The budget's step gate in a live engine (float32, SmolLM2 + the shipped drafter, learning
off): steps switch between the drafter's context-only K = 0 step (gate shut) and full drafts
(exploring), with prompt lookup drafting K tokens where the text repeats, also in steps the gate
shut, and between the budget's options (plain, lookup alone, drafter), and greedy output stays
the target's, token for token. A K = 0 step defers its context K/V (the default), and the
drafting step after it writes them as a context-only step would have; the context-only K = 0
step writes the same context K/V as vLLM's own K = 0 forward."""

import os

import pytest

from engine_checks import assert_greedy_equal

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

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

    # The K/V comparison sends a function to the worker (collective_rpc), which vLLM only
    # deserialises with this set; test-only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = LLM(model=smollm2_path, dtype="float32", **engine_kwargs(max_model_len=512),
              speculative_config={"method": "dflash", "model": str(shipped_drafter("smollm2-135m")),
                                  "num_speculative_tokens": K},
              additional_config={"onlinespec": {
                  "enabled": False,
                  # explore often: the run must switch between drafting and K = 0 many times.
                  # rho 0.25 prices a verified token 4x: in float32 on a fast CPU the drafter
                  # can pay at full K in every step, and a gate that never shuts never explores
                  # (a run of 50 open steps failed the precondition below).
                  # option_explore_every 2: steps switch between plain, lookup alone and the
                  # drafter every other step (policy/option_choice.py).
                  "length_head": {"policy": "budget", "k_min": 0, "explore_every": 3,
                                  "explore_requests": 4, "head_gate_labels": 8, "rho": 0.25,
                                  "option_explore_every": 2},
                  "prompt_lookup": {"enabled": True, "min_n": 1, "min_tokens": 1}}})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = []
        for _ in range(2):
            outs += llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params,
                             use_tqdm=False)
        stats = fetch(llm)
        assert llm.collective_rpc(check_deferred_context)[0]
        deferred_outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params,
                                 use_tqdm=False)
        deferred = llm.collective_rpc(deferred_report)[0]
        assert llm.collective_rpc(compare_k0_paths)[0]
        k0_outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params,
                           use_tqdm=False)
        k0 = llm.collective_rpc(k0_report)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"outs": outs, "stats": stats, "k0_outs": k0_outs, "k0": k0,
            "deferred_outs": deferred_outs, "deferred": deferred}


def check_deferred_context(worker):
    """On the worker: serving as configured (K = 0 steps deferred), beside a shadow copy of the
    drafter's K/V cache that every K = 0 step writes context-only, as it would have been
    written at once. At each drafting step, after the deferred rows are written and before
    vLLM's propose reads them, the K/V of every position a live request has computed must be
    the shadow's (float32: up to the rounding of one fc over more rows). Every other call is
    made a K = 0 step and every other one writes the kept rows first, whatever the gate
    decides (in this pass it may not draft at all)."""
    import torch

    from vllm_onlinespec.serving.compat.drafter import context_only_propose

    runner = worker.model_runner
    proposer = runner.drafter
    store, installed = proposer._onlinespec_deferred, proposer.propose
    m = proposer.model.model
    attns = m._attn_layers
    bs = int(proposer.block_size)
    rep = proposer._deferred_report = {"calls": 0, "k0_steps": 0, "catch_ups": 0, "written": 0,
                                       "compared_slots": 0, "max_rel": 0.0}
    state = {"shadow": None}

    def snapshot():
        return [a.kv_cache.clone() for a in attns]

    def k0_step(kw):
        """Deferred on the real cache, written context-only on the shadow."""
        rep["k0_steps"] += 1
        real = snapshot()
        for a, sh in zip(attns, state["shadow"]):
            a.kv_cache.copy_(sh)
        context_only_propose(proposer, **kw)
        state["shadow"] = snapshot()
        for a, r in zip(attns, real):
            a.kv_cache.copy_(r)
        return installed(0, **kw)

    def checking(num_speculative_tokens, **kw):
        if state["shadow"] is None:
            state["shadow"] = snapshot()
        rep["calls"] += 1
        if rep["calls"] % 2:  # every other call a K = 0 step
            return k0_step(kw)
        # the others write what the K = 0 steps kept (as a drafting step does before vLLM's
        # propose, or a K = 0 step whose store is full), then run as the gate asked
        cad = kw["common_attn_metadata"]
        written = store.catch_up(proposer, runner, cad)
        rep["catch_ups"] += int(written > 0)
        rep["written"] += written
        computed = runner.input_batch.num_computed_tokens_cpu[:cad.batch_size()]
        slots = torch.tensor([int(cad.block_table_tensor[i, p // bs]) * bs + p % bs
                              for i, n in enumerate(computed) for p in range(int(n))],
                             dtype=torch.int64)
        if slots.numel():
            rep["compared_slots"] += int(slots.numel())
            for a, sh in zip(attns, state["shadow"]):
                probe = a.kv_cache.clone()
                sentinel = torch.full((slots.numel(), m._num_kv_heads, m._head_dim), 12345.0,
                                      dtype=probe.dtype)
                a.impl.do_kv_cache_update(a, sentinel, sentinel.clone(), probe, slots)
                mask = probe != a.kv_cache
                diff = (a.kv_cache[mask] - sh[mask]).abs().max()
                rel = float(diff / sh[mask].abs().max().clamp(min=1e-6))
                rep["max_rel"] = max(rep["max_rel"], rel)
        if num_speculative_tokens == 0:
            return k0_step(kw)
        out = installed(num_speculative_tokens, **kw)
        state["shadow"] = snapshot()  # both hold this step's writes now
        return out

    proposer.propose = checking
    return store is not None


def deferred_report(worker):
    return dict(worker.model_runner.drafter._deferred_report)


def compare_k0_paths(worker):
    """On the worker: every other drafter call becomes a K = 0 step, run twice from the same
    cache state: vLLM's own K = 0 forward, then (cache restored) the context-only path that
    serves. Per step, every K/V element on which the two end states differ must lie in the
    bonus-query slots of vLLM's forward (found by writing a sentinel into those slots of a
    scratch copy: layout-free). Those rows are past the committed tokens (seq_lens excludes
    them) and the next step's context overwrites them."""
    import torch

    from vllm_onlinespec.serving.compat.drafter import context_only_propose

    proposer = worker.model_runner.drafter
    full = proposer._onlinespec_full_propose
    m = proposer.model.model
    attns = m._attn_layers
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8}

    def bits(t):  # bitwise: unwritten cache memory may hold NaNs, which never equal themselves
        return t.view(ints[t.element_size()])

    rep = proposer._k0_report = {"steps": 0, "written": 0, "outside_query": 0, "differing": 0,
                                 "shape_ok": 0, "calls": 0}

    def checking(num_speculative_tokens, **kw):
        rep["calls"] += 1
        if rep["calls"] % 2:
            return full(num_speculative_tokens, **kw)
        before = [a.kv_cache.clone() for a in attns]
        ref = full(0, **kw)
        B = kw["common_attn_metadata"].batch_size()
        query_slots = proposer._slot_mapping_buffer[:B].clone()  # 1 + 0 query rows a request
        by_full = [a.kv_cache.clone() for a in attns]
        for a, b in zip(attns, before):
            a.kv_cache.copy_(b)
        out = context_only_propose(proposer, **kw)
        rep["shape_ok"] += int(tuple(out.shape) == tuple(ref.shape) == (B, 0))
        for a, b, f in zip(attns, before, by_full):
            probe = b.clone()
            sentinel = torch.full((B, m._num_kv_heads, m._head_dim), 12345.0, dtype=b.dtype)
            a.impl.do_kv_cache_update(a, sentinel, sentinel.clone(), probe, query_slots)
            in_query = bits(probe) != bits(b)
            c, b, f = bits(a.kv_cache), bits(b), bits(f)
            rep["written"] += int((c != b).sum())
            rep["differing"] += int((c != f).sum())
            rep["outside_query"] += int(((c != f) & ~in_query).sum())
        rep["steps"] += 1
        return out

    proposer.propose = checking
    return True


def k0_report(worker):
    return dict(worker.model_runner.drafter._k0_report)


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


def test_switching_between_k0_and_drafting_is_lossless(served, hf_target):
    c = served["stats"].cutter
    # steps below K (shut, or the gate's shorter drafts) and full exploring drafts both ran
    assert c.gate_shut_steps + c.gate_short_steps > 0 and c.gate_explore_steps > 0, c
    assert served["stats"].hook_errors == 0, served["stats"].hooks
    # whole engine cycles were timed for both kinds of step the gate compares
    assert any(k.startswith("drafted@") for k in c.gate_overhead_s), c.gate_overhead_s
    assert any(k.startswith("k0@") for k in c.gate_overhead_s), c.gate_overhead_s
    assert served["stats"].lookup_rows > 0 and served["stats"].lookup_accepted > 0
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)


def test_steps_switch_between_plain_lookup_and_drafter_losslessly(served, hf_target):
    c = served["stats"].cutter
    assert all(c.option_steps.get(o, 0) > 0 for o in ("plain", "tree", "drafter")), c.option_steps
    # each option priced from its own measured cycles
    assert {k.split("@")[0] for k in c.option_ms_per_token} == {"plain", "tree", "drafter"}, \
        c.option_ms_per_token
    assert all(ms > 0 for ms in c.option_ms_per_token.values()), c.option_ms_per_token
    assert_greedy_equal(served["outs"], hf_target, MAX_TOKENS)


def test_the_head_was_scored_on_real_verification(served):
    c = served["stats"].cutter
    assert c.head_labels > 0 and c.head_feedback_updates > 0, c


def test_deferred_k0_steps_write_their_context_before_the_drafter_reads_it(served, hf_target):
    d = served["deferred"]
    assert d["k0_steps"] > 3 and d["catch_ups"] >= 1 and d["written"] > 0, d
    assert d["compared_slots"] > 0, d
    assert d["max_rel"] < 1e-4, d  # every computed position's K/V as context-only wrote it
    passes = served["stats"].drafter_passes
    assert passes["deferred"] > 0 and passes["deferred_written"] > 0, passes
    assert passes["deferred_errors"] == 0, passes
    assert_greedy_equal(served["deferred_outs"], hf_target, MAX_TOKENS)


def test_context_only_k0_step_writes_the_full_forwards_context_kv(served, hf_target):
    k0 = served["k0"]
    assert k0["steps"] > 3 and k0["written"] > 0 and k0["shape_ok"] == k0["steps"], k0
    # every K/V element outside vLLM's bonus-query slots is as its K = 0 forward left it
    assert k0["outside_query"] == 0, k0
    # drafts made right after context-only K = 0 steps are still verified: output is the target's
    assert_greedy_equal(served["k0_outs"], hf_target, MAX_TOKENS)
