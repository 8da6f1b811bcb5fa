"""The serving side of drafter-invariant verification (serving/compat/invariant_sampling.py)
without an engine: the bonus row at vLLM's largest K gets the request's own temperature and
top-k/top-p, and under tensor parallelism the ranks agree on whether a step's rewrite commits.
Engine-level checks: tests/test_invariant_sampling_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_onlinespec.serving.compat import invariant_sampling as IS


@pytest.fixture
def cpu_expand(monkeypatch):
    """vLLM's `expand_kernel` as the Triton kernel defines it (at most MAX_SPEC_LEN rows per
    request written; serving/cpu_defects.py has the exact CPU version), on an output poisoned
    with NaN first so that a row it never writes shows (`new_empty` memory is arbitrary)."""
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_onlinespec.serving.cpu_defects import exact_expand_kernel_impl

    def expand(output, inp, cu, replace_from, replace_to):
        output.fill_(float("nan") if output.is_floating_point() else -7)
        exact_expand_kernel_impl(output, inp, cu, replace_from, replace_to,
                                 MAX_NUM_TOKENS=rs.MAX_SPEC_LEN)

    monkeypatch.setattr(rs, "_expand", expand)
    return rs.MAX_SPEC_LEN


def _metadata(temps, top_k=None, top_p=None):
    return SimpleNamespace(all_greedy=False, temperature=torch.tensor(temps),
                           top_k=None if top_k is None else torch.tensor(top_k),
                           top_p=None if top_p is None else torch.tensor(top_p))


def _alone(row, t, k, p):
    """One row processed by itself: divided by its temperature, then top-k / top-p."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    x = (row / t)[None].clone()
    return apply_top_k_top_p(x, None if k is None else torch.tensor([k]),
                             None if p is None else torch.tensor([p]))[0]


@pytest.mark.parametrize("top_p", [None, [0.9, 0.8]])
def test_the_bonus_row_at_the_largest_k_gets_its_requests_parameters(cpu_expand, top_p):
    # K = MAX_SPEC_LEN (128, vLLM's largest: its rejection sampler asserts max_spec_len <= 128)
    # drafts, then the bonus row: 129 rows for request 0; request 1 a short one.
    k_max = cpu_expand
    counts = [k_max + 1, 3]
    temps, top_k = [0.5, 0.8], [5, 3]
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 40)
    got = IS._constrained(x.clone(), counts, _metadata(temps, top_k, top_p))
    req = [0] * counts[0] + [1] * counts[1]
    for r, i in enumerate(req):
        want = _alone(x[r], temps[i], top_k[i], None if top_p is None else top_p[i])
        assert torch.equal(got[r], want), (r, i)
    assert bool(torch.isfinite(got[k_max]).any())  # the bonus row: processed, not garbage


def test_rows_within_the_bound_take_one_pass(cpu_expand, monkeypatch):
    from vllm.v1.sample import rejection_sampler as rs

    calls, real = [], rs.apply_sampling_constraints

    def counting(x, cu, sm):
        calls.append(cu.tolist())
        return real(x, cu, sm)

    monkeypatch.setattr(rs, "apply_sampling_constraints", counting)
    IS._constrained(torch.randn(8, 10), [5, 0, 3], _metadata([0.7, 1.0, 0.9]))
    assert calls == [[5, 5, 8]]
    calls.clear()
    IS._constrained(torch.randn(cpu_expand + 2, 10), [cpu_expand + 1, 1],
                    _metadata([0.7, 1.0]))
    assert calls == [[cpu_expand, cpu_expand + 1], [1, 1]]


# --- tensor parallelism: the ranks agree on each step's rewrite ---------------------------------

V = 64
PH = -1  # vLLM's PLACEHOLDER_TOKEN_ID


def _step():
    """A fake runner and one spec-decode step: request "a" (seed 3, temperature 0.8) with two
    drafts, request "b" (seed 4, temperature 1.0) with one; the same on every rank. vLLM's own
    output row per request: token 5, then placeholders."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    gens = {i: torch.Generator().manual_seed(s) for i, s in ((0, 3), (1, 4))}
    sm = SamplingMetadata(
        temperature=torch.tensor([0.8, 1.0]), all_greedy=False, all_random=True, top_p=None,
        top_k=None, generators=gens, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(2),
        presence_penalties=torch.zeros(2), repetition_penalties=torch.ones(2),
        output_token_ids=[[1, 2], [3]], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    batch = SimpleNamespace(req_ids=["a", "b"], sampling_metadata=sm,
                            num_tokens_no_spec=[10, 20])
    runner = SimpleNamespace(input_batch=batch,
                             rejection_sampler=RejectionSampler.__new__(RejectionSampler))
    spec = SimpleNamespace(num_draft_tokens=[2, 1], max_spec_len=2,
                           draft_token_ids=torch.tensor([11, 12, 13]),
                           target_logits_indices=torch.tensor([0, 1, 3]),
                           bonus_logits_indices=torch.tensor([2, 4]))
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    vllm_rows = torch.tensor([[5, PH, PH], [5, PH, PH]])
    return runner, logits, spec, vllm_rows


def _run_step(verifier, fail: str | None):
    """before / vLLM's sample / after as the runner calls them (serving/runner.py `_sample`:
    each under the guard, which swallows what they raise). fail: None, "before" (a copy runs
    out of memory) or "after" (the processing does). Returns (rows committed, raised)."""
    runner, logits, spec, vllm_rows = _step()
    if fail == "before":
        spec.bonus_logits_indices = SimpleNamespace(
            tolist=lambda: (_ for _ in ()).throw(RuntimeError("out of memory (fake)")))
    if fail == "after":
        def oom(*a, **k):
            raise RuntimeError("out of memory (fake)")

        verifier._processed = oom
    out = SimpleNamespace(sampled_token_ids=vllm_rows.clone(), logprobs_tensors=None)
    raised = None
    try:
        pending = verifier.before(runner, logits, spec)
        if pending is not None:
            verifier.after(runner, pending, spec, out)
    except Exception as e:  # noqa: BLE001 - the runner's guard
        raised = str(e)
    finally:
        verifier.__dict__.pop("_processed", None)  # the failure lasts one step
    return out.sampled_token_ids.tolist(), raised


def _rank(rank: int, init: str, fail_on: dict, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    _install_cpu_expand()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        verifier = IS.InvariantVerifier("seeded")
        verifier.group = SimpleNamespace(cpu_group=dist.group.WORLD, world_size=2,
                                         rank_in_group=rank)
        res = []
        for step, fails in fail_on.items():  # the same steps, in order, on both ranks
            rows, raised = _run_step(verifier, fails.get(rank))
            res.append((step, rows, raised))
        q.put((rank, res, dict(verifier.fallbacks), verifier.covered_steps))
    finally:
        dist.destroy_process_group()


def _install_cpu_expand() -> None:
    """The `cpu_expand` fixture's patch, in a child process."""
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_onlinespec.serving.cpu_defects import exact_expand_kernel_impl

    def expand(output, inp, cu, replace_from, replace_to):
        exact_expand_kernel_impl(output, inp, cu, replace_from, replace_to,
                                 MAX_NUM_TOKENS=rs.MAX_SPEC_LEN)

    rs._expand = expand


