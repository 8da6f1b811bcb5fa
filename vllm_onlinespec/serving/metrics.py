"""Prometheus metrics beside vLLM's own on `/metrics`.

The learner lives in the worker process, `/metrics` in the API-server process, and vLLM only
turns on prometheus' multiprocess mode with several API servers. So each worker writes its
figures to a small JSON file (atomically, at most every `min_interval_s`), and a collector
registered in the API server reads them at scrape time. The directory is created by the plugin
in the first vLLM process and inherited by the processes it spawns.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from vllm_onlinespec.serving.stats import OnlineSpecStats, is_number

ENV = "ONLINESPEC_METRICS_DIR"  # not VLLM_*: vLLM warns about unknown VLLM_ variables

# name -> (prometheus type, reader of OnlineSpecStats, help); a reader returns None when the
# figure does not apply (no learner), and the metric then has no sample for that worker.
def _learner(attr: str) -> Callable[[OnlineSpecStats], Any]:
    return lambda s: getattr(s.learner, attr) if s.learner is not None else None


def _buffer(attr: str) -> Callable[[OnlineSpecStats], Any]:
    return lambda s: getattr(s.buffer, attr) if s.buffer is not None else None


METRICS: dict[str, tuple[str, Callable[[OnlineSpecStats], Any], str]] = {
    "onlinespec:drafter_version": ("gauge", lambda s: s.published_version, "drafter weights version vLLM serves"),
    "onlinespec:learner_updates": ("counter", _learner("updates"), "successful online updates"),
    "onlinespec:learner_errors": ("counter", _learner("errors"), "learner updates discarded after an exception"),
    "onlinespec:learner_nonfinite": ("counter", _learner("skipped_nonfinite"), "updates discarded for a non-finite loss or gradient"),
    "onlinespec:learner_loss": ("gauge", _learner("last_loss"), "loss of the last online update"),
    "onlinespec:learner_update_ms": ("gauge", _learner("update_ms"), "wall time of the last online update, ms"),
    "onlinespec:buffer_tokens": ("gauge", _buffer("size"), "tokens held by the feedback buffer"),
    "onlinespec:buffer_drops": ("counter", _buffer("drops"), "feedback tokens dropped before training"),
    "onlinespec:publish_ms": ("gauge", lambda s: s.publish_ms_last, "time to publish the last weights into vLLM's drafter, ms"),
    "onlinespec:publishes": ("counter", lambda s: s.publishes, "weight publishes into vLLM's drafter"),
    "onlinespec:hook_errors": ("counter", lambda s: s.hook_errors, "serving-side hook failures (step kept going)"),
    "onlinespec:hook_skips": ("counter", lambda s: sum(s.hooks.skips.values()), "serving-side hooks that had nothing to work on (step view, drafter hidden states, draft lists)"),
    "onlinespec:verify_tokens": ("counter", lambda s: s.cutter.verified, "draft tokens sent to verification"),
    "onlinespec:draft_tokens": ("counter", lambda s: s.cutter.drafted, "draft tokens proposed before the verify-length cut"),
    "onlinespec:gate_shut_steps": ("counter", lambda s: s.cutter.gate_shut_steps, "steps the budget's gate ran vLLM's drafter at K = 0 (speculation would not pay)"),
    "onlinespec:gate_explore_steps": ("counter", lambda s: s.cutter.gate_explore_steps, "steps drafted only to keep the acceptance estimate current"),
    "onlinespec:gate_short_steps": ("counter", lambda s: s.cutter.gate_short_steps, "steps the budget's gate drafted fewer than K tokens (only those paid)"),
    "onlinespec:lookup_draft_tokens": ("counter", lambda s: s.lookup_drafted, "draft tokens verified that came from prompt lookup instead of the drafter"),
    "onlinespec:lookup_accepted_tokens": ("counter", lambda s: s.lookup_accepted, "of those, accepted by the target"),
    "onlinespec:lookup_priced_cut_tokens": ("counter", lambda s: s.lookup_priced_cut, "suffix-tree draft tokens the budget left unverified (they did not pay)"),
    "onlinespec:lookup_weak_drafts": ("counter", lambda s: s.lookup_weak_rows, "suffix-tree drafts below suffix_min_score verified where the drafter drafted nothing for the request"),
    "onlinespec:acceptance_mse": ("gauge", lambda s: s.cutter.estimator_mse if s.cutter.estimator_mse is not None else s.cutter.head_mse, "squared error of the acceptance estimate in use (confidence estimator, else length head) on exact verification labels, decayed"),
    "onlinespec:acceptance_population_mse": ("gauge", lambda s: s.cutter.estimator_population_mse if s.cutter.estimator_mse is not None else s.cutter.head_population_mse, "the population estimate's squared error on the same labels"),
}


def ensure_dir() -> Path:
    d = os.environ.get(ENV)
    if not d:
        d = tempfile.mkdtemp(prefix="vllm-onlinespec-metrics-")
        os.environ[ENV] = d
    return Path(d)


class MetricsWriter:
    def __init__(self, min_interval_s: float = 0.5) -> None:
        d = os.environ.get(ENV)
        self.path = Path(d) / f"worker-{os.getpid()}.json" if d else None
        self.min_interval_s = min_interval_s
        self._last = 0.0

    def due(self) -> bool:
        """Cheap check before building the stats: a step must not pay for a write it skips."""
        return self.path is not None and time.monotonic() - self._last >= self.min_interval_s

    def write(self, stats: OnlineSpecStats, info: dict[str, str], force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.min_interval_s):
            return
        self._last = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stats": stats.to_dict(), "info": info}, default=float))
        os.replace(tmp, self.path)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True  # exists but not ours to signal / not a pid name: keep it
    return not _zombie(pid)


def _zombie(pid: str) -> bool:
    """An exited worker nobody reaped yet (its engine was killed) answers signal 0 like a live
    one: /proc says which it is (Linux; elsewhere: not a zombie)."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]  # field 3, after "(comm)"


