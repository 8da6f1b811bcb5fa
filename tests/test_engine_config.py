"""Start-up validation in the calling process: `additional_config={"onlinespec": ...}` selects the
worker, and a bad value fails before any engine process starts, in one line naming the field."""

import pytest

from test_worker_parity import make_drafter


@pytest.fixture(scope="module")
def drafter(smollm2_path, tmp_path_factory):
    return make_drafter(smollm2_path, str(tmp_path_factory.mktemp("cfg") / "drafter"))


def engine_config(target, drafter, online, method="dflash"):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_onlinespec.engine import engine_kwargs

    kw = engine_kwargs(max_model_len=512)
    kw.pop("seed", None)
    args = EngineArgs(model=target, dtype="float32", seed=0, **kw,
                      speculative_config={"method": method, "model": drafter, "num_speculative_tokens": 4}
                      if method else None,
                      additional_config={"onlinespec": online})
    return args.create_engine_config()


def test_onlinespec_config_selects_the_worker(smollm2_path, drafter):
    cfg = engine_config(smollm2_path, drafter, {"algorithm": "optimistic"})
    assert cfg.parallel_config.worker_cls == "vllm_onlinespec.SpecDecodeWorker"


@pytest.mark.parametrize("online,field", [
    ({"lr": -1}, "onlinespec.lr"),
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
