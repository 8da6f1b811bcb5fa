"""The serving hooks without an engine: fake vLLM runners, views and sessions.

The guard rule (serving/guard.py): our exceptions are counted and vLLM's step goes on with
vLLM's own result; vLLM's exceptions reach vLLM unchanged. after_step's three stages (feedback,
publish, metrics) fail independently. Records carry the version that drafted them; the head is
refreshed from the snapshot that was published. serving/feedback.py's row arithmetic.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_onlinespec.config import LengthHeadConfig
from vllm_onlinespec.policy.cutter import DraftCutter
from vllm_onlinespec.serving import guard as G
from vllm_onlinespec.serving.compat.step_view import StepView
from vllm_onlinespec.serving.guard import HookGuard


# -- the runner mixin over a fake vLLM runner ----------------------------------------------------

class VllmError(RuntimeError):
    pass


class FakeVllmRunner:
    """Stands in for vLLM's V1 runner: returns sentinels, raises on request."""

    raise_in: set[str] = set()

    def __init__(self) -> None:
        self.raise_in = set()
        self.drafts = SimpleNamespace(draft_token_ids=[[1, 2, 3], [4, 5, 6]])

    def _maybe(self, name: str) -> None:
        if name in self.raise_in:
            raise VllmError(name)

    def execute_model(self, scheduler_output, *a, **k):
        self._maybe("execute_model")
        return "exec-out"

    def _sample(self, logits, meta):
        self._maybe("_sample")
        return SimpleNamespace(sampled_token_ids=[[1, -1]])

    def propose_draft_token_ids(self, *a, **k):
        self._maybe("propose")
        return "proposed"

    def sample_tokens(self, grammar_output):
        self._maybe("sample_tokens")
        self._sample(None, None)
        return "sampled-out"

    def take_draft_token_ids(self):
        self._maybe("take")
        return self.drafts


class RaisingSession:
    """Every session method the runner calls raises (our bug)."""

    def __getattr__(self, name):
        def boom(*a, **k):
            raise ZeroDivisionError(f"ours: {name}")

        return boom


class BrokenProfile:
    """A step profile whose every attribute access raises."""

    def __getattr__(self, name):
        raise ZeroDivisionError(f"profile.{name}")


@pytest.fixture
def runner():
    from vllm_onlinespec.serving.runner import runner_class

    r = runner_class(FakeVllmRunner)()
    r._onlinespec_init()
    return r


def _drive(r):
    so = SimpleNamespace(total_num_scheduled_tokens=3)
    return (r.execute_model(so), r.propose_draft_token_ids(so), r.sample_tokens(None),
            r.take_draft_token_ids())


def test_our_exceptions_in_every_hook_are_counted_and_vllm_results_returned(runner):
    runner._onlinespec = RaisingSession()
    drafts_before = [list(d) for d in runner.drafts.draft_token_ids]
    out = _drive(runner)
    assert out[:3] == ("exec-out", "proposed", "sampled-out")
    assert out[3] is runner.drafts and out[3].draft_token_ids == drafts_before  # uncut
    errors = runner.onlinespec_guard().errors
    for hook in (G.SAMPLE, G.GATE, G.CAPTURE, G.FEEDBACK, G.CUT):
        assert errors[hook] >= 1, (hook, errors)


def test_a_broken_profile_never_changes_a_step(runner):
    runner._onlinespec_profile = BrokenProfile()
    assert _drive(runner)[:3] == ("exec-out", "proposed", "sampled-out")
    errors = runner.onlinespec_guard().errors
    for hook in (G.EXECUTE_MODEL, G.SAMPLE, G.PROPOSE):
        assert errors[hook] >= 1, (hook, errors)


@pytest.mark.parametrize("where", ["execute_model", "_sample", "propose", "sample_tokens", "take"])
def test_vllm_exceptions_propagate_unchanged(runner, where):
    runner.raise_in = {where}
    with pytest.raises(VllmError) as e:
        if where == "_sample":
            runner._sample(None, None)
        else:
            _drive(runner)
    assert str(e.value) == where
    assert runner.onlinespec_guard().total_errors == 0  # not ours: never counted, never eaten


