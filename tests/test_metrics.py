"""The /metrics collector reports live workers only: a folder shared with an earlier engine
(same ONLINESPEC_METRICS_DIR, e.g. inherited from a parent that ran one) must not leak its
stale series."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("prometheus_client")


def test_collector_skips_workers_that_are_gone(tmp_path, monkeypatch):
    from vllm_onlinespec.serving.metrics import ENV, MetricsWriter, OnlineSpecCollector

    monkeypatch.setenv(ENV, str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"worker-{dead.pid}.json").write_text(json.dumps(
        {"stats": {"published_version": 0}, "info": {}}))
    from vllm_onlinespec.serving.stats import LearnerStats, OnlineSpecStats

    MetricsWriter().write(OnlineSpecStats(published_version=7, learner=LearnerStats(updates=3),
                                          lookup_drafted=12, lookup_accepted=9),
                          {"algorithm": "ogd"}, force=True)
    fams = {f.name: f for f in OnlineSpecCollector().collect()}
    version = [(s.labels["worker"], s.value) for s in fams["onlinespec:drafter_version"].samples]
    assert version == [(str(os.getpid()), 7.0)]
    assert [s.value for s in fams["onlinespec:learner_updates"].samples] == [3.0]
    assert [s.value for s in fams["onlinespec:lookup_accepted_tokens"].samples] == [9.0]
    assert [s.value for s in fams["onlinespec:lookup_draft_tokens"].samples] == [12.0]


def test_the_budgets_options_are_reported_by_option_and_batch(tmp_path, monkeypatch):
    from vllm_onlinespec.serving.metrics import ENV, MetricsWriter, OnlineSpecCollector
    from vllm_onlinespec.serving.stats import CutterStats, OnlineSpecStats

    monkeypatch.setenv(ENV, str(tmp_path))
    cutter = CutterStats(option_steps={"plain": 5, "tree": 20, "drafter": 75},
                         option_ms_per_token={"plain@B8": 10.0, "tree@B8": 8.5, "drafter@B1": 20.0})
    MetricsWriter().write(OnlineSpecStats(cutter=cutter), {}, force=True)
    fams = {f.name: f for f in OnlineSpecCollector().collect()}
    steps = {s.labels["option"]: s.value for s in fams["onlinespec:option_steps"].samples
             if s.name.endswith("_total")}
    assert steps == {"plain": 5.0, "tree": 20.0, "drafter": 75.0}
    price = {(s.labels["option"], s.labels["batch"]): s.value
             for s in fams["onlinespec:option_ms_per_token"].samples}
    assert price == {("plain", "8"): 10.0, ("tree", "8"): 8.5, ("drafter", "1"): 20.0}


def test_an_unreaped_worker_is_not_reported(tmp_path, monkeypatch):
    """A worker whose engine was killed may linger as a zombie, which answers signal 0 like a
    live process: its last figures must not be reported beside a live server's."""
    import time

    from vllm_onlinespec.serving.metrics import ENV, OnlineSpecCollector, _alive

    monkeypatch.setenv(ENV, str(tmp_path))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; not waited for yet
    try:
        deadline = time.time() + 20
        while time.time() < deadline and _alive(str(zombie.pid)):
            time.sleep(0.05)
        assert not _alive(str(zombie.pid))
        os.kill(zombie.pid, 0)  # still there as a zombie: signal 0 alone would call it alive
        (tmp_path / f"worker-{zombie.pid}.json").write_text(json.dumps(
            {"stats": {"published_version": 0}, "info": {}}))
        fams = {f.name: f for f in OnlineSpecCollector().collect()}
        assert fams["onlinespec:drafter_version"].samples == []
    finally:
        zombie.wait()
