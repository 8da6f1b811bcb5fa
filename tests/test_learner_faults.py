"""Fault injection into one learner update: whatever breaks (the loss, a gradient, the update rule,
one Hedge member), the update must leave the parameters AND the whole update-rule state
(moments, optimistic hints, step counts, Hedge weights and cumulative losses, member weights and
their optimizer states) bit-identical to before, count the failure, and the next good update must
give exactly what a learner that never saw the fault gives (so nothing stays poisoned)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_onlinespec.learner.learner import OnlineLearner

F, H = 5, 3
TEACHER = torch.randn(F, H, generator=torch.Generator().manual_seed(11))
ALGORITHMS = ["ogd", "optimistic", "optimistic_momentum", "ensemble"]
ENSEMBLE_MEMBERS = 3
FAULTY_MEMBER = 1  # a middle member: members before it have already been evaluated/updated


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, F, generator=g)
    return x, x @ TEACHER


class Faults:
    """Arms one fault for the next update. `calls` counts loss_fn calls in that update, so an
    ensemble fault hits only FAULTY_MEMBER's evaluation (loss_fn runs once per member)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.calls = 0
        self.ensemble = False  # set by make(): whether loss_fn runs once per member

    def arm(self, kind: str | None) -> None:
        self.kind, self.calls = kind, 0

    def loss_fn(self, model: nn.Module, b):
        x, y = b
        self.calls += 1
        loss = nn.functional.mse_loss(model(x), y)
        hit = self.calls == FAULTY_MEMBER + 1 if self.ensemble else True
        if hit and self.kind == "nan_loss":
            loss = loss * float("nan")
        elif hit and self.kind == "nan_grad":  # finite loss (+0), non-finite gradient
            loss = loss + torch.sqrt(model.weight.abs() - model.weight.abs()).sum()
        elif hit and self.kind == "loss_raises":
            raise RuntimeError("injected loss failure")
        return loss, {"mse": float(loss.detach())}


def make(algorithm: str, faults: Faults) -> OnlineLearner:
    torch.manual_seed(0)
    cfg = {"update": {"algorithm": algorithm, "lr": 3e-2, "grad_clip": None,
                      "ensemble_lrs": [1e-2, 3e-2, 1e-1][:ENSEMBLE_MEMBERS], "weight_decay": 0.01},
           "pacing": {"learner_cpu_share": 1.0}, "min_new_tokens_per_update": 1}
    faults.ensemble = algorithm == "ensemble"
    return OnlineLearner(nn.Linear(F, H), cfg, faults.loss_fn, lambda b: None)


def flat_state(lr: OnlineLearner) -> dict[str, object]:
    """Every tensor and number of the model and of algo.state_dict(), by path, cloned."""
    out: dict[str, object] = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, torch.Tensor):
            out[prefix] = x.detach().clone()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}[{i}]", v)
        else:
            out[prefix] = x

    walk("model", dict(lr.model.state_dict()))
    walk("algo", lr.algo.state_dict())
    walk("served", dict(lr.latest()[1]))
    out["version"] = lr.version
    out["updates"] = lr.updates
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: state entries differ: {set(a) ^ set(b)}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}: {k}"
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


def poison_after(target, action: str) -> None:
    """Make target.step run normally, then break: 'nan' writes NaN into its last parameter,
    'raise' raises (the rule's in-place changes are already made)."""
    original = target.step

    def step(*args, **kw):
        original(*args, **kw)
        if action == "nan":
            with torch.no_grad():
                target.params[-1].view(-1)[0] = float("nan")
        else:
            raise RuntimeError("injected update-rule failure")

    target.step = step


def heal(target) -> None:
    target.__dict__.pop("step", None)


# fault -> (status, counter, where the update rule is broken)
FAULTS = {
    "nan_loss": ("nonfinite", "skipped_nonfinite", None),
    "nan_grad": ("nonfinite", "skipped_nonfinite", None),
    "loss_raises": ("error", "errors", None),
    "nan_param": ("nonfinite", "skipped_nonfinite", "nan"),  # NaN parameter after the step
    "rule_raises": ("error", "errors", "raise"),  # exception in the update rule
    "member_raises": ("error", "errors", "raise"),  # exception in one Hedge member's update
    "member_nan": ("nonfinite", "skipped_nonfinite", "nan"),  # one Hedge member goes NaN
}
MEMBER_FAULTS = {"member_raises", "member_nan"}


def cases():
    for algorithm in ALGORITHMS:
        for fault in FAULTS:
            if fault in MEMBER_FAULTS and algorithm != "ensemble":
                continue
            for good_before in (0, 2):  # on the very first update (no state yet) and later
                yield pytest.param(algorithm, fault, good_before,
                                   id=f"{algorithm}-{fault}-after{good_before}")


@pytest.mark.parametrize("algorithm, fault, good_before", list(cases()))
def test_failed_update_leaves_everything_bit_identical(algorithm, fault, good_before):
    faults, ref_faults = Faults(), Faults()
    lr, ref = make(algorithm, faults), make(algorithm, ref_faults)
    for s in range(good_before):
        assert lr.sync_step(batch(s)) == "updated"
        assert ref.sync_step(batch(s)) == "updated"
    before = flat_state(lr)
    status, counter, rule = FAULTS[fault]
    target = None
    if rule is not None:
        target = lr.algo.algos[FAULTY_MEMBER] if fault in MEMBER_FAULTS else lr.algo
        poison_after(target, rule)
    else:
        faults.arm(fault)

    assert lr.sync_step(batch(100)) == status
    assert getattr(lr, counter) == 1 and lr.errors + lr.skipped_nonfinite == 1
    assert_same(before, flat_state(lr), f"after the failed update ({fault})")

    faults.arm(None)
    if target is not None:
        heal(target)
    # Not stuck: the next good update succeeds and equals a learner that never saw the fault.
    assert lr.sync_step(batch(7)) == "updated"
    assert ref.sync_step(batch(7)) == "updated"
    assert_same(flat_state(ref), flat_state(lr), "next good update vs a fault-free twin")
    assert lr.updates == good_before + 1 and lr.version == good_before + 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_repeated_faults_never_poison_later_updates(algorithm):
    """Faults interleaved with good updates: the learner tracks its fault-free twin exactly."""
    faults, ref_faults = Faults(), Faults()
    lr, ref = make(algorithm, faults), make(algorithm, ref_faults)
    kinds = ["nan_param", "rule_raises", "nan_loss"]
    for s in range(6):
        target = lr.algo.algos[FAULTY_MEMBER] if algorithm == "ensemble" else lr.algo
        kind = kinds[s % len(kinds)]
        if kind == "nan_loss":
            faults.arm(kind)
        else:
            poison_after(target, "nan" if kind == "nan_param" else "raise")
        assert lr.sync_step(batch(50 + s)) in ("nonfinite", "error")
        faults.arm(None)
        heal(target)
        assert lr.sync_step(batch(s)) == "updated"
        assert ref.sync_step(batch(s)) == "updated"
        assert_same(flat_state(ref), flat_state(lr), f"after round {s}")
    assert lr.errors + lr.skipped_nonfinite == 6
