"""Fault injection on the serving hooks, in ONE vLLM engine (CPU, float32, SmolLM2 target).

First, with the start weights: greedy output equals the HF target's token for token with
drafts cut by adaflash, vLLM's drafter equals its plain-PyTorch twin on every traced block, and
the target features vLLM captures equal HF's hidden states. Then, for each hook, an injected
exception in our code (a session, cutter or profile method made to raise inside the worker) is
counted under that hook's name, and greedy output stays identical to the HF target's. Last,
vLLM's drafter equals the twin AFTER a publish that changed every weight, and the digest reads
vLLM's weights back.
"""

import glob
import os
import shutil

import pytest
import torch

from engine_checks import K, assert_drafter_matches_twin, assert_greedy_equal, make_drafter

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

PROMPTS = ["What is 2+2?", "Write one sentence about the moon."]
PARITY_PROMPTS = ["What is 2+2?", "Name three colors.", "Write one sentence about the moon."]
PARITY_TOKENS = 24
MAX_TOKENS = 12
@pytest.fixture(scope="module")
def engine(smollm2_path, tmp_path_factory):
    from vllm import LLM

    from vllm_onlinespec.engine import engine_kwargs

    # Injecting faults sends functions to the worker (collective_rpc), which vLLM only
    # deserialises with this set; test-only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    tmp = tmp_path_factory.mktemp("faults")
    drafter = make_drafter(smollm2_path, str(tmp / "drafter"))
    trace = tmp / "trace"
    llm = LLM(model=smollm2_path, dtype="float32", **engine_kwargs(max_model_len=512),
              speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": K},
              additional_config={"onlinespec": {
                  # Learning on (feedback reaches the buffer, publish runs every step), but no
                  # update ever starts: the weights stay what this module puts there.
                  "min_new_tokens_per_update": 10 ** 9, "trace_dir": str(trace),
                  # A trusted constant-ish head is not shipped; cut hard on population rates.
                  "length_head": {"policy": "adaflash", "rho": 0.5}}})
    yield {"llm": llm, "drafter": drafter, "trace": trace, "tmp": tmp}
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


@pytest.fixture(scope="module")
def parity(engine):
    """Before any fault or publish: three prompts served with the start weights, and the trace
    of their steps kept apart (later tests trace into the engine's folder)."""
    shutil.rmtree(engine["trace"], ignore_errors=True)
    engine["trace"].mkdir()
    outs = generate(engine["llm"], PARITY_PROMPTS, PARITY_TOKENS)
    trace = engine["tmp"] / "parity-trace"
    shutil.copytree(engine["trace"], trace)
    return {"outs": outs, "stats": stats(engine["llm"]), "trace": trace,
            "drafter": engine["drafter"],
            "profile": engine["llm"].collective_rpc("onlinespec_step_profile")[0]}


def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    return llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


def stats(llm):
    from vllm_onlinespec.serving.stats import fetch

    return fetch(llm)


def inject(where: str, attr: str):
    def fn(worker):
        runner = worker.model_runner
        if where == "profile":
            class Broken:
                def __getattr__(self, name):
                    raise ZeroDivisionError(f"injected: profile.{name}")

            runner._onlinespec_saved_profile = runner._onlinespec_profile
            runner._onlinespec_profile = Broken()
            return True
        obj = runner._onlinespec if where == "session" else getattr(runner._onlinespec, where)

        def boom(*a, **k):
            raise ZeroDivisionError(f"injected: {where}.{attr}")

        setattr(obj, attr, boom)
        return True

    return fn


def restore(where: str, attr: str):
    def fn(worker):
        runner = worker.model_runner
        if where == "profile":
            runner._onlinespec_profile = runner._onlinespec_saved_profile
            return True
        obj = runner._onlinespec if where == "session" else getattr(runner._onlinespec, where)
        obj.__dict__.pop(attr, None)
        return True

    return fn


# (where, attribute made to raise, hooks that must count it)
FAULTS = [
    ("session", "capture", ["capture"]),
    ("feedback", "observe", ["feedback"]),
    ("session", "_publish", ["publish"]),
    ("session", "_write_metrics", ["metrics"]),
    ("drafting", "observe_step_cost", ["sample"]),
    ("cutter", "observe_hidden", ["draft_hidden"]),
    ("cutter", "cut", ["cut"]),
    ("profile", "*", ["execute_model", "sample", "propose_draft_token_ids"]),
]


# -- parity, with the start weights (before any fault) ----------------------------------------

def test_greedy_equal_to_no_speculation(parity, hf_target):
    assert_greedy_equal(parity["outs"], hf_target, PARITY_TOKENS)
    # The steps with drafts were verified by the lean greedy path (compat/greedy_verify.py).
    assert parity["profile"]["lean_greedy_steps"] > 0, parity["profile"]


def test_verify_policy_cut_drafts(parity):
    st = parity["stats"]
    assert 0 < st.cutter.verified < st.cutter.drafted, st
    assert st.cutter.last_reason.startswith("adaflash"), st
    assert st.hook_errors == 0, st