def test_guard_counts_exceptions_but_not_keyboard_interrupt():
    g = HookGuard()
    with g("x"):
        raise ValueError("ours")
    assert g.errors == {"x": 1}
    with pytest.raises(KeyboardInterrupt):
        with g("x"):
            raise KeyboardInterrupt


# -- after_step without an engine ----------------------------------------------------------------

def make_view(num_draft=(3, 0), sched=(4, 2)) -> StepView:
    n = sum(sched)
    H = 4
    return StepView(req_ids=["a", "b"], num_scheduled=list(sched),
                    input_ids=torch.arange(100, 100 + n), positions=torch.cat(
                        [torch.arange(10, 10 + sched[0]), torch.arange(0, sched[1])]),
                    hidden_states=torch.randn(n, H), aux_hidden_states=[torch.randn(n, H)] * 2,
                    num_draft_tokens=list(num_draft), finished_req_ids=set())


class FakePublisher:
    def __init__(self):
        self.version = 0
        self.count = 0
        self.last_ms = self.total_ms = 0.0
        self.got: list[tuple] = []

    def publish(self, latest):
        if latest[0] <= self.version:
            return False
        self.got.append(latest)
        self.version = latest[0]
        self.count += 1
        return True


class FakeLearner:
    """latest() returns a newer version on every call: a learner racing the serving thread."""

    in_update = False  # never inside an update (the step profile's learner split)

    def __init__(self):
        self.calls = 0

    def latest(self):
        self.calls += 1
        return self.calls, {"length_head.x": torch.tensor(float(self.calls))}

    def notify(self):
        pass

    def stats(self):
        return {}


class FakeBuffer:
    def __init__(self):
        self.records = []

    def push(self, rec):
        self.records.append(rec)

    def finish(self, rid):
        pass


class FakeMetrics:
    def __init__(self):
        self.writes = 0

    def due(self):
        return True

    def write(self, stats, info):
        self.writes += 1


class RecordingCutter:
    gate = None  # no budget gate: the runner times no engine cycles

    def __init__(self):
        self.refreshed: list[tuple] = []
        self.observed = 0

    def observe(self, drafted, accepted, req_ids=None):
        self.observed += 1

    def forget(self, req_ids):
        pass

    def refresh(self, snapshot, version):
        self.refreshed.append((version, float(snapshot["length_head.x"])))


def bare_session(**over):
    from vllm_onlinespec.serving.drafting import DraftStage
    from vllm_onlinespec.serving.feedback import FeedbackStage
    from vllm_onlinespec.serving.publish import RankShare
    from vllm_onlinespec.serving.session import OnlineSession

    s = object.__new__(OnlineSession)
    s.guard = HookGuard()
    s.steps = 0
    s._drafted_by = 0
    s.tracer = None
    s.publisher = FakePublisher()
    s.metrics = FakeMetrics()
    s.cutter = RecordingCutter()
    buf, lr = FakeBuffer(), FakeLearner()
    s.parts = SimpleNamespace(learner=lr, buffer=buf)
    s.cfg = SimpleNamespace(enabled=True, features=SimpleNamespace(plain=False))
    s.tp, s.leader = None, True  # one rank
    s.stats = lambda: None
    s.info = lambda: {}
    s.lookup = over.pop("lookup", None)
    s.runner = over.pop("runner", None)
    for k, v in over.items():
        setattr(s, k, v)
    if "drafter_k" not in over:
        s.drafter_k = getattr(s, "K", 4)  # the drafter drafts every one of vLLM's K
    s.ranks = RankShare(s.tp, s.leader)
    s.feedback = FeedbackStage(s.cutter, s.lookup, s.tracer, None, lr, buf, s.guard)
    s.drafting = DraftStage(s.cfg, s.runner, s.cutter, s.lookup, s.drafter_k,
                            getattr(s, "K", s.drafter_k), s.guard)
    return s