class OnlineSpecCollector:
    """prometheus_client custom collector over the workers' JSON files."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        d = os.environ.get(ENV)
        files = sorted(Path(d).glob("worker-*.json")) if d else []
        data = []
        for f in files:
            pid = f.stem.split("-", 1)[1]
            if not _alive(pid):
                continue  # an earlier engine's worker that shared the folder: not ours to report
            try:
                data.append((pid, json.loads(f.read_text())))
            except (OSError, ValueError):
                continue
        parsed = [(pid, OnlineSpecStats.from_dict(d.get("stats"))) for pid, d in data]
        for name, (kind, read, doc) in METRICS.items():
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name.removesuffix("_total"), doc, labels=["worker"])
            for pid, st in parsed:
                v = read(st)
                if is_number(v):
                    fam.add_metric([pid], float(v))
            yield fam
        yield from _option_families(parsed)
        info = InfoMetricFamily("onlinespec:config", "online speculation settings in force",
                                labels=["worker"])
        for pid, d in data:
            info.add_metric([pid], {k: str(v) for k, v in d.get("info", {}).items()})
        yield info


def _option_families(parsed: list[tuple[str, OnlineSpecStats]]) -> Iterator[Any]:
    """The budget's options: steps each ran (counter) and its measured price per bucket."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    steps = CounterMetricFamily("onlinespec:option_steps", "steps the budget ran each option "
                                "(plain, tree, drafter)", labels=["worker", "option"])
    price = GaugeMetricFamily("onlinespec:option_ms_per_token", "what each option's measured "
                              "engine cycles cost per produced token, ms, by batch bucket",
                              labels=["worker", "option", "batch"])
    for pid, st in parsed:
        for option, n in st.cutter.option_steps.items():
            steps.add_metric([pid, option], float(n))
        for key, ms in st.cutter.option_ms_per_token.items():
            option, _, bucket = key.partition("@B")
            price.add_metric([pid, option, bucket], float(ms))
    yield steps
    yield price


_registered = False


def register_collector() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    ensure_dir()
    from prometheus_client import REGISTRY

    REGISTRY.register(OnlineSpecCollector())
