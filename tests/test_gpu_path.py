"""The GPU serving path without a GPU: each test fakes the one GPU mechanism a defect came
from, on the CPU (lab/design/gpu_path.md).

  features   on GPU the target's hidden states live in the CUDA-graph pool the drafter's graphs
             replay into: the feedback must hold the values of the target's forward; and its
             copy to the host never blocks the serving thread
  memory     the start-up check counts what the learner's build already allocated
  start      the learner thread starts after vLLM's warm-up (graph capture), not in load_model
  kernels    a Triton loss that cannot compile stops start-up in one line
  engine     eager mode and the CPU's context/KV sizing apply on CPU only
  publish    republishing into vLLM's DFlash drafter never asks the hub for mask_embedding.pt
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from vllm_onlinespec.serving import compat

REPO = Path(__file__).resolve().parents[1]


# -- features: copied before vLLM's drafter runs ---------------------------------------------------

class GraphPoolRunner:
    """vLLM 0.32's V1 runner, reduced to the order of events that matters here
    (gpu_model_runner.py): execute_model leaves the target's outputs in ExecuteModelState as
    views of one memory pool (under CUDA graphs: weak references into the global graph pool,
    compilation/cuda_graph.py:326-337); sample_tokens samples, then runs the drafter, whose graph
    replays into the same pool (:4362-4409). Here the drafter overwrites the pool in place."""

    H, ROWS = 4, 16

    def __init__(self) -> None:
        self.pool_hidden = torch.zeros(self.ROWS, self.H)
        self.pool_aux = [torch.zeros(self.ROWS, self.H) for _ in range(2)]
        self.input_ids = torch.zeros(self.ROWS, dtype=torch.long)
        self.positions = torch.zeros(self.ROWS, dtype=torch.long)
        self.input_batch = SimpleNamespace(req_ids=["a", "b"])
        self.execute_model_state = None
        self.drafted = 0

    def execute_model(self, so, *a, **k):
        n = so.total_num_scheduled_tokens
        self.input_ids[:n] = torch.arange(100, 100 + n)
        self.positions[:n] = torch.tensor([10, 11, 12, 13, 0, 1])
        self.pool_hidden[:n] = torch.arange(n * self.H, dtype=torch.float32).view(n, self.H)
        for j, h in enumerate(self.pool_aux):
            h[:n] = 1000.0 * (j + 1) + torch.arange(n * self.H, dtype=torch.float32).view(n, self.H)
        self.execute_model_state = SimpleNamespace(
            scheduler_output=so, hidden_states=self.pool_hidden, aux_hidden_states=self.pool_aux,
            spec_decode_metadata=SimpleNamespace(num_draft_tokens=[3, 0]))
        return None

    def _sample(self, logits, meta):
        # a: last token + 3 drafts, 1 accepted (+ bonus); b: a prefill chunk of 2 rows
        return SimpleNamespace(sampled_token_ids=[[7, 8, -1, -1], [9, -1, -1, -1]])

    def propose_draft_token_ids(self, so, *a, **k):
        self.drafted += 1
        self.pool_hidden.fill_(-1.0)  # the drafter's activations land where the target's were
        for h in self.pool_aux:
            h.fill_(-2.0)
        return "proposed"

    def sample_tokens(self, grammar_output):
        state, self.execute_model_state = self.execute_model_state, None
        meta = state.spec_decode_metadata
        self._sample(None, meta)
        self.propose_draft_token_ids(state.scheduler_output)
        return "sampled-out"

    def take_draft_token_ids(self):
        return None


def _feedback_session():
    from test_serving_hooks import bare_session

    s = bare_session()
    s.oracle, s.K = None, 3
    s.cfg = SimpleNamespace(enabled=True, features=SimpleNamespace(plain=False))
    s.cutter.policy_name = "fixed"
    s.cutter.observe_step_cost = s.cutter.observe_draft_time = lambda *a: None
    return s


def _run_step(monkeypatch, on_cpu: bool):
    from vllm_onlinespec.serving.runner import runner_class

    monkeypatch.setattr(compat, "is_cpu", lambda: on_cpu)
    r = runner_class(GraphPoolRunner)()
    r._onlinespec_init()
    r._onlinespec = session = _feedback_session()
    so = SimpleNamespace(total_num_scheduled_tokens=6, num_scheduled_tokens={"a": 4, "b": 2},
                         finished_req_ids=set())
    r.execute_model(so)
    expect_aux = torch.cat([h[:6].clone() for h in r.pool_aux], dim=-1)
    expect_fin = r.pool_hidden[:6].clone()
    assert r.sample_tokens(None) == "sampled-out" and r.drafted == 1
    return r, session, expect_aux, expect_fin


def test_feedback_holds_the_targets_features_although_the_drafter_overwrote_them(monkeypatch):
    r, session, aux, fin = _run_step(monkeypatch, on_cpu=False)
    assert (r.pool_hidden == -1).all()  # the fake drafter did overwrite the target's outputs
    assert not session.guard.errors and not r.onlinespec_guard().errors
    a, b = session.parts.buffer.records
    assert a.token_ids.tolist() == [100, 101] and b.token_ids.tolist() == [104, 105]
    assert (a.start_pos, b.start_pos) == (10, 0)
    assert torch.equal(a.aux, aux[0:2]) and torch.equal(b.aux, aux[4:6])
    assert torch.equal(a.target_hidden, fin[0:2]) and torch.equal(b.target_hidden, fin[4:6])


def test_no_copy_on_cpu_or_when_nothing_reads_features(monkeypatch):
    """On CPU the step state holds the outputs strongly (no graph pool): the view stays a view;
    a session without learner, feature log or tracer never copies."""
    from vllm_onlinespec.serving.runner import _copies_features

    monkeypatch.setattr(compat, "is_cpu", lambda: True)
    s = _feedback_session()
    assert not _copies_features(s)
    monkeypatch.setattr(compat, "is_cpu", lambda: False)
    assert _copies_features(s)
    s.parts = None  # no learner/buffer
    assert not _copies_features(s)
    s.feedback.feature_log = object()
    assert _copies_features(s)


def test_own_features_copies_every_scheduled_row_and_keeps_the_rest():
    view = compat.StepView(req_ids=["a"], num_scheduled=[3], input_ids=torch.arange(3),
                           positions=torch.arange(3), hidden_states=torch.ones(3, 2),
                           aux_hidden_states=[torch.ones(3, 2)], num_draft_tokens=[2],
                           finished_req_ids={"z"})
    own = compat.own_features(view)
    for t_own, t_view in ((own.hidden_states, view.hidden_states),
                          (own.aux_hidden_states[0], view.aux_hidden_states[0]),
                          (own.input_ids, view.input_ids), (own.positions, view.positions)):
        assert torch.equal(t_own, t_view) and t_own.data_ptr() != t_view.data_ptr()
    assert (own.req_ids, own.num_draft_tokens, own.finished_req_ids) == (["a"], [2], {"z"})


class FakeCuda(TorchFunctionMode):
    """Tensors tagged by `gpu()` behave as if they lived on a GPU (their `.device` says cuda:0),
    and every host<->device transfer and every host read of a device value is logged with
    whether it blocks the calling thread, as CUDA would: a copy blocks unless non_blocking
    from or into pinned memory; `.cpu()`, `.item()`, `.tolist()`, `int()`... always do."""

    SYNCS = {"cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"}

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.log: list[tuple[str, bool]] = []  # (what, blocks)
        mode = self

        class Event:
            def record(self, stream=None):
                mode.log.append(("event.record", False))

            def synchronize(self):
                mode.log.append(("event.synchronize", True))

        monkeypatch.setattr(torch.cuda, "Event", Event)

    @staticmethod
    def gpu(t: torch.Tensor) -> torch.Tensor:
        t._fake_device = "cuda"
        return t

    @staticmethod
    def where(t) -> str:
        return getattr(t, "_fake_device", "cpu") if isinstance(t, torch.Tensor) else "-"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return torch.device("cuda", 0) if self.where(args[0]) == "cuda" else torch.device("cpu")
        if func == torch.Tensor.is_cuda.__get__:
            return self.where(args[0]) == "cuda"
        name = getattr(func, "__name__", "")
        pinned = name in ("empty", "zeros", "empty_like") and kwargs.pop("pin_memory", False)
        if name == "to":
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            src = args[0]
            out = src.to(dtype) if dtype is not None else src
            if device is None or device.type == self.where(src):
                return self.gpu(out) if self.where(src) == "cuda" and out is not src else out
            if device.type == "cuda":  # host -> device
                self.log.append(("h2d", not (non_blocking and self.where(src) == "pinned")))
                return self.gpu(out.clone())
            self.log.append(("d2h", not non_blocking))
            return out.clone()
        if name == "copy_":
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            way = {("cuda", "pinned"): "d2h", ("cuda", "cpu"): "d2h", ("pinned", "cuda"): "h2d",
                   ("cpu", "cuda"): "h2d"}.get((self.where(src), self.where(dst)))
            if way:
                host = dst if way == "d2h" else src
                self.log.append((way, not (non_blocking and self.where(host) == "pinned")))
            return func(dst, src)
        if name in self.SYNCS and self.where(args[0]) == "cuda":
            self.log.append((name, True))
        out = func(*args, **kwargs)
        if pinned:
            out._fake_device = "pinned"
        elif name not in self.SYNCS and name != "pin_memory" and any(
                self.where(a) == "cuda" for a in _flat(args, kwargs)):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.gpu(t)
        if name == "pin_memory":
            out._fake_device = "pinned"
        return out


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        yield from (a if isinstance(a, (list, tuple)) else (a,))


def _gpu_view(fake: FakeCuda, reqs: int = 3, k: int = 4, h: int = 8, layers: int = 2):
    """A step as vLLM 0.32's GPU runner leaves it: states and positions on the device (the
    runner keeps `positions` there only), input ids in its host buffer."""
    n = reqs * (k + 1)
    g = torch.Generator().manual_seed(0)
    return compat.StepView(
        req_ids=[f"r{i}" for i in range(reqs)], num_scheduled=[k + 1] * reqs,
        input_ids=torch.arange(100, 100 + n, dtype=torch.int32),
        positions=fake.gpu(torch.arange(n) + 1000),
        hidden_states=fake.gpu(torch.randn(n, h, generator=g).bfloat16()),
        aux_hidden_states=[fake.gpu(torch.randn(n, h, generator=g).bfloat16())
                           for _ in range(layers)],
        num_draft_tokens=[k] * reqs, finished_req_ids=set())


def test_async_feedback_copy_never_blocks_the_serving_thread(monkeypatch):
    """records_from_step on a GPU step issues its copies and returns: nothing between the first
    copy and the event recorded after the last one waits for the device (no blocking copy, no
    host read of a device value: vLLM 0.32 keeps `positions` on the GPU, so reading a position
    right away would wait for the whole feature download). The records' start positions are
    filled when the pipe hands the step on, after the event."""
    from vllm_onlinespec.serving.feedback import FeedbackPipe, records_from_step

    fake = FakeCuda(monkeypatch)
    accepted = [2, 0, 4]
    with fake:
        view = _gpu_view(fake)
        fb = records_from_step(view, accepted, 7, async_copy=True)
    assert fb.ready is not None and fake.log[-1] == ("event.record", False)
    copies = [e for e in fake.log if e[0] in ("h2d", "d2h")]
    assert {"h2d", "d2h"} <= {w for w, _ in copies}  # indices up, features down
    assert [e for e in fake.log if e[1]] == [], fake.log  # nothing on the way blocks
    assert [r.start_pos for r in fb.records] == [-1, -1, -1]  # not read yet
    pipe = FeedbackPipe()
    with fake:
        assert pipe.submit(fb) == []  # held one step: the serving thread does not wait
        (got,) = pipe.submit(records_from_step(view, accepted, 8, async_copy=True))
    assert got is fb and fake.log.count(("event.synchronize", True)) == 1
    assert [r.start_pos for r in fb.records] == [1000, 1005, 1010]
    assert [r.token_ids.tolist() for r in fb.records] == [[100, 101, 102], [105],
                                                          [110, 111, 112, 113, 114]]
    sync = records_from_step(_gpu_view(FakeCuda(monkeypatch)), accepted, 7)  # plain tensors
    for a, b in zip(fb.records, sync.records):
        assert torch.equal(a.aux, b.aux) and torch.equal(a.target_hidden, b.target_hidden)
        assert (a.start_pos, a.num_accepted, a.drafter_version) == (b.start_pos, b.num_accepted, 7)


# -- memory: what the build allocated is already in use --------------------------------------------

def _qwen3_8b_footprint(dtype_bytes: int):
    """The learner's footprint for z-lab/Qwen3-8B-DFlash-b16 (the default OGD rule, gain
    pacing's frozen start weights, 16 blocks of 15 rows over the 151 936-token vocabulary), by
    learner_footprint's own accounting (tests/test_learner_memory.py checks it on real rules)."""
    from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter
    from vllm_onlinespec.learner.memory import LearnerFootprint

    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33],
                       mask_token_id=151669, block_size=16)
    with torch.device("meta"):
        n = sum(p.numel() for p in DFlashDrafter(cfg).parameters())
    w = n * dtype_bytes
    return LearnerFootprint(weights=w, optimizer=6 * w, grads=w, snapshots=2 * w,
                            step_transient=0, loss_logits=3 * 16 * 15 * 151936 * 4, reference=w)


