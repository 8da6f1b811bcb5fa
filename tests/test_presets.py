"""One recommended configuration: the `cpu` preset fills what a config does not give, and the
demo, `bench`, `bench-serve`, the examples and the README all serve it (read from each)."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest

from vllm_onlinespec.bench.arm_catalog import base_settings, make_arm
from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.presets import PRESET_K, PRESETS, preset

REPO = Path(__file__).resolve().parents[1]


def test_preset_fills_what_is_not_given_and_explicit_keys_win():
    c = OnlineSpecConfig.from_any({"preset": "cpu", "enabled": False, "update": {"lr": 1e-3},
                                   "prompt_lookup": {"min_n": 3}})
    assert c.preset == "cpu" and not c.enabled
    assert c.update.lr == 1e-3  # a key of a section the preset sets overrides that key only
    assert c.update.algorithm == "ogd" and c.pacing.learner_cpu_share == 0.25
    assert (c.length_head.policy, c.length_head.k_min) == ("budget", 0)
    # a section given in part keeps the preset's other keys
    assert c.prompt_lookup.enabled and c.prompt_lookup.source == "suffix_tree"
    assert c.prompt_lookup.min_n == 3
    assert OnlineSpecConfig.from_any(c) == c  # round trip: the dump is all explicit keys
    plain = OnlineSpecConfig.from_any({})
    assert plain.preset is None and plain.length_head.policy != "budget"


def test_unknown_preset_is_one_line_naming_it():
    with pytest.raises(ConfigError) as e:
        OnlineSpecConfig.from_any({"preset": "gpu"})
    assert str(e.value) == "onlinespec.preset: unknown preset 'gpu'; known: cpu"
    with pytest.raises(ConfigError, match="onlinespec.preset: unknown preset"):
        OnlineSpecConfig.from_any({"preset": ["cpu"]})


def test_every_preset_validates():
    for name in PRESETS:
        c = OnlineSpecConfig.from_any(preset(name))
        assert c.preset is None and name in PRESET_K


def _resolved(onlinespec: dict) -> dict:
    return OnlineSpecConfig.from_any(onlinespec).model_dump(exclude={"preset"})


CPU = _resolved({"preset": "cpu"})


def test_bench_bench_serve_and_demo_serve_the_preset(tmp_path):
    from vllm_onlinespec.bench.demo import DEMO_PRESET, demo_arms
    from vllm_onlinespec.cli import build_parser

    parser = build_parser()
    bench = parser.parse_args(["bench", "--out", str(tmp_path)])
    serve = parser.parse_args(["bench-serve", "--spec-bench", "q.jsonl", "--out", str(tmp_path)])
    assert bench.preset == serve.preset == DEMO_PRESET == "cpu"
    drafter = str(REPO / "vllm_onlinespec" / "drafters" / "smollm2-135m")
    frozen = make_arm("frozen", target="t", prompts="p", out_dir=tmp_path, drafter=drafter,
                      online=base_settings(bench.preset))
    got = _resolved(frozen.onlinespec)
    assert not got["enabled"]  # learning off: the preset's serving half, the drafter frozen
    assert {k: got[k] for k in ("length_head", "prompt_lookup")} == {
        k: CPU[k] for k in ("length_head", "prompt_lookup")}
    assert frozen.num_speculative_tokens == PRESET_K["cpu"]

    class Plan:
        max_tokens, arrivals, window_s = 64, "closed:4", 20.0

    online, arms = demo_arms(Plan, "t", tmp_path / "s.jsonl", tmp_path, drafter)
    assert online == preset("cpu")
    ogd = next(a for a in arms if a.name == "online-ogd")
    assert _resolved({k: v for k, v in ogd.onlinespec.items() if k != "checkpoint"}) == CPU


def test_arm_names_say_where_they_leave_the_preset(tmp_path):
    kw = dict(target="t", prompts="p", out_dir=tmp_path, drafter="d", num_speculative_tokens=4,
              online=base_settings("cpu"))
    alone = OnlineSpecConfig.from_any(make_arm("frozen+nolookup", **kw).onlinespec)
    assert not alone.prompt_lookup.enabled and alone.length_head.policy == "budget"
    ngram = OnlineSpecConfig.from_any(make_arm("online-ogd+lookup", **kw).onlinespec)
    assert ngram.prompt_lookup.enabled and ngram.prompt_lookup.source == "ngram"
    fixed = OnlineSpecConfig.from_any(make_arm("fixed", **kw).onlinespec)
    assert fixed.length_head.policy == "fixed" and fixed.update.lr == 3e-4
    conf = OnlineSpecConfig.from_any(make_arm("frozen+confidence", **kw).onlinespec)
    assert conf.length_head.estimator == "confidence" and conf.length_head.policy == "budget"
    assert conf.prompt_lookup.source == "suffix_tree"  # the rest of the preset kept
    whole = OnlineSpecConfig.from_any(make_arm("frozen+unpriced", **kw).onlinespec)
    assert not whole.length_head.price_lookup and whole.length_head.gate
    rollout = OnlineSpecConfig.from_any(make_arm("frozen+slowest", **kw).onlinespec)
    assert rollout.length_head.option_objective == "slowest"
    assert alone.length_head.option_objective == "tokens"  # the preset's
    auto = OnlineSpecConfig.from_any(make_arm("frozen+auto", **kw).onlinespec)
    assert auto.length_head.option_objective == "auto" and auto.length_head.option_closed_after == 8
    every = OnlineSpecConfig.from_any(make_arm("frozen+tokens", **kw).onlinespec)
    assert every.length_head.option_objective == "tokens" and every.length_head.policy == "budget"
    now = OnlineSpecConfig.from_any(make_arm("frozen+slowest+contextnow", **kw).onlinespec)
    assert now.length_head.k0_step == "context_only" and now.length_head.option_objective == "slowest"
    assert rollout.length_head.k0_step == "deferred"
    for one in ("plain", "tree"):  # the budget held to one option, the preset's tree kept
        held = OnlineSpecConfig.from_any(make_arm(f"frozen+{one}only", **kw).onlinespec)
        assert held.length_head.options == [one] and held.length_head.policy == "budget"
        assert held.prompt_lookup.source == "suffix_tree" and not held.enabled
    coupled = OnlineSpecConfig.from_any(make_arm("online-ogd+coupled", **kw).onlinespec)
    assert coupled.sampling.coupled_drafts and coupled.enabled
    assert coupled.prompt_lookup.source == "suffix_tree"
    with pytest.raises(ValueError, match="goes with this project's DFlash arms"):
        make_arm("vllm-suffix+unpriced", **kw)
    none = base_settings("none")
    assert "length_head" not in none and "prompt_lookup" not in none


def test_examples_and_readme_serve_the_preset(monkeypatch):
    ex = REPO / "examples"
    monkeypatch.syspath_prepend(str(ex))  # the example imports its neighbour _drafter.py
    online = runpy.run_path(str(ex / "offline_chat_online.py"), run_name="x")["ONLINE"]
    assert online["preset"] == "cpu"
    assert set(online) == {"preset", "publish"}  # its one departure, said in a comment there
    for script in ("serve_openai.sh", "bench_serve_spec_bench.sh"):
        assert """start_server '{"onlinespec": {"preset": "cpu"}}'""" in (ex / script).read_text()
    assert '"onlinespec": {"preset": "cpu"}' in (ex / "swap_target.py").read_text()
    assert 'PRESET_K["cpu"]' in (ex / "swap_target.py").read_text()
    readme = (REPO / "README.md").read_text()
    configs = re.findall(r"--additional-config '(\{.*?\})'", readme)
    assert configs and all(json.loads(c)["onlinespec"] == {"preset": "cpu"} for c in configs)
    ks = re.findall(r'"num_speculative_tokens": (\d+)', readme)
    assert ks and {int(k) for k in ks} == {PRESET_K["cpu"]}
    assert 'additional_config={"onlinespec": {"preset": "cpu"}}' in readme
