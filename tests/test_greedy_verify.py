"""compat/greedy_verify.py: an all-greedy step verified on the logits in the model's dtype gives
vLLM's own rejection sampler's tokens, bit for bit; steps it cannot read that way are left to
vLLM. No engine: vLLM's RejectionSampler on synthetic steps."""

from types import SimpleNamespace

import pytest
import torch

V = 1000


@pytest.fixture(scope="module", autouse=True)
def vllm_kernels():
    """What vLLM's CPU worker does at start: its C++ ops, and its C++ stand-ins for the Triton
    kernels (the rejection sampler's among them) where Triton has no CPU backend."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        current_platform.import_kernels()
        current_platform.register_triton_kernel_overrides()


def step(seed: int, num_draft: list[int], dtype: torch.dtype, ties: bool = False):
    """(logits [drafts + requests, V], draft ids, spec metadata): drafts that match the target's
    argmax for a random prefix of each request, so acceptance lengths vary."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(num_draft) + len(num_draft), V, generator=g).to(dtype)
    if ties:  # equal maxima in every row: the first one must win in both paths
        logits[:, 7] = logits[:, 3] = logits.max() + 1
    drafts = []
    row = 0
    for n in num_draft:
        keep = int(torch.randint(0, n + 1, (1,), generator=g))
        for i in range(n):
            best = int(logits[row + i].float().argmax())
            # past the kept prefix: another token, or with ties the later of the equal maxima
            drafts.append(best if i < keep else 7 if ties else (best + 1) % V)
        row += n + 1
    spec = SpecDecodeMetadata.make_dummy([drafts[sum(num_draft[:i]):sum(num_draft[:i + 1])]
                                          for i in range(len(num_draft))], device=torch.device("cpu"))
    return logits, spec


def metadata(**over):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    b = over.pop("batch")
    kw = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
              generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
              frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
              repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
              allowed_token_ids_mask=None, bad_words_token_ids={},
              logitsprocs=LogitsProcessors())
    kw.update(over)
    return SamplingMetadata(**kw)


def runner(sm):
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    return SimpleNamespace(rejection_sampler=RejectionSampler(Sampler()),
                           input_batch=SimpleNamespace(sampling_metadata=sm))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ties", [False, True])
def test_lean_greedy_verification_gives_vllms_tokens(dtype, ties):
    from vllm_onlinespec.serving.compat import greedy_verify

    for seed, num_draft in enumerate([[4], [16, 0, 3, 16], [1, 2, 3, 4, 5, 6, 7, 8], [0, 0],
                                      [2] * 32]):
        logits, spec = step(seed, num_draft, dtype, ties)
        sm = metadata(batch=len(num_draft))
        r = runner(sm)
        ours = greedy_verify.verify(r, logits.clone(), spec)
        theirs = r.rejection_sampler(spec, None, logits.clone(), sm)
        assert ours is not None
        assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids), (seed, num_draft)
        assert ours.logprobs_tensors is None


def test_steps_that_read_more_than_the_argmax_are_left_to_vllm():
    from vllm_onlinespec.serving.compat import greedy_verify

    logits, spec = step(0, [4, 4], torch.bfloat16)
    for over in (dict(all_greedy=False), dict(max_num_logprobs=2), dict(no_penalties=False),
                 dict(allowed_token_ids_mask=torch.zeros(2, V, dtype=torch.bool)),
                 dict(bad_words_token_ids={0: [[5]]})):
        assert greedy_verify.verify(runner(metadata(batch=2, **over)), logits, spec) is None, over
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    for cls, state, active in ((MinTokensLogitsProcessor, "min_toks", {0: (8, [], set(), False)}),
                               (LogitBiasLogitsProcessor, "biases", {1: {5: 10.0}})):
        proc = cls.__new__(cls)  # only its per-request state is read
        setattr(proc, state, {})
        sm = metadata(batch=2)
        sm.logitsprocs.non_argmax_invariant.append(proc)
        assert greedy_verify.verify(runner(sm), logits, spec) is not None  # idle: no request
        setattr(proc, state, active)
        assert greedy_verify.verify(runner(sm), logits, spec) is None, cls.__name__
    sm = metadata(batch=2)  # a processor the path does not know: vLLM's path
    sm.logitsprocs.non_argmax_invariant.append(SimpleNamespace())
    assert greedy_verify.verify(runner(sm), logits, spec) is None
    assert greedy_verify.verify(runner(metadata(batch=2)), logits, None) is None  # no drafts


def test_the_vllmgreedy_arm_leaves_every_step_to_vllm(tmp_path, monkeypatch):
    from vllm_onlinespec.bench.arm_catalog import make_arm
    from vllm_onlinespec.models import shipped_drafter
    from vllm_onlinespec.serving.compat import greedy_verify

    spec = make_arm("frozen+vllmgreedy", target="t", prompts="p", out_dir=tmp_path,
                    drafter=str(shipped_drafter("smollm2-135m")))
    assert spec.env == {greedy_verify.DISABLE_ENV: "0"} and spec.name == "frozen+vllmgreedy"
    assert greedy_verify.enabled()
    monkeypatch.setenv(greedy_verify.DISABLE_ENV, "0")
    assert not greedy_verify.enabled()