def test_feedback_counts_what_the_step_produced_and_each_requests_accepted_drafts():
    """The budget's option prices read these: every token the step produced (1 + accepted per
    request) and each request's accepted drafts in row order (the 'slowest' objective takes the
    request furthest from its end)."""
    s = bare_session()
    s.after_step(None, make_view(num_draft=(3, 2)), [[7, 8, 9, -1], [5, -1, -1, -1]])
    assert (s.feedback.last_yield, s.feedback.last_accepted) == (4, [2, 0])
    s.after_step(None, make_view(num_draft=(3, 2)), [[7, 8, 9, 6], [5, 4, 3, -1]])
    assert (s.feedback.last_yield, s.feedback.last_accepted) == (7, [3, 2])
    s.after_step(None, None, None)  # no step view: unknown, not stale
    assert (s.feedback.last_yield, s.feedback.last_accepted) == (None, None)


def test_tokens_left_reads_each_requests_limit_and_output_so_far():
    """compat.tokens_left: max_tokens less the output tokens so far, per request in the order
    asked; None where a request has no limit or is not in the batch."""
    import numpy as np

    from vllm_onlinespec.serving import compat

    ib = SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2},
                         num_tokens_no_spec=np.array([15, 40, 9]),
                         num_prompt_tokens=np.array([10, 8, 9]))
    runner = SimpleNamespace(input_batch=ib, requests={
        "a": SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=64)),
        "b": SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=64)),
        "c": SimpleNamespace(sampling_params=None)})
    assert compat.tokens_left(runner, ["b", "a", "c", "gone"]) == [32, 59, None, None]
    assert compat.step_admits(SimpleNamespace(scheduled_new_reqs=[object()]))
    assert not compat.step_admits(SimpleNamespace(scheduled_new_reqs=[]))


def test_a_batch_that_takes_no_new_request_counts_as_closed():
    """DraftStage.note_admissions: objective 'auto' prices by the request furthest from its
    end once no step scheduled a new request for option_closed_after steps."""
    from vllm_onlinespec.policy.option_choice import OptionChoice
    from vllm_onlinespec.serving.drafting import DraftStage

    options = OptionChoice(objective="auto")
    stage = SimpleNamespace(quiet_steps=0, closed_after=3,
                            cutter=SimpleNamespace(options=options))
    seen = []
    for admitted in (True, False, False, False, False, True, False):
        DraftStage.note_admissions(stage, admitted)
        seen.append(options.counts_closed)
    assert seen == [False, False, False, True, True, False, False]
    assert DraftStage.counts_laggard.fget(stage)
    stage.cutter.options = OptionChoice(objective="tokens")
    assert not DraftStage.counts_laggard.fget(stage)


def _boom(*a, **k):
    raise ZeroDivisionError("injected")


@pytest.mark.parametrize("stage", ["_feedback", "_publish", "_write_metrics"])
def test_after_step_stages_fail_independently(stage):
    s = bare_session()
    if stage == "_feedback":
        s.feedback.observe = _boom
    else:
        setattr(s, stage, _boom)
    for _ in range(3):
        s.after_step(None, make_view(), [[7, 8, -1, -1], [9, -1, -1, -1]])
    name = {"_feedback": G.FEEDBACK, "_publish": G.PUBLISH, "_write_metrics": G.METRICS}[stage]
    assert s.guard.errors == {name: 3}
    if stage != "_feedback":
        assert len(s.parts.buffer.records) == 6 and s.cutter.observed == 3
    if stage != "_publish":
        assert s.publisher.count == 3  # a failing feedback stage no longer stops publishing
    if stage != "_write_metrics":
        assert s.metrics.writes == 3


