import json

import pytest
from pydantic import BaseModel

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig


def test_defaults_valid():
    cfg = OnlineSpecConfig.from_any(None)
    assert cfg.update.algorithm == "ogd" and cfg.update.lr == 1e-4
    assert cfg.pacing.learner_threads == 1
    assert cfg.loss.alpha == 0.8 and cfg.loss.gamma == 7 and cfg.loss.temperature == 1
    assert cfg.length_head.policy == "fixed" and cfg.length_head.rho == 1.0
    assert cfg.publish.kv_policy == "tolerate"
    assert all(lr > 0 for lr in cfg.update.ensemble_lrs)
    # every field documents itself
    for model in (OnlineSpecConfig, *(type(getattr(cfg, name)) for name, f in
                                      OnlineSpecConfig.model_fields.items() if f.default_factory
                                      or isinstance(f.default, BaseModel))):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"


def test_json_string_dict_and_instance():
    text = json.dumps({"update": {"algorithm": "ensemble", "lr": 3e-4}, "loss": {"mode": "ce"},
                       "buffer": {"window_tokens": 256}})
    cfg = OnlineSpecConfig.from_any(text)
    assert cfg.update.algorithm == "ensemble" and cfg.update.lr == 3e-4 and cfg.loss.mode == "ce"
    assert cfg.buffer.window_tokens == 256 and cfg.buffer.max_requests == 64
    assert OnlineSpecConfig.from_any(json.loads(text)) == cfg
    assert OnlineSpecConfig.from_any(cfg) == cfg
    assert OnlineSpecConfig.from_any(cfg.model_dump_json()) == cfg


def test_json_file(tmp_path):
    p = tmp_path / "os.json"
    p.write_text('{"update": {"lr": 0.001}}')
    assert OnlineSpecConfig.from_any(str(p)).update.lr == 0.001
    assert OnlineSpecConfig.from_any(p).update.lr == 0.001


def test_frozen():
    cfg = OnlineSpecConfig.from_any(None)
    with pytest.raises(Exception):
        cfg.enabled = False
    with pytest.raises(Exception):
        cfg.update.lr = 1.0


@pytest.mark.parametrize("bad, expected", [
    ({"update": {"lr": -1}}, "onlinespec.update.lr: must be > 0 (got -1)"),
    ({"loss": {"alpha": 1.5}}, "onlinespec.loss.alpha: must be in [0, 1] (got 1.5)"),
    ({"pacing": {"learner_cpu_share": 0}},
     "onlinespec.pacing.learner_cpu_share: must be in (0, 1] (got 0)"),
    ({"update": {"ensemble_lrs": [1e-4, -2]}},
     "onlinespec.update.ensemble_lrs[1]: must be > 0 (got -2)"),
    ({"update": {"betas": [0.9, 1.0]}}, "onlinespec.update.betas[1]: must be in [0, 1) (got 1.0)"),
    ({"length_head": {"k_min": -1}}, "onlinespec.length_head.k_min: must be >= 0 (got -1)"),
    ({"update": {"grad_clip": 0.0}}, "onlinespec.update.grad_clip: must be > 0 (got 0.0)"),
    ({"update": {"lr": float("inf")}}, "onlinespec.update.lr: "),
    ({"pacing": {"learner_cores": [2, -1]}},
     "onlinespec.pacing.learner_cores: must be one of 'auto' or 'inherit' (got [2, -1]); "
     "onlinespec.pacing.learner_cores[1]: must be >= 0 (got -1)"),
])
def test_bad_value_one_line(bad, expected):
    with pytest.raises(ConfigError) as ei:
        OnlineSpecConfig.from_any(bad)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(expected), msg
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("bad, fragments", [
    ({"update": {"algorithm": "sgd"}}, ["onlinespec.update.algorithm", "'ogd'", "'ensemble'",
                                        "'sgd'"]),
    ({"publish": {"kv_policy": "flush"}}, ["onlinespec.publish.kv_policy", "'tolerate'", "'flush'"]),
    ({"loss": {"mode": "kl"}}, ["onlinespec.loss.mode", "'reverse_kl'"]),
    ({"buffer": {"bogus": 1}}, ["onlinespec.buffer.bogus", "unknown field", "window_tokens"]),
    ({"lrr": 1}, ["onlinespec.lrr", "unknown field"]),
    ({"update": {"lr": "fast"}}, ["onlinespec.update.lr", "> 0", "'fast'"]),
    ({"update": {"algorithm": "ensemble", "ensemble_lrs": [1e-3]}}, ["ensemble", ">= 2"]),
    ({"buffer": {"window_tokens": 10_000, "max_tokens": 100}}, ["onlinespec.buffer", "max_tokens"]),
])
def test_bad_value_names_field(bad, fragments):
    with pytest.raises(ConfigError) as ei:
        OnlineSpecConfig.from_any(bad)
    msg = str(ei.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg


def test_several_errors_still_one_line():
    with pytest.raises(ConfigError) as ei:
        OnlineSpecConfig.from_any({"update": {"lr": -1}, "loss": {"gamma": 0}})
    msg = str(ei.value)
    assert "\n" not in msg and "onlinespec.update.lr" in msg and "onlinespec.loss.gamma" in msg


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 42])
def test_bad_inputs(bad):
    with pytest.raises(ConfigError) as ei:
        OnlineSpecConfig.from_any(bad)
    assert str(ei.value).startswith("onlinespec")


@pytest.mark.parametrize("old, new", [
    ("lr", "update.lr"), ("algorithm", "update.algorithm"), ("eps", "update.adam_eps"),
    ("hedge_eps", "update.hedge_lr"), ("hedge_share", "update.hedge_share"),
    ("learner_cpu_share", "pacing.learner_cpu_share"), ("learner_cores", "pacing.learner_cores"),
])
def test_old_flat_keys_are_refused_with_one_line_naming_the_new_key(old, new):
    with pytest.raises(ConfigError) as e:
        OnlineSpecConfig.from_any({old: 1})
    assert str(e.value) == f"onlinespec.{old}: moved to onlinespec.{new}"
    with pytest.raises(ConfigError) as e:  # beside a preset too, which fills the sections
        OnlineSpecConfig.from_any({"preset": "cpu", old: 1})
    assert str(e.value) == f"onlinespec.{old}: moved to onlinespec.{new}"
    with pytest.raises(Exception):  # the old names do not read either
        getattr(OnlineSpecConfig.from_any({}), old)
