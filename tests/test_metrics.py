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