def test_records_carry_the_version_that_drafted_them_and_head_refreshes_from_the_published():
    s = bare_session()
    tags = []
    for _ in range(3):
        s.after_step(None, make_view(), [[7, 8, -1, -1], [9, -1, -1, -1]])
        tags.append([r.drafter_version for r in s.parts.buffer.records[-2:]])
    # step 1 verifies drafts of the initial weights (0); each step publishes the learner's next
    # version after its own drafts were proposed, so step n's verified drafts came from n - 2.
    assert tags == [[0, 0], [0, 0], [1, 1]]
    # the head saw exactly what vLLM got, not a newer latest()
    assert s.cutter.refreshed == [(v, float(v)) for v, _ in s.publisher.got]


def test_skips_are_counted():
    s = bare_session()
    s.after_step(None, make_view(), None)
    assert s.guard.skips == {G.NO_SAMPLER_OUTPUT: 1}
    drafts = SimpleNamespace(draft_token_ids=torch.tensor([[1, 2]]))
    assert s.cut_drafts(drafts) is drafts
    assert s.guard.skips[G.NON_LIST_DRAFTS] == 1


def test_capture_counts_a_missing_step_view():
    from vllm_onlinespec.serving.session import OnlineSession

    s = bare_session()
    s.tracer = object()  # wants feedback
    assert OnlineSession.capture(s, SimpleNamespace(execute_model_state=None)) is None
    assert s.guard.skips == {G.NO_STEP_VIEW: 1}


# -- serving/feedback.py -------------------------------------------------------------------------

def test_records_from_step_keep_committed_rows_only():
    from vllm_onlinespec.serving.feedback import committed_rows, records_from_step

    v = make_view(num_draft=(3, 0), sched=(4, 2))  # a: last token + 3 drafts; b: prefill chunk
    accepted = [1, 0]
    assert committed_rows(v, accepted) == [(0, 2), (4, 2)]
    fb = records_from_step(v, accepted, version=5)
    assert fb.ready is None  # CPU views: copied synchronously, usable at once
    a, b = fb.records
    assert (a.req_id, a.start_pos, a.num_draft, a.num_accepted, a.drafter_version) == ("a", 10, 3, 1, 5)
    assert a.token_ids.tolist() == [100, 101] and b.token_ids.tolist() == [104, 105]
    assert (b.start_pos, b.num_draft, b.num_accepted) == (0, 0, 0)
    assert torch.equal(a.aux, torch.cat([v.aux_hidden_states[0][:2]] * 2, dim=-1))
    assert torch.equal(b.target_hidden, v.hidden_states[4:6])
    # a request with every draft rejected commits its first row only; no aux -> no records
    assert ([r.token_ids.tolist() for r in records_from_step(v, [0, 0], 0).records]
            == [[100], [104, 105]])
    assert records_from_step(v, accepted, 0, async_copy=True).ready is None  # CPU: nothing to wait
    v.aux_hidden_states = None
    assert records_from_step(v, accepted, 0).records == []


class FakeEvent:
    """A CUDA event stand-in: counts synchronize() calls."""
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_feedback_pipe_holds_asynchronous_copies_one_step():
    from vllm_onlinespec.serving.feedback import FeedbackPipe, StepFeedback

    pipe = FeedbackPipe()
    sync = StepFeedback(["r0"], finished=["x"])
    assert pipe.submit(sync) == [sync]  # synchronous copies: handed on at once
    e1, e2 = FakeEvent(), FakeEvent()
    s1, s2 = StepFeedback(["r1"], ready=e1), StepFeedback(["r2"], ready=e2)
    assert pipe.submit(s1) == [] and e1.waits == 0  # the serving thread does not wait on it
    assert pipe.submit(s2) == [s1] and e1.waits == 1 and e2.waits == 0  # one step later
    assert s1.ready is None
    assert pipe.flush() == [s2] and e2.waits == 1 and pipe.flush() == []
    pipe.submit(StepFeedback(["r3", "r4"], ready=FakeEvent()))
    assert pipe.drop() == 2 and pipe.flush() == []  # a swapped target's features: dropped
    # order kept when a synchronous step follows a held one
    s5, s6 = StepFeedback(["r5"], ready=FakeEvent()), StepFeedback(["r6"])
    pipe.submit(s5)
    assert pipe.submit(s6) == [s5, s6]


