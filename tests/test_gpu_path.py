"""The GPU serving path without a GPU (issue 36): each test fakes the one GPU mechanism a
defect came from, on the CPU.

  features   on GPU the target's hidden states live in the CUDA-graph pool the drafter's graphs
             replay into: the feedback must hold the values of the target's forward
  engine     eager mode and the CPU's context/KV sizing apply on CPU only
  publish    republishing into vLLM's DFlash drafter never asks the hub for mask_embedding.pt
  imports    what lab/gpu_check.sh imports works without pydantic (the device image)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving.guard import HookGuard

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


# -- imports: the device image has no pydantic -----------------------------------------------------

_BLOCK = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "pydantic_core", "annotated_types", "vllm"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Refuse())
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_gpu_check_modules_import_without_pydantic():
    code = _BLOCK + """
import importlib, runpy
gc = runpy.run_path("lab/gpu_check.py", run_name="gpu_check_imports")
for m in gc["CHECKED_MODULES"]:
    importlib.import_module(m)
from vllm_onlinespec import config
assert not config.PYDANTIC and "pydantic" not in sys.modules
cfg = config.OnlineSpecConfig.from_any(dict(learner_device="cuda", learner_dtype="bfloat16",
                                            lr=1e-5, grad_clip=1.0))
assert (cfg.lr, cfg.grad_clip, cfg.learner_dtype, cfg.loss.gamma) == (1e-5, 1.0, "bfloat16", 7.0)
try:
    config.OnlineSpecConfig.from_any({"lr": -1})
except config.ConfigError as e:
    print("refused:", e)
print("ok")
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: onlinespec.lr: must be > 0 (got -1)" in r.stdout and "ok" in r.stdout


def test_gpu_check_step0_names_the_failing_import(tmp_path):
    (tmp_path / "needs_pydantic.py").write_text("import json\nfrom pydantic import BaseModel\n")
    code = f"""
import runpy, sys
sys.path.insert(0, {str(tmp_path)!r})
gc = runpy.run_path("lab/gpu_check.py", run_name="gpu_check_imports")
gc["check_imports"].__globals__["CHECKED_MODULES"] = ("vllm_onlinespec.drafter", "needs_pydantic")
sys.exit(gc["check_imports"]())
"""
    r = _python(code)
    assert r.returncode == 3, r.stdout + r.stderr
    assert ("cannot import needs_pydantic: ImportError: gpu_check: pydantic imported, but the "
            "device image has no pydantic") in r.stdout
    assert "1 of 2 modules do not import" in r.stdout


_CONFIG_CASES = [{}, {"lr": -1}, {"loss": {"alpha": 1.5}}, {"length_head": {"policy": "magic"}},
                 {"no_such_field": 1}, {"update": {"betas": [0.9, 1.0]}},
                 {"update": {"ensemble_lrs": [1e-4, -1]}},
                 {"buffer": {"window_tokens": 10, "max_tokens": 5}}, {"learner_device": "gpu"},
                 {"learner_dtype": "bfloat16", "learner_device": "cpu"},
                 {"pacing": {"learner_cores": "inherit"}},
                 {"update": {"algorithm": "ensemble", "ensemble_lrs": [1e-4]}},
                 {"eps": 1e-6, "learner_priority": "idle"}, {"batch_blocks": 0},
                 {"prompt_lookup": {"enabled": True}}, {"enabled": False}]


def test_the_fallback_config_reads_like_pydantics():
    """Defaults, accepted values and one-line errors agree with and without pydantic (so a new
    pydantic feature in config.py that the fallback lacks shows up here, not on the device)."""
    code = """
import json, sys
if sys.argv[1] == "lite":
""" + "\n".join("    " + line for line in _BLOCK.strip().splitlines()) + """
from vllm_onlinespec import config
out = []
for case in json.loads(sys.argv[2]):
    try:
        out.append(config.OnlineSpecConfig.from_any(case).model_dump(mode="json"))
    except config.ConfigError as e:
        out.append(str(e))
print(json.dumps([config.PYDANTIC, out]))
"""
    cases = json.dumps(_CONFIG_CASES)
    full, lite = (_python(code, mode, cases) for mode in ("full", "lite"))
    assert full.returncode == 0 and lite.returncode == 0, full.stderr[-2000:] + lite.stderr[-2000:]
    (p_full, got_full), (p_lite, got_lite) = json.loads(full.stdout), json.loads(lite.stdout)
    assert p_full and not p_lite
    for case, a, b in zip(_CONFIG_CASES, got_full, got_lite):
        assert a == b, case
