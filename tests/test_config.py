import json

import pytest

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig


def test_defaults_valid():
    cfg = OnlineSpecConfig.from_any(None)
    assert cfg.algorithm == "ogd" and cfg.lr == 1e-4 and cfg.learner_threads == 1
    assert cfg.loss.alpha == 0.8 and cfg.loss.gamma == 7 and cfg.loss.temperature == 1
    assert cfg.length_head.policy == "fixed" and cfg.length_head.rho == 1.0
    assert cfg.publish.kv_policy == "tolerate"
    assert all(lr > 0 for lr in cfg.ensemble_lrs)
    # every field documents itself
    for model in (OnlineSpecConfig, type(cfg.buffer), type(cfg.loss), type(cfg.length_head),
                  type(cfg.publish), type(cfg.checkpoint)):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"


def test_json_string_dict_and_instance():
    text = json.dumps({"algorithm": "ensemble", "lr": 3e-4, "loss": {"mode": "ce"},
                       "buffer": {"window_tokens": 256}})
    cfg = OnlineSpecConfig.from_any(text)
    assert cfg.algorithm == "ensemble" and cfg.lr == 3e-4 and cfg.loss.mode == "ce"
    assert cfg.buffer.window_tokens == 256 and cfg.buffer.max_requests == 64
    assert OnlineSpecConfig.from_any(json.loads(text)) == cfg
    assert OnlineSpecConfig.from_any(cfg) == cfg
    assert OnlineSpecConfig.from_any(cfg.to_json()) == cfg


def test_json_file(tmp_path):
    p = tmp_path / "os.json"
    p.write_text('{"lr": 0.001}')
    assert OnlineSpecConfig.from_any(str(p)).lr == 0.001
    assert OnlineSpecConfig.from_any(p).lr == 0.001


def test_frozen():
    cfg = OnlineSpecConfig.from_any(None)
    with pytest.raises(Exception):
        cfg.lr = 1.0


@pytest.mark.parametrize("bad, expected", [
    ({"lr": -1}, "onlinespec.lr: must be > 0 (got -1)"),
    ({"loss": {"alpha": 1.5}}, "onlinespec.loss.alpha: must be in [0, 1] (got 1.5)"),
    ({"learner_cpu_share": 0}, "onlinespec.learner_cpu_share: must be in (0, 1] (got 0)"),
    ({"ensemble_lrs": [1e-4, -2]}, "onlinespec.ensemble_lrs[1]: must be > 0 (got -2)"),
    ({"betas": [0.9, 1.0]}, "onlinespec.betas[1]: must be in [0, 1) (got 1.0)"),
    ({"length_head": {"k_min": -1}}, "onlinespec.length_head.k_min: must be >= 0 (got -1)"),
    ({"grad_clip": 0.0}, "onlinespec.grad_clip: must be > 0 (got 0.0)"),
    ({"lr": float("inf")}, "onlinespec.lr: "),
])
def test_bad_value_one_line(bad, expected):
    with pytest.raises(ConfigError) as ei:
        OnlineSpecConfig.from_any(bad)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(expected), msg
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("bad, fragments", [
    ({"algorithm": "sgd"}, ["onlinespec.algorithm", "'ogd'", "'ensemble'", "'sgd'"]),
    ({"publish": {"kv_policy": "flush"}}, ["onlinespec.publish.kv_policy", "'tolerate'", "'flush'"]),
    ({"loss": {"mode": "kl"}}, ["onlinespec.loss.mode", "'reverse_kl'"]),
    ({"buffer": {"bogus": 1}}, ["onlinespec.buffer.bogus", "unknown field", "window_tokens"]),
    ({"lrr": 1}, ["onlinespec.lrr", "unknown field"]),
    ({"lr": "fast"}, ["onlinespec.lr", "> 0", "'fast'"]),
    ({"algorithm": "ensemble", "ensemble_lrs": [1e-3]}, ["ensemble", ">= 2"]),
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
        OnlineSpecConfig.from_any({"lr": -1, "loss": {"gamma": 0}})
    msg = str(ei.value)
    assert "\n" not in msg and "onlinespec.lr" in msg and "onlinespec.loss.gamma" in msg


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 42])
def test_bad_inputs(bad):
    with pytest.raises(ConfigError) as ei:
        OnlineSpecConfig.from_any(bad)
    assert str(ei.value).startswith("onlinespec")


def test_update_rule_and_pacing_sections_accept_the_old_flat_keys():
    old = OnlineSpecConfig.from_any({"algorithm": "ensemble", "lr": 3e-4, "eps": 1e-6,
                                     "hedge_eps": 0.3, "ensemble_lrs": [1e-4, 1e-3],
                                     "learner_cpu_share": 0.25, "learner_cores": "inherit"})
    new = OnlineSpecConfig.from_any({
        "update": {"algorithm": "ensemble", "lr": 3e-4, "adam_eps": 1e-6, "hedge_lr": 0.3,
                   "ensemble_lrs": [1e-4, 1e-3]},
        "pacing": {"learner_cpu_share": 0.25, "learner_cores": "inherit"}})
    assert old == new
    # the old names still read (the learner and the algorithms use them)
    assert (new.algorithm, new.lr, new.eps, new.hedge_eps, new.learner_cpu_share) == (
        "ensemble", 3e-4, 1e-6, 0.3, 0.25)
    assert OnlineSpecConfig.from_any(new.to_json()) == new
    assert OnlineSpecConfig(lr=0.5).update.lr == 0.5  # direct construction too


def test_old_and_new_spelling_of_one_key_is_refused_and_errors_name_what_was_written():
    with pytest.raises(ConfigError) as e:
        OnlineSpecConfig.from_any({"lr": 1e-3, "update": {"lr": 1e-4}})
    assert str(e.value) == "onlinespec.lr: also given as onlinespec.update.lr; use one"
    with pytest.raises(ConfigError) as e:
        OnlineSpecConfig.from_any({"update": {"lr": -1}})
    assert str(e.value) == "onlinespec.update.lr: must be > 0 (got -1)"
    with pytest.raises(ConfigError) as e:
        OnlineSpecConfig.from_any({"hedge_eps": 0})
    assert str(e.value) == "onlinespec.hedge_eps: must be > 0 (got 0)"