def test_start_up_memory_check_counts_what_the_build_allocated(monkeypatch):
    """On an 80 GB H100 beside a bf16 Qwen3-8B target: by the time check_fits runs, the build
    allocated all the learner holds but its second snapshot, and mem_get_info shows it in use.
    The default float32 learner fits (vLLM's KV cache keeps ~18 GiB; the later additions fit in
    the 10 % vLLM leaves); asking for what it holds to be free a second time refused it."""
    from vllm_onlinespec.learner.memory import GIB, check_fits

    fp = _qwen3_8b_footprint(4)  # the default learner_dtype, float32
    total = int(79.1 * GIB)
    before = int((16.4 + 1.96 + 0.5) * GIB)  # target, vLLM's drafter, CUDA context
    free = total - before - fp.built
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, total))
    assert fp.steady > free  # what the old check compared
    check_fits(fp, torch.device("cuda:0"), 0.9)
    with pytest.raises(MemoryError, match=r"after start-up .* \(1.58 GiB at gpu_memory_utiliz"):
        check_fits(fp, torch.device("cuda:0"), 0.98)  # what comes later does not fit
    with pytest.raises(MemoryError, match=r"in use, over vLLM's share \(31.64 GiB at gpu_memory"):
        check_fits(fp, torch.device("cuda:0"), 0.4)  # the build leaves vLLM no KV cache