# -- the draft cutter ----------------------------------------------------------------------------

class ConstHead(torch.nn.Module):
    def __init__(self, r: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(r))

    def forward(self, h):
        return self.w.expand(h.shape[0])


K = 4


def cutter(policy="adaflash", gate_labels=0, head_lr=0.0, **kw):
    """Defaults: the head ungated and not learning from verification (the rules without
    feedback); the tests of head_feedback set them."""
    cfg = LengthHeadConfig(policy=policy, rho=1.0, head_gate_labels=gate_labels, head_lr=head_lr)
    return DraftCutter(cfg, K, **kw)


def _cut(c, B=2, hidden=True):
    if hidden:
        c.observe_hidden(torch.randn(B * K, 8))
    return c.cut([[1, 2, 3, 4]] * B)


def test_an_untrained_head_does_not_cut_until_warmed_up():
    c = cutter(head=ConstHead(0.2), head_trusted=False, warmup_versions=3)
    assert c.head_state == "warming"
    assert _cut(c) == [[1, 2, 3, 4]] * 2  # no prediction, no population yet: full drafts
    assert "0 head" in c.last_reason
    c.refresh({"length_head.w": torch.tensor(0.2)}, version=3)
    assert c.head_state == "on"
    assert _cut(c) == [[1]] * 2 and "2 head" in c.last_reason  # round(0.2 * 4) = 1


def test_a_shipped_head_cuts_from_the_first_step_and_fixed_never_consults_one():
    c = cutter(head=ConstHead(0.5), head_trusted=True)
    assert _cut(c) == [[1, 2]] * 2
    f = cutter("fixed", head=ConstHead(0.2), head_trusted=True)
    assert not f.needs_hidden and f.head_state == "off"
    assert _cut(f) == [[1, 2, 3, 4]] * 2 and f.verified == f.drafted == 8


def test_the_head_follows_the_hidden_states_device():
    """On a GPU vLLM's drafter hands over CUDA hidden states: the head moves there once (and
    refreshes copy into it there) rather than every step raising on a device mismatch.
    "meta" stands in for the second device this CPU does not have."""
    from vllm_onlinespec.drafter import LengthHead

    c = cutter(head=LengthHead(8, width=4), head_trusted=True)
    assert {p.device.type for p in c.head.parameters()} == {"cpu"}
    head = c.head_on(torch.device("meta"))
    assert {p.device.type for p in head.parameters()} == {"meta"}
    assert c.head_on(torch.device("meta")) is head  # moved once, then left in place


def test_a_cpu_head_predicts_cpu_hidden_states_in_place():
    from vllm_onlinespec.drafter import LengthHead

    c = cutter(head=LengthHead(8, width=4), head_trusted=True)
    before = [p.data_ptr() for p in c.head.parameters()]
    assert all(1 <= len(d) <= K for d in _cut(c))
    assert [p.data_ptr() for p in c.head.parameters()] == before


def test_missing_hidden_states_are_a_counted_skip():
    skips = []
    c = cutter(head=ConstHead(0.5), head_trusted=True, on_skip=skips.append)
    assert _cut(c, hidden=False) == [[1, 2, 3, 4]] * 2
    assert skips == [G.NO_DRAFT_HIDDEN]


def test_wrap_draft_sampler_says_when_it_found_nothing():
    from vllm_onlinespec.serving import compat

    assert compat.wrap_draft_sampler(SimpleNamespace(drafter=None), lambda h: None) is False
    seen = []
    drafter = SimpleNamespace(_sample_draft_tokens=lambda h, m: ("sampled", h))
    assert compat.wrap_draft_sampler(SimpleNamespace(drafter=drafter), seen.append) is True
    assert drafter._sample_draft_tokens("H", None) == ("sampled", "H") and seen == ["H"]


