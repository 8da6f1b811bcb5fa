"""The continuous protocol with a real engine (float32, SmolLM2, the shipped drafter learning):
requests join the running batch as 3 closed-loop clients send them, the learner publishes
while they run, and every greedy answer still equals the HF target's, token for token. The
windows add up to the stream and carry the drafter versions. The shipped drafter drafts from a
reduced vocabulary (draft_vocab_size + d2t): the learner trains the rows vLLM serves, and its
checkpoints keep that vocabulary. One engine for the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Not engine_in_process: the engine loop steps the engine from its own thread, and an
# in-process CPU worker's OpenMP settings belong to the thread that started it.
pytestmark = pytest.mark.vllm

MAX_TOKENS = 32
PROMPTS = ["Write a short poem about the sea.", "Explain photosynthesis simply.",
           "List five fruits and their colors.", "Why do cats purr?",
           "Give me three tips for a good night's sleep.", "What causes earthquakes?",
           "Describe the water cycle step by step.", "How do bees make honey?"]


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory):
    from vllm import SamplingParams

    import vllm_onlinespec.bench.arm_process as AP
    from vllm_onlinespec.bench.arm_catalog import make_arm
    from vllm_onlinespec.bench.results import ArmResult
    from vllm_onlinespec.models import shipped_drafter

    tmp = tmp_path_factory.mktemp("continuous")
    online = {"update": {"lr": 2e-3}, "min_new_tokens_per_update": 8,
              "pacing": {"learner_cpu_share": 0.8},
              "batch_blocks": 32, "anchors_per_request": 8,
              # a checkpoint at every publish: the last test reads one back
              "checkpoint": {"every_n_versions": 1}}
    spec = make_arm("online-ogd", target=smollm2_path, prompts=str(tmp / "p.jsonl"), out_dir=tmp,
                    drafter=str(shipped_drafter("smollm2-135m")), online=online, dtype="float32",
                    max_tokens=MAX_TOKENS, arrivals="closed:3", window_s=1.0)
    prompts = [{"id": str(i), "category": "chat", "messages": [{"role": "user", "content": p}]}
               for i, p in enumerate(PROMPTS)]
    outputs: dict[str, list[int]] = {}
    real = AP.request_result

    def capture(o, index, prompt, *a):
        outputs[prompt["id"]] = list(o.outputs[0].token_ids)
        return real(o, index, prompt, *a)

    AP.request_result = capture
    llm = AP.make_llm(spec)
    res = ArmResult(spec=spec)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        AP.serve_continuous(llm, spec, prompts, params, res)
        final = AP.onlinespec_stats(llm, spec)
        AP.request_result = real  # the answers compared below are the continuous stream's
        # The wave protocol on the same engine: its bookkeeping.
        waves = ArmResult(spec=spec)
        AP.serve_waves(llm, spec, prompts[:4], params, waves)
    finally:
        AP.request_result = real
        llm.llm_engine.engine_core.shutdown()
    return res, outputs, prompts, final, waves, Path(spec.onlinespec["checkpoint"]["dir"])


def test_wave_protocol_on_the_same_engine(served):
    waves = served[4]
    assert len(waves.waves) == 1 and waves.waves[0].prompts == 4 and len(waves.requests) == 4
    assert waves.waves[0].output_tokens == sum(r.output_tokens for r in waves.requests)
    assert waves.serve_s == waves.waves[0].wall_s > 0


def test_every_request_served_once_and_windows_add_up(served):
    res, outputs, prompts, final, *_ = served
    assert not res.failed and len(res.requests) == len(PROMPTS)
    assert sorted(r.prompt_id for r in res.requests) == sorted(p["id"] for p in prompts)
    assert sum(w.output_tokens for w in res.waves) == sum(r.output_tokens for r in res.requests)
    assert sum(w.prompts for w in res.waves) == len(PROMPTS)
    assert sum(w.wall_s for w in res.waves) == pytest.approx(res.serve_s)
    assert sum(w.drafts for w in res.waves) > 0
    assert all(r.submit_s <= r.finish_s for r in res.requests)
    # Three clients: at most three in flight, and later requests were sent after earlier ones ended.
    events = sorted([(r.submit_s, 1) for r in res.requests] + [(r.finish_s, -1) for r in res.requests],
                    key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    assert peak <= 3
    versions = [w.version_end for w in res.waves]
    assert versions == sorted(versions) and versions[-1] == final.published_version


def test_greedy_output_equals_the_target_while_learning(served, smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res, outputs, prompts, final, *_ = served
    assert final.published_version >= 1, "the learner never published during the stream"
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()
    for p in prompts:
        ids = tok.encode(tok.apply_chat_template(p["messages"], add_generation_prompt=True,
                                                 tokenize=False), add_special_tokens=False)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        want = ref[0, len(ids):].tolist()
        got = outputs[p["id"]]
        if tok.eos_token_id in want:  # vLLM stops at EOS and keeps it; HF pads after it
            want = want[:want.index(tok.eos_token_id) + 1]
        assert got == want, f"prompt {p['id']}: vLLM {got} != HF {want}"


def test_learner_checkpoints_keep_the_reduced_vocabulary(served):
    from vllm_onlinespec.drafter import load_draft_vocab
    from vllm_onlinespec.learner import checkpoint as ckpt
    from vllm_onlinespec.models import shipped_drafter

    final, folder = served[3], served[5]
    assert final.learner.errors == 0 and final.hook_errors == 0, final
    shipped = load_draft_vocab(shipped_drafter("smollm2-135m"))
    assert shipped is not None and shipped.ids.numel() < 49152  # reduced: the case tested
    newest = ckpt.latest_complete(folder)
    assert newest is not None, f"the learner wrote no checkpoint under {folder}"
    got = load_draft_vocab(newest / ckpt.MODEL_DIR)
    assert got is not None and torch.equal(got.ids, shipped.ids)