# -- start: the learner thread after vLLM's warm-up ------------------------------------------------

class _Target(torch.nn.Module):
    def __init__(self, V: int, H: int) -> None:
        super().__init__()
        self.model = SimpleNamespace(embed_tokens=torch.nn.Embedding(V, H))
        self.lm_head = torch.nn.Linear(H, V, bias=False)


def _runner(drafter_path: str, V: int, H: int):
    """What OnlineSession reads off vLLM's runner at load_model (no TP, no vLLM drafter module:
    the learner's device follows the target's head, the CPU here)."""
    extra = {"onlinespec": {"drafter": drafter_path, "update": {"lr": 1e-3},
                            "min_new_tokens_per_update": 1}}
    vc = SimpleNamespace(
        additional_config=extra, cache_config=SimpleNamespace(gpu_memory_utilization=0.9),
        speculative_config=SimpleNamespace(method="dflash", num_speculative_tokens=3,
                                           draft_model_config=SimpleNamespace(model=drafter_path)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return SimpleNamespace(vllm_config=vc, model=_Target(V, H), drafter=None)


def test_learner_starts_only_after_vllms_warm_up(tmp_path, monkeypatch):
    """vLLM builds the session inside load_model, then profiles memory and captures CUDA graphs
    in compile_or_warm_up_model: a CUDA call from the learner thread during the capture breaks
    it. The worker's compile_or_warm_up_model (vLLM's, faked here) sees no learner running; the
    learner runs once it returned."""
    from test_learner_factory import H, V, write_drafter
    from vllm_onlinespec.serving.session import OnlineSession
    from vllm_onlinespec.serving.validate import config_from_vllm
    from vllm_onlinespec.serving.worker import SpecDecodeWorker

    runner = _runner(write_drafter(tmp_path / "d", block_size=4), V, H)
    session = OnlineSession(runner, config_from_vllm(runner.vllm_config))
    runner._onlinespec = session
    try:
        assert session.learner is not None and not session.learner.running  # after load_model
        during = []
        def vllm_warm_up(worker):  # vLLM's: profile, KV cache, CUDA-graph capture
            during.append(session.learner.running)
            return "times"

        monkeypatch.setattr(SpecDecodeWorker.__mro__[1], "compile_or_warm_up_model", vllm_warm_up)
        monkeypatch.setattr(OnlineSession, "probe_step_cost", lambda s, r: during.append("probe"))
        worker = object.__new__(SpecDecodeWorker)
        worker.model_runner = runner
        assert worker.compile_or_warm_up_model() == "times"
        assert during == [False, "probe"] and session.learner.running
    finally:
        session.close()


def test_learner_starts_at_the_first_step_when_warm_up_never_ran(tmp_path):
    """A worker path that skips compile_or_warm_up_model (vLLM's elastic-EP scale-up launch):
    the learner starts at the end of the first engine step instead of never."""
    from test_learner_factory import H, V, write_drafter
    from vllm_onlinespec.serving.session import OnlineSession
    from vllm_onlinespec.serving.validate import config_from_vllm

    runner = _runner(write_drafter(tmp_path / "d", block_size=4), V, H)
    session = OnlineSession(runner, config_from_vllm(runner.vllm_config))
    try:
        assert not session.learner.running
        session.after_step(runner, None, None)
        assert session.learner.running and not session.guard.errors
    finally:
        session.close()


# -- kernels: warmed at build ----------------------------------------------------------------------

def test_a_triton_loss_that_fails_stops_start_up_in_one_line(tmp_path, monkeypatch):
    """The Triton loss compiles at the learner's first update; a compile or launch error there
    was counted on the learner thread while serving went on with a frozen drafter. The build
    now runs one tiny forward and backward of the loss when the Triton path is selected: its
    failure stops start-up with one line naming the cause."""
    from test_learner_factory import targets, write_drafter
    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.kernels import distill_triton
    from vllm_onlinespec.learner import factory

    cfg = lambda: OnlineSpecConfig.from_any({"update": {"lr": 1e-3}})  # noqa: E731

    path = write_drafter(tmp_path / "d", block_size=4)
    embed, head = targets()
    calls = []

    def broken(*a, **k):
        calls.append(a[0].shape)
        raise RuntimeError("PassManager::run failed\n  %0 = tt.dot ... (MLIR dump)\n  ...")

    monkeypatch.setattr(distill_triton, "distill_loss_triton", broken)
    factory.build_learner(cfg(), path, embed, head, 3, train_length_head=False)  # chunked: no call
    assert calls == []
    monkeypatch.setattr(factory, "loss_impl", lambda device: "triton")  # what CUDA selects
    with pytest.raises(RuntimeError) as e:
        factory.build_learner(cfg(), path, embed, head, 3, train_length_head=False)
    msg = str(e.value)
    assert "\n" not in msg and len(calls) == 1
    assert msg.startswith("onlinespec: the learner's Triton loss kernels failed on cpu at start-up "
                          "(RuntimeError: PassManager::run failed)")


# -- engine: eager and CPU sizing on CPU only ------------------------------------------------------

def test_engine_kwargs_keep_cuda_graphs_on_gpu(monkeypatch):
    from vllm_onlinespec import engine

    monkeypatch.setattr(engine, "is_cpu", lambda: False)
    kw = engine.engine_kwargs()
    assert "enforce_eager" not in kw and "max_model_len" not in kw
    assert "kv_cache_memory_bytes" not in kw and kw["gpu_memory_utilization"] == 0.85
    args = engine.serve_args(max_model_len=4096)
    assert "--enforce-eager" not in args and args[args.index("--max-model-len") + 1] == "4096"
    assert engine.engine_kwargs(enforce_eager=True)["enforce_eager"] is True  # asked for: kept
    # every arm of a comparison on the onlinespec engine's runner and scheduling
    assert kw["async_scheduling"] is False and "--no-async-scheduling" in args
    assert engine.SAME_RUNNER_ENV == {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_engine_kwargs_on_cpu_stay_eager_and_bounded(monkeypatch):
    from vllm_onlinespec import engine

    monkeypatch.setattr(engine, "is_cpu", lambda: True)
    kw = engine.engine_kwargs()
    assert "async_scheduling" not in kw  # vLLM-CPU schedules synchronously by itself
    assert kw["enforce_eager"] is True and kw["max_model_len"] == engine.CPU_MAX_MODEL_LEN
    assert kw["kv_cache_memory_bytes"] == engine.DEFAULT_KV_CACHE_BYTES
    assert "gpu_memory_utilization" not in kw
    assert "--enforce-eager" in engine.serve_args()


def test_bench_serve_command_has_no_eager_flag_on_gpu(monkeypatch):
    from vllm_onlinespec import engine
    from vllm_onlinespec.bench.concurrency import serve_cmd
    from vllm_onlinespec.bench.results import ArmSpec

    spec = ArmSpec(name="x", target="/t", prompts="/p", out="/o", dtype="bfloat16")
    monkeypatch.setattr(engine, "is_cpu", lambda: False)
    assert "--enforce-eager" not in serve_cmd(spec, 8000)
    monkeypatch.setattr(engine, "is_cpu", lambda: True)
    assert "--enforce-eager" in serve_cmd(spec, 8000)


# -- publish: no hub request -----------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    """Every way out of this process raises, and is recorded (a library may swallow the error)."""
    tries: list[str] = []

    def refuse(what):
        def f(*a, **k):
            tries.append(what)
            raise OSError(f"network poisoned: {what}")
        return f

    monkeypatch.setattr(socket, "create_connection", refuse("socket.create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("socket.getaddrinfo"))
    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse("hf_hub_download"))
    monkeypatch.setattr(huggingface_hub.HfApi, "hf_hub_download", refuse("HfApi.hf_hub_download"))
    return tries


def _tiny_dflash():
    """vLLM 0.32's own DFlashQwen3ForCausalLM.load_weights and _read_mask_embedding
    (qwen3_dflash.py:886, :929) on a module with the attributes they read; its drafter is a
    hub id whose mask_embedding.pt is not cached, so vLLM's lookup goes to the hub."""
    from vllm.model_executor.models import qwen3_dflash

    D = qwen3_dflash.DFlashQwen3ForCausalLM

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2, bias=False)
            self.mask_embedding = torch.nn.Parameter(torch.full((2,), 5.0), requires_grad=False)
            self.mask_token_id = 3
            self.use_aux_hidden_state = True
            self.has_separate_mask_embedding = True  # start-up loaded a mask_embedding.pt
            self.rebuilt = 0

        def _build_fused_kv_buffers(self):
            self.rebuilt += 1

    class Tiny(torch.nn.Module):
        load_weights = D.load_weights
        _read_mask_embedding = D._read_mask_embedding

        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.draft_model_config = SimpleNamespace(
                model="onlinespec-tests/no-such-drafter-in-cache", revision=None)

    return Tiny()


def test_publish_makes_no_hub_request(no_network, monkeypatch):
    from vllm.model_executor.models import qwen3_dflash

    # vLLM's lookup itself, poisoned at the name it calls (repo_utils.get_hf_file_bytes)
    looked = []
    monkeypatch.setattr(qwen3_dflash, "get_hf_file_bytes",
                        lambda *a, **k: looked.append(a) or (_ for _ in ()).throw(
                            OSError("hub lookup on the serving thread")))
    model = _tiny_dflash()
    runner = SimpleNamespace(drafter=SimpleNamespace(model=model))
    with pytest.raises(OSError):  # the mechanism: vLLM's load_weights looks the file up
        model.load_weights(iter([("fc.weight", torch.ones(2, 4))]))
    looked.clear()

    compat.load_draft_weights(runner, [("fc.weight", torch.full((2, 4), 2.0))])
    assert not looked and not no_network
    assert torch.equal(model.model.fc.weight, torch.full((2, 4), 2.0))
    # what start-up loaded stays: the mask embedding and the flag that says to use it
    assert torch.equal(model.model.mask_embedding, torch.full((2,), 5.0))
    assert model.model.has_separate_mask_embedding and model.model.rebuilt == 1
    assert "_read_mask_embedding" not in vars(model)  # shadowed for the call only