def test_one_rank_failing_makes_both_ranks_keep_vllms_sample(tmp_path):
    """Two gloo ranks on CPU run the same four steps: both succeed; rank 1's processing runs
    out of memory; rank 0's copies in `before` do; both succeed again. Every step both ranks
    commit the same rows: the invariant ones, or vLLM's where any rank failed."""
    import multiprocessing as mp

    steps = {"ok": {}, "rank 1 after": {1: "after"}, "rank 0 before": {0: "before"},
             "ok again": {}}
    # spawned, not forked: this process may hold an in-process vLLM engine's OpenMP and
    # thread-binding state (tests marked engine_in_process), which a forked child inherits
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, init, steps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, res, fallbacks, covered = q.get(timeout=120)
        got[rank] = (res, fallbacks, covered)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    vllm_rows = _step()[3].tolist()
    (res0, fb0, cov0), (res1, fb1, cov1) = got[0], got[1]
    for (step, rows0, raised0), (_, rows1, raised1) in zip(res0, res1):
        assert rows0 == rows1, step  # the ranks never diverge
        if step.startswith("ok"):
            assert rows0 != vllm_rows and raised0 is raised1 is None, step  # rewritten
        else:
            assert rows0 == vllm_rows, step  # vLLM's sample, on both ranks
    assert "out of memory" in res1[1][2] and res0[1][2] is None  # only the failing rank raises
    assert "out of memory" in res0[2][2] and res1[2][2] is None
    assert fb0 == fb1 == {"rewrite failed": 4}  # 2 requests x 2 failed steps, on both ranks
    assert cov0 == cov1 == 4  # 2 requests x 2 committed steps


def test_without_tensor_parallelism_a_failed_rewrite_keeps_vllms_sample(cpu_expand):
    verifier = IS.InvariantVerifier("seeded", group=None)
    vllm_rows = _step()[3].tolist()
    rows, raised = _run_step(verifier, None)
    assert rows != vllm_rows and raised is None and verifier.covered_steps == 2
    # drafts equal to the invariant tokens are accepted: "a" drafted 2, "b" 1
    for fail in ("after", "before"):
        rows, raised = _run_step(verifier, fail)
        assert rows == vllm_rows and "out of memory" in raised
    assert verifier.fallbacks == {"rewrite failed": 4} and verifier.covered_steps == 2


def test_a_batch_of_covered_rows_is_sampled_without_vllms_sampler(cpu_expand):
    """Every request seeded and sampled (RL rollouts): the step's output is built here, row for
    row what `after` writes over vLLM's sample, and vLLM's sampler is skipped. One request
    unseeded (not covered): vLLM samples, as before. A failed rewrite: None, counted, raised."""
    verifier = IS.InvariantVerifier("seeded", group=None)
    rewritten, _ = _run_step(IS.InvariantVerifier("seeded", group=None), None)
    runner, logits, spec, _ = _step()
    pending = verifier.before(runner, logits, spec)
    assert verifier.replaces(runner, pending)
    out = verifier.sample(runner, pending, spec)
    assert out.sampled_token_ids.dtype == torch.int32 and out.logprobs_tensors is None
    assert out.sampled_token_ids.tolist() == rewritten
    assert verifier.replaced_steps == 1 and verifier.covered_steps == 2
    # A plain step (no drafts): one token per request, the invariant one.
    runner, logits, _, _ = _step()
    plain = verifier.sample(runner, verifier.before(runner, logits[:2], None), None)
    assert plain.sampled_token_ids.shape == (2, 1)
    assert plain.sampled_token_ids[:, 0].tolist() != [PH, PH]

    runner, logits, spec, _ = _step()
    runner.input_batch.sampling_metadata.generators.pop(1)  # request "b" unseeded
    assert not verifier.replaces(runner, verifier.before(runner, logits, spec))

    runner, logits, spec, _ = _step()
    pending = verifier.before(runner, logits, spec)

    def oom(*a, **k):
        raise RuntimeError("out of memory (fake)")

    verifier._processed = oom
    with pytest.raises(RuntimeError, match="out of memory"):
        verifier.sample(runner, pending, spec)
    assert verifier.fallbacks == {"rewrite failed": 2} and verifier.replaced_steps == 2