def test_observe_draft_hidden_never_raises_into_vllms_drafter():
    from vllm_onlinespec.serving.session import OnlineSession

    s = bare_session()
    s.cutter = SimpleNamespace(observe_hidden=_boom)
    OnlineSession.observe_draft_hidden(s, torch.zeros(1))
    assert s.guard.errors == {G.DRAFT_HIDDEN: 1}


class FakeTpGroup:
    """Rank 0 and rank 1 of a TP group in one process: rank 0's broadcasts are queued for rank 1
    (src is always 0, so rank 0 never waits and the two can step one after the other)."""

    def __init__(self, rank: int, wire: list):
        self.rank_in_group, self.world_size, self.wire = rank, 2, wire
        self.snapshots_sent = 0

    def broadcast_object(self, obj=None, src=0):
        if self.rank_in_group == 0:
            self.wire.append(obj)
            return obj
        return self.wire.pop(0)

    def broadcast_tensor_dict(self, data=None, src=0):
        if self.rank_in_group == 0:
            self.snapshots_sent += 1
            self.wire.append({k: v.clone() for k, v in data.items()})
            return data
        return self.wire.pop(0)


class SteppedLearner(FakeLearner):
    """A new version every other step (the learner is slower than serving)."""

    def latest(self):
        self.calls += 1
        v = (self.calls + 1) // 2
        return v, {"drafter.w": torch.full((2,), float(v)), "length_head.x": torch.tensor(float(v))}


def test_tp_ranks_publish_the_same_versions_between_the_same_steps():
    wire: list = []
    r0 = bare_session(tp=FakeTpGroup(0, wire), leader=True)
    r0.parts = SimpleNamespace(learner=SteppedLearner(), buffer=FakeBuffer())
    r1 = bare_session(tp=FakeTpGroup(1, wire), leader=False)
    r1.parts = None  # no learner off rank 0
    for _ in range(6):
        for s in (r0, r1):  # every rank runs every step's after_step
            s.after_step(None, None, None)
            assert not s.guard.errors
        assert r0.publisher.version == r1.publisher.version
    assert [v for v, _ in r1.publisher.got] == [1, 2, 3]
    assert all(torch.equal(a[1]["drafter.w"], b[1]["drafter.w"])
               for a, b in zip(r0.publisher.got, r1.publisher.got))
    assert r0.tp.snapshots_sent == 3 and not wire  # one snapshot per new version, nothing left


def test_tp_rank0_resumed_version_still_reaches_the_other_ranks():
    """Rank 0 publishes a resumed checkpoint at start-up, before any step: the next step must
    still send it (decided from the version shared over TP, not rank 0's own)."""
    wire: list = []
    r0 = bare_session(tp=FakeTpGroup(0, wire), leader=True)
    r0.parts = SimpleNamespace(learner=SimpleNamespace(
        latest=lambda: (5, {"drafter.w": torch.ones(2), "length_head.x": torch.tensor(5.0)}),
        notify=lambda: None), buffer=FakeBuffer())
    r0.publisher.version = 5  # what _resume did
    r1 = bare_session(tp=FakeTpGroup(1, wire), leader=False)
    r1.parts = None
    for s in (r0, r1):
        s.after_step(None, None, None)
    assert r1.publisher.version == 5 and not wire


@dataclasses.dataclass
class SO:
    """The fields of vLLM's SchedulerOutput the gate and the cycle timer read."""
    num_scheduled_tokens: dict
    scheduled_spec_decode_tokens: dict
    total_num_scheduled_tokens: int
    num_spec_tokens_to_schedule: int = 4


