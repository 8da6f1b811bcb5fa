"""learner/memory.py and OnlineAlgorithm.reserve: the learner's state exists before vLLM profiles
memory, updates allocate no more of it, and a learner that cannot fit is refused with numbers."""

import pytest
import torch

from vllm_onlinespec.learner.algorithms import OGD, HedgeEnsemble, Optimistic
from vllm_onlinespec.learner.memory import GIB, LearnerFootprint, check_fits, learner_footprint

SHAPES = [(64, 32), (32,), (16, 64)]


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def ptrs(tensors):
    return sorted(t.untyped_storage().data_ptr() for t in tensors)


RULES = {"ogd": lambda ps: OGD(ps, lr=1e-2, weight_decay=0.01),
         "ensemble": lambda ps: HedgeEnsemble(ps, [1e-2, 1e-3]),
         "optimistic": lambda ps: Optimistic(ps, lr=1e-2)}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_reserved_state_is_what_the_updates_use(rule):
    ps = params()
    algo = RULES[rule](ps)
    algo.reserve()
    held = ptrs(algo.held_tensors())
    for step in range(4):
        g = grads(step)
        algo.step_closure(lambda g=g: (torch.tensor(1.0), g))
        after = ptrs(algo.held_tensors())
        if algo.transient_slots():  # rebound slots are new tensors each step: only those change
            assert set(held) <= set(after), step
        else:
            assert after == held, step  # no state or undo buffer allocated by an update


@pytest.mark.parametrize("rule", sorted(RULES))
def test_reserving_does_not_change_the_updates(rule):
    a, b = params(), params()
    ra, rb = RULES[rule](a), RULES[rule](b)
    ra.reserve()
    for step in range(3):
        g = grads(step)
        ra.step_closure(lambda g=g: (torch.tensor(1.0), [x.clone() for x in g]))
        rb.step_closure(lambda g=g: (torch.tensor(1.0), [x.clone() for x in g]))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_footprint_counts_state_grads_snapshots_and_logits():
    ps = params()
    algo = OGD(ps, lr=1e-2)
    algo.reserve()
    w = sum(p.numel() * 4 for p in ps)
    fp = learner_footprint(ps, algo, rows=16 * 4, vocab=1000)
    # two Adam moments, undo copies of the weights and both moments, the denominator buffers
    assert fp.weights == w and fp.optimizer == 6 * w and fp.grads == w
    assert fp.snapshots == 2 * w and fp.step_transient == 0
    assert fp.loss_logits == 3 * 64 * 1000 * 4
    assert fp.peak == fp.steady + fp.grads + fp.loss_logits
    assert "GiB held" in fp.describe("cpu")
    bf = learner_footprint(ps, algo, rows=1, vocab=1, snapshot_dtype=torch.bfloat16)
    assert bf.snapshots == w  # two bf16 copies


def test_check_fits_refuses_with_the_numbers(monkeypatch):
    fp = LearnerFootprint(weights=GIB, optimizer=4 * GIB, grads=GIB, snapshots=2 * GIB,
                          step_transient=0, loss_logits=GIB)
    check_fits(fp, torch.device("cpu"), 0.9)  # host memory is not vLLM's budget
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (40 * GIB, 141 * GIB))
    check_fits(fp, torch.device("cuda:0"), 0.9)  # 7 GiB held, 2 GiB more within 14.1 GiB
    with pytest.raises(MemoryError, match=r"adds 2.00 GiB .* \(1.41 GiB at gpu_memory_utilization 0.99"):
        check_fits(fp, torch.device("cuda:0"), 0.99)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (5 * GIB, 141 * GIB))
    with pytest.raises(MemoryError, match=r"holds 7.00 GiB \(5.00 GiB free now\)"):
        check_fits(fp, torch.device("cuda:0"), 0.9)
