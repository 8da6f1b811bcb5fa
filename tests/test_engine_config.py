"""Start-up validation in the calling process: `additional_config={"onlinespec": ...}` selects the
worker, and a bad value fails before any engine process starts, in one line naming the field."""

import pytest

from engine_checks import make_drafter


@pytest.fixture(scope="module")
def drafter(smollm2_path, tmp_path_factory):
    return make_drafter(smollm2_path, str(tmp_path_factory.mktemp("cfg") / "drafter"))


def engine_config(target, drafter, online, method="dflash", **extra):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_onlinespec.engine import engine_kwargs

    kw = engine_kwargs(max_model_len=512)
    kw.pop("seed", None)
    kw.update(extra)
    args = EngineArgs(model=target, dtype="float32", seed=0, **kw,
                      speculative_config={"method": method, "model": drafter, "num_speculative_tokens": 4}
                      if method else None,
                      additional_config={"onlinespec": online})
    return args.create_engine_config()


def test_onlinespec_config_selects_the_worker(smollm2_path, drafter):
    cfg = engine_config(smollm2_path, drafter, {"update": {"algorithm": "optimistic"}})
    assert cfg.parallel_config.worker_cls == "vllm_onlinespec.SpecDecodeWorker"


@pytest.mark.parametrize("online,field", [
    ({"update": {"lr": -1}}, "onlinespec.update.lr: must be > 0"),
    ({"lr": 1e-3}, "onlinespec.lr: moved to onlinespec.update.lr"),
    ({"loss": {"alpha": 1.5}}, "onlinespec.loss.alpha"),
    ({"length_head": {"policy": "magic"}}, "onlinespec.length_head.policy"),
    ({"no_such_field": 1}, "no_such_field"),
])
def test_bad_config_fails_with_the_field(smollm2_path, drafter, online, field):
    from vllm_onlinespec.config import ConfigError

    with pytest.raises(ConfigError) as e:
        engine_config(smollm2_path, drafter, online)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_worker_needs_dflash(smollm2_path, drafter):
    from vllm_onlinespec.config import ConfigError

    with pytest.raises(ConfigError, match="method 'dflash'"):
        engine_config(smollm2_path, drafter, {}, method=None)


# -- what the engine arguments must be (serving/compat/engine_args.py) ---------------------------

def test_v1_runner_selected_and_async_scheduling_off(smollm2_path, drafter, monkeypatch, caplog):
    import logging
    import os

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    from vllm_onlinespec.serving.compat import patches

    monkeypatch.setattr(patches, "_logged", set())
    with caplog.at_level(logging.INFO, logger="vllm_onlinespec"):
        cfg = engine_config(smollm2_path, drafter, {})
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert cfg.use_v2_model_runner is False
    assert cfg.scheduler_config.async_scheduling is False
    assert any("V1 model runner selected" in r.getMessage() for r in caplog.records)


def test_v1_runner_left_alone_for_other_engines(smollm2_path, monkeypatch):
    import os

    from vllm.engine.arg_utils import EngineArgs

    from vllm_onlinespec.engine import engine_kwargs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    kw = engine_kwargs(max_model_len=512)
    EngineArgs(model=smollm2_path, dtype="float32", **kw).create_engine_config()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


@pytest.mark.parametrize("env,extra,names", [
    ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, {}, "VLLM_USE_V2_MODEL_RUNNER"),
    ({}, {"async_scheduling": True}, "--async-scheduling"),
    ({}, {"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
    ({}, {"data_parallel_size": 2}, "--data-parallel-size"),
])
def test_unsupported_engine_args_refused_in_one_line(smollm2_path, drafter, monkeypatch, env,
                                                     extra, names):
    from vllm_onlinespec.serving.compat.engine_args import EngineArgsError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(EngineArgsError) as e:
        engine_config(smollm2_path, drafter, {}, **extra)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_unresolvable_drafter_fails_before_any_engine(smollm2_path, drafter, monkeypatch, tmp_path):
    from vllm_onlinespec.drafter.source import DrafterNotFound

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DrafterNotFound) as e:
        engine_config(smollm2_path, drafter, {"drafter": "nobody/no-such-drafter"})
    assert "nobody/no-such-drafter" in str(e.value) and "\n" not in str(e.value)


def test_full_cuda_graphs_become_piecewise_when_verify_batches_are_uneven():
    """Cut drafts or lookup drafts make uneven verify batches: full CUDA graphs of the target
    step give way to piecewise ones, as vLLM does for its own dynamic speculation; a fixed
    policy without lookup keeps the mode."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.serving.compat import engine_args as ea

    def vcfg(mode):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))

    budget = OnlineSpecConfig.from_any({"length_head": {"policy": "budget", "k_min": 0}})
    lookup = OnlineSpecConfig.from_any({"prompt_lookup": {"enabled": True}})
    plain = OnlineSpecConfig.from_any({})
    assert ea.uneven_verify_reason(plain) is None
    for cfg in (budget, lookup):
        v = vcfg(CUDAGraphMode.FULL_AND_PIECEWISE)
        line = ea.piecewise_for_uneven_verify(v, ea.uneven_verify_reason(cfg))
        assert v.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
        assert "FULL_AND_PIECEWISE -> PIECEWISE" in line
    v = vcfg(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert ea.piecewise_for_uneven_verify(v, ea.uneven_verify_reason(plain)) is None
    assert v.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    v = vcfg(CUDAGraphMode.NONE)  # the CPU: no graphs, nothing to change
    assert ea.piecewise_for_uneven_verify(v, "cuts") is None