def test_a_shut_gate_asks_vllms_drafter_for_k0_on_a_copy(runner):
    """The budget's gate shut: vLLM's propose gets a copy of the scheduler output with
    num_spec_tokens_to_schedule = 0 (its dynamic-K path); the scheduler's own object is left
    alone, and the drafter's time is booked as a K = 0 forward."""
    seen, timed = [], []
    FakeVllmRunner.propose_draft_token_ids, orig = (
        lambda self, so, *a, **k: seen.append(so) or "proposed"), FakeVllmRunner.propose_draft_token_ids
    try:
        for k in (0, 2, 4):  # shut, fewer than K, all K
            runner._onlinespec = SimpleNamespace(
                gate_drafting=lambda so, sampled=None, k=k: (dataclasses.replace(
                    so, num_spec_tokens_to_schedule=k), k) if k < 4 else (so, 4),
                drafting=SimpleNamespace(observe_draft_time=lambda d, s: timed.append(d)))
            so = SO({"a": 1, "b": 3}, {}, 4)
            assert runner.propose_draft_token_ids(so) == "proposed"
            assert so.num_spec_tokens_to_schedule == 4  # the scheduler's object: untouched
            assert seen[-1].num_spec_tokens_to_schedule == k
    finally:
        FakeVllmRunner.propose_draft_token_ids = orig
    assert timed == [0, 2, 4]  # each forward timed at the length it ran


def test_step_token_counts_reads_requests_and_prefill():
    from vllm_onlinespec.serving import compat

    so = SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 1, "c": 40},
                         scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]},
                         total_num_scheduled_tokens=46)
    assert compat.step_token_counts(so) == (3, 42)  # 3 requests; 46 - 4 draft tokens


def test_cycles_that_verify_only_lookup_drafts_are_priced_as_plain(runner):
    """The gate prices drafted and plain cycles apart. With the suffix tree drafting every
    step, a cycle after a shut gate (k = 0) verifies only the tree's tokens: a plain cycle for
    the gate. A cycle counts as having verified the drafter's drafts only after one that asked
    the drafter for k > 0."""

    plan = iter([4, 0, 0, 2, 0, 4])  # the gate's k per cycle
    cycles = []
    runner._onlinespec = SimpleNamespace(
        gate_drafting=lambda so, sampled=None: (so, next(plan)),
        drafting=SimpleNamespace(
            times_cycles=True, observe_draft_time=lambda k, s: None,
            observe_cycle=lambda k, B, tokens, s, drafter_verified: cycles.append(
                (k, tokens, drafter_verified))))
    for _ in range(7):  # every step verifies 3 lookup tokens for request "a"
        so = SO({"a": 4, "b": 1}, {"a": [7, 8, 9]}, 5)
        runner.execute_model(so)
        if len(cycles) < 6:
            runner.propose_draft_token_ids(so)
    assert [c[0] for c in cycles] == [4, 0, 0, 2, 0, 4]
    # Cycle 0 follows no drafted cycle; 1 and 4 verify the drafter's k > 0 drafts; 2 and 3
    # verify lookup tokens only (tokens > requests, yet no drafter drafts among them).
    assert [c[2] for c in cycles] == [False, True, False, False, True, False]
    assert all(c[1] == 5 for c in cycles)