def test_vllm_drafter_matches_pytorch_twin(parity, hf_target):
    assert_drafter_matches_twin(parity["outs"], parity["trace"], parity["drafter"], hf_target)


def test_vllm_features_equal_hf_hidden_states(parity, hf_target):
    """The target features vLLM captures for committed tokens (the drafter's context, the
    learner's feedback) equal HF's for the same tokens: layer i's aux rows = HF
    hidden_states[i + 1], the final rows = HF's post-norm last state (float32, tolerance)."""
    from vllm_onlinespec.drafter import load_drafter

    layers = load_drafter(parity["drafter"], dtype=torch.float32)[0].target_layer_ids
    assert max(layers) < hf_target.config.num_hidden_layers - 1  # hidden_states[i+1] pre-norm
    ref = {}
    for o in parity["outs"]:
        seq = torch.tensor([list(o.prompt_token_ids) + list(o.outputs[0].token_ids)])
        with torch.no_grad():
            hs = hf_target.model(input_ids=seq, output_hidden_states=True).hidden_states
        ref[o.request_id] = (torch.cat([hs[i + 1][0] for i in layers], dim=-1), hs[-1][0])
    checked, worst = 0, 0.0
    for f in sorted(glob.glob(str(parity["trace"] / "*.pt"))):
        for r in torch.load(f):
            aux_ref, final_ref = ref[r["req_id"].split("-")[0]]
            pos = r["positions"]
            pos = pos[pos < len(aux_ref)]  # a final step's rows past the returned output
            for got, want in ((r["aux"][:len(pos)], aux_ref[pos]), (r["final"][:len(pos)], final_ref[pos])):
                worst = max(worst, ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
            checked += len(pos)
    n_tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in parity["outs"])
    assert checked >= n_tokens // 2, f"only {checked} of {n_tokens} positions traced"
    # fp32 C++ kernels vs PyTorch pass well under this; reading one layer off (hidden_states[i])
    # measured 0.61.
    assert worst < 1e-3, f"max relative error {worst:.3g}"


# -- faults -------------------------------------------------------------------------------------

def test_serving_starts_clean(engine, hf_target):
    outs = generate(engine["llm"])
    assert_greedy_equal(outs, hf_target, MAX_TOKENS)
    st = stats(engine["llm"])
    assert st.hook_errors == 0 and st.learner is not None and st.buffer.tokens_in > 0, st
    assert st.cutter.verified < st.cutter.drafted, st  # the cut path really ran


@pytest.mark.parametrize("where,attr,hooks", FAULTS, ids=[f"{w}.{a}" for w, a, _ in FAULTS])
def test_injected_fault_is_counted_and_output_stays_the_targets(engine, hf_target, where, attr, hooks):
    llm = engine["llm"]
    before = stats(llm).hooks.errors
    llm.collective_rpc(inject(where, attr))
    try:
        outs = generate(llm)
    finally:
        llm.collective_rpc(restore(where, attr))
    assert_greedy_equal(outs, hf_target, MAX_TOKENS)
    after = stats(llm).hooks.errors
    for hook in hooks:
        assert after.get(hook, 0) > before.get(hook, 0), (hook, before, after)


def test_vllm_drafter_matches_the_twin_after_a_publish(engine, hf_target, smollm2_path):
    """New weights (another seed, every tensor different) go through the learner's snapshot and
    the serving path's publish; vLLM's drafter must then compute what the twin computes."""
    from vllm_onlinespec.learner.checkpoint import state_digest

    llm = engine["llm"]
    new_dir = make_drafter(smollm2_path, str(engine["tmp"] / "drafter-v1"), seed=1)

    def set_learner_weights(worker):
        from vllm_onlinespec.drafter import load_drafter

        s = worker.model_runner._onlinespec
        _, twin, _ = load_drafter(new_dir, dtype=torch.float32)
        with torch.no_grad():
            for name, p in s.learner.model.drafter.named_parameters():
                p.copy_(twin.state_dict()[name])
        s.learner._publish(s.learner.version + 1)
        return s.learner.version

    errors_before = stats(llm).hook_errors
    v = llm.collective_rpc(set_learner_weights)[0]
    generate(llm, ["Say hi."], 2)  # one step: the publish lands at its end
    st = stats(llm)
    assert st.published_version == v and st.hook_errors == errors_before, st
    from vllm_onlinespec.drafter import load_drafter

    _, twin, _ = load_drafter(new_dir, dtype=torch.float32)
    old_digest = state_digest(load_drafter(engine["drafter"], dtype=torch.float32)[1].state_dict())
    digest = llm.collective_rpc("onlinespec_digest")[0]
    assert digest == state_digest(twin.state_dict()) and digest != old_digest
    shutil.rmtree(engine["trace"])
    engine["trace"].mkdir()
    # Prompts never served before: no prefix-cached draft KV from the old weights.
    outs = generate(llm, ["Tell me about rivers.", "What is a prime number?"], 20)
    assert_greedy_equal(outs, hf_target, 20)
    assert_drafter_matches_twin(outs, engine["trace"], new_dir, hf_target)