def test_each_cycle_prices_the_option_it_verified_with_that_options_drafting_time(monkeypatch):
    """The budget's options (policy/option_choice.py) are priced per engine cycle: the option
    is the one chosen in the cycle before (its drafts are verified now), the seconds are the
    cycle's wall time with its own drafting (the next option's) swapped for the drafting of
    what it verifies, the tokens what the step produced; cycles with prefill are not priced."""
    from vllm_onlinespec.serving import runner as runner_mod

    clock = [0.0]
    monkeypatch.setattr(runner_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    draft_s = iter([0.020, 0.0, 0.0, 0.030, 0.010, 0.0])  # the drafter's forward per cycle
    decided = iter(["drafter", "tree", "plain", "drafter", "tree"])

    class Timed(FakeVllmRunner):
        def execute_model(self, so, *a, **k):
            clock[0] += 0.100  # the target's forward
            return "exec-out"

        def propose_draft_token_ids(self, *a, **k):
            clock[0] += next(draft_s)
            return "proposed"

    from vllm_onlinespec.serving.runner import runner_class

    r = runner_class(Timed)()
    r._onlinespec_init()
    priced = []

    def cut(drafts):
        clock[0] += 0.005  # the lookup's tree proposing: drafting time too
        return drafts

    def after_step(runner, view, sampled):
        session.feedback.last_yield, session.feedback.last_accepted = 12, [4, 6]

    # Request "b" is furthest from its end: the 'slowest' objective's tokens are its 1 + 6.
    left = {"a": 20, "b": 30}
    monkeypatch.setattr(runner_mod.compat, "tokens_left",
                        lambda runner, req_ids: [left[r] for r in req_ids])
    session = SimpleNamespace(
        gate_drafting=lambda so, sampled=None: None, cut_drafts=cut, after_step=after_step,
        capture=lambda runner: SimpleNamespace(req_ids=["a", "b"]),
        feedback=SimpleNamespace(last_yield=None, last_accepted=None),
        drafting=SimpleNamespace(
            times_cycles=True, counts_laggard=True, observe_draft_time=lambda k, s: None,
            observe_cycle=lambda *a, **k: None,
            observe_option=lambda o, B, tokens, s, slowest, drafts: priced.append(
                (o, B, tokens, slowest, round(s, 6), drafts))))
    r._onlinespec = session
    for i in range(5):
        prefill = i == 3  # a prefill chunk in cycle 3: not comparable, not priced
        so = SO({"a": 4, "b": 4 if not prefill else 30}, {"a": [7, 8, 9], "b": [1, 2, 3]},
                8 if not prefill else 34)
        session.drafting.option = next(decided)  # what the gate chooses in this cycle
        r.execute_model(so)
        r.propose_draft_token_ids(so)
        r.sample_tokens(None)
        r.take_draft_token_ids()
    so = SO({"a": 1, "b": 1}, {}, 2)
    r.execute_model(so)  # closes cycle 4
    # Cycle 0 verified nothing chosen; 1 verifies cycle 0's drafter drafts (0.020 + 0.005 of
    # drafting), 2 the tree's (0 + 0.005), 3 has prefill, 4 verifies cycle 3's drafter drafts.
    # Each verified 8 target tokens for 2 requests: 6 draft tokens (a tree cycle with none is
    # priced as plain by the choice).
    assert priced == [("drafter", 2, 12, 7.0, 0.125, 6), ("tree", 2, 12, 7.0, 0.105, 6),
                      ("drafter", 2, 12, 7.0, 0.135, 6)]
    # The step profile splits the target span by what each step verified (cycle 0 and the
    # steps before any choice: no option), prefill apart.
    assert {k: v[0] for k, v in r.onlinespec_profile().options.items()} == {
        "drafter@B2": 2, "tree@B2": 2, "plain@B2+prefill": 1}
    # A cycle none of whose requests continues is not priced: both finished, and the wait for
    # the next request may sit in its wall time (here 1 s before request "c" arrives).
    session.drafting.option = "plain"
    r.propose_draft_token_ids(so)
    r.sample_tokens(None)
    r.take_draft_token_ids()
    clock[0] += 1.0
    r.execute_model(SO({"c": 1}, {}, 1))
    assert len(priced) == 3


def test_draft_confidence_reads_the_logits_vllms_drafter_computes():
    from vllm_onlinespec.serving import compat

    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])

    class Model:
        calls = 0

        def compute_logits(self, h):
            Model.calls += 1
            return logits

    seen = []
    runner = SimpleNamespace(drafter=SimpleNamespace(model=Model(),
                                                     use_local_argmax_reduction=False))
    assert compat.wrap_draft_confidence(runner, seen.append)
    out = runner.drafter.model.compute_logits(None)
    assert out is logits and Model.calls == 1  # vLLM's own logits, computed once
    assert torch.allclose(seen[0], torch.softmax(logits, -1).amax(-1))
    # No full logits to read: the caller is told.
    local = SimpleNamespace(drafter=SimpleNamespace(model=Model(), use_local_argmax_reduction=True))
    assert not compat.wrap_draft_confidence(local, seen.append)
    assert not compat.wrap_draft_confidence(SimpleNamespace(), seen.append)
