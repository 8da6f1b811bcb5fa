"""The GPU checks, without vLLM (docs/gpu.md "Checking a GPU"; lab/design/gpu_path.md).

    lab/gpu_check.sh                        # on the GPU machine: every step -> $OUT
    lab/gpu_check.sh --smoke --out DIR      # CPU, tiny shapes (tests/test_gpu_check.py)
    python3 lab/gpu_check.py --step B --out DIR [--smoke]   # one step -> DIR/steps/B.json
    python3 lab/gpu_check.py --report --out DIR             # -> DIR/gpu_check.{json,md}

Each step runs in its own process (gpu_check.sh), timed and time-boxed: one that fails, or
breaks its CUDA context, hides nothing of the others.

A kernels      tests/test_kernels.py on the device (TRITON_INTERPRET unset: Triton compiles for
               it), then the fused loss against the PyTorch reference at two vocabulary sizes
               (the target's and a reduced draft vocabulary), all-bf16 inputs and float32
               states with the bf16 head (the default float32 learner's case): loss and gradient
               error, time, peak memory.
B memory       start-up at real sizes, in vLLM's order: a bf16 stand-in of Qwen3-8B's size (its
               embedding and LM head at their real shapes, filler for the rest) and vLLM's
               drafter (the z-lab Qwen3-8B DFlash shape) are loaded; the real build_learner and
               check_fits run in float32 and in bf16; a KV-cache stand-in takes what vLLM would
               (gpu_memory_utilization x total minus what was consumed since start-up); then
               serving-sized updates (the blocks one update takes at the defaults), each
               published in place into vLLM's drafter: peak memory and headroom.
C concurrency  a serving loop replays a captured target stand-in and a captured drafter (the
               DFlash twin at the z-lab shape, vLLM's drafter's stand-in), feeds the real
               feedback stage (serving/feedback.py) into the real learner, whose thread trains
               and publishes; each publish is copied in place into the captured drafter's
               weights, and the first replay after it is checked against an eager forward of
               that snapshot. Step time with the learner off and on, updates/s, publish time.
D graphs       a CUDA graph captured while the learner updates on its thread (vLLM captures in
               its warm-up; the session starts the learner after it: serving/session.py); and
               two graphs in one memory pool (does the first's output survive the second's
               replay? is a copy taken between them right?).

The device image has no vLLM: it is refused on import here too, so the CPU smoke run imports
only what the device run can. pydantic is there (gpu_check.sh installs the wheels carried in
.whl/, `make device-wheels`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = {"A": "kernels", "B": "memory", "C": "concurrency", "D": "graphs"}
GIB, MIB = 1024 ** 3, 1024 ** 2


class _NoVllm:
    """A meta-path finder that refuses vLLM: the core must run on the device image without it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ImportError(f"gpu_check: {name} imported, but the device image has no vllm")
        return None


if not any(isinstance(f, _NoVllm) for f in sys.meta_path):
    sys.meta_path.insert(0, _NoVllm())
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

QWEN3_8B_DFLASH = dict(  # z-lab/Qwen3-8B-DFlash-b16
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33],
    mask_token_id=151669, block_size=16, rope_theta=1_000_000.0, torch_dtype="bfloat16")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, target_layer_ids=[0, 1],
            mask_token_id=0, block_size=5, rope_theta=10000.0, torch_dtype="float32")


@dataclass
class Shapes:
    """What each step runs on: FULL = the Qwen3-8B pair on one GPU; SMOKE = tiny, on the CPU."""

    device: str
    # A
    kernel_test_args: list[str]
    kernel_test_s: float
    loss_h: int
    loss_vocabs: list[int]
    loss_ns: list[int]
    loss_impls: list[str]
    loss_inputs: list[str]
    loss_reps: int
    # B, C: the drafter (vLLM's and the learner's) and the target beside it
    drafter: dict
    target_bytes: int  # the bf16 target's weights (B's stand-in: embedding, head, filler)
    target_layers: int  # C's captured target stand-in: MLP layers of the target's width
    target_inter: int
    learner_dtypes: list[str]
    windows: int  # an update's batch at the defaults: batch_blocks 16 / anchors_per_request 4
    window_tokens: int  # buffer.window_tokens
    anchors: int  # anchors_per_request
    updates: int
    requests: int  # C's running batch
    ctx_tokens: int  # C's drafter context per request
    off_s: float  # C: serving alone, then with the learner
    on_s: float
    # D
    small_drafter: dict
    utilization: float = 0.9  # vLLM's gpu_memory_utilization default


FULL = Shapes(
    device="cuda", kernel_test_args=[], kernel_test_s=90, loss_h=4096, loss_vocabs=[151936, 32768],
    loss_ns=[240, 4096], loss_impls=["naive", "chunked", "triton"],
    loss_inputs=["bf16", "fp32 states, bf16 head"], loss_reps=3,
    drafter=QWEN3_8B_DFLASH, target_bytes=2 * 8_190_735_360, target_layers=36, target_inter=12288,
    learner_dtypes=["float32", "bfloat16"], windows=4, window_tokens=512, anchors=4, updates=30,
    requests=8, ctx_tokens=64, off_s=6.0, on_s=15.0,
    small_drafter=dict(QWEN3_8B_DFLASH, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       vocab_size=32768, mask_token_id=0))
SMOKE = Shapes(
    device="cpu", kernel_test_args=["-k", "argument_errors"], kernel_test_s=60, loss_h=64,
    loss_vocabs=[1000, 300], loss_ns=[64], loss_impls=["naive", "chunked"], loss_inputs=["fp32"],
    loss_reps=1,
    drafter=TINY, target_bytes=0, target_layers=2, target_inter=128, learner_dtypes=["float32"],
    windows=2, window_tokens=64, anchors=2, updates=2, requests=2, ctx_tokens=16, off_s=0.5,
    on_s=3.0, small_drafter=TINY)


def say(*a) -> None:
    print(*a, flush=True)


class Result:
    """One step's figures and failures, written to <out>/steps/<X>.json however the step ends."""

    def __init__(self, step: str, s: Shapes) -> None:
        self.step, self.s = step, s
        self.data: dict = {}
        self.failures: list[str] = []
        self.part_failed = False

    def fail(self, what: str) -> None:
        say(f"[{self.step}] FAILED: {what}")
        self.failures.append(what)

    @contextlib.contextmanager
    def part(self, name: str):
        """A sub-check: its exception is a failure of this step, and the next part still runs
        (`part_failed` tells whether it did)."""
        t0, self.part_failed = time.perf_counter(), False
        say(f"[{self.step}] {name} ...")
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported; the step goes on
            traceback.print_exc()
            self.part_failed = True
            self.fail(f"{name}: {type(e).__name__}: {_line(e)}")
            _free()
        finally:
            self.data.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t0, 1)


def _line(e: BaseException) -> str:
    """An exception's first line (Triton and CUDA errors run to pages)."""
    return (str(e).strip().splitlines() or [""])[0][:300]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a broken context: the next CUDA call says so
            say(f"    (could not free device memory: {_line(e)})")


def _randn(rows: int, cols: int, dev: torch.device, dtype: torch.dtype, seed: int,
           std: float = 0.02) -> torch.Tensor:
    """Random weights made on the device (fast), in `dtype`."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(rows, cols, generator=g, device=dev) * std).to(dtype)


def _mib(x) -> float | None:
    return None if x is None else round(x / MIB, 1)


def _median(xs) -> float | None:
    xs = [x for x in xs if x == x]
    return round(statistics.median(xs), 3) if xs else None


# ------------------------------------------------------------------------------ A. kernels

def step_kernels(s: Shapes, r: Result) -> None:
    with r.part("kernel tests"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if s.device == "cpu":
            env["TRITON_INTERPRET"] = "1"  # the test suite's own setting without a GPU
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not vllm", "-p", "no:cacheprovider",
               str(REPO / "tests" / "test_kernels.py"), *s.kernel_test_args]
        t0 = time.perf_counter()
        try:  # time-boxed, so that the loss check keeps its share of the step's time
            p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=s.kernel_test_s)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += f"\ntimed out after {s.kernel_test_s} s"
            p = subprocess.CompletedProcess(cmd, 124, out, "")
        tail = (p.stdout + p.stderr).strip().splitlines()
        say("\n".join(tail[-15:]))
        r.data["kernel_tests"] = dict(rc=p.returncode, summary=tail[-1] if tail else "?",
                                      seconds=round(time.perf_counter() - t0, 1))
        if p.returncode != 0:
            r.fail(f"kernel tests: {r.data['kernel_tests']['summary']}")
    with r.part("loss check"):
        check_loss(s, r)


def _loss_inputs(n: int, w: torch.Tensor, kind: str):
    """Drafter and target states [n, h] near each other (kernels/bench_distill.py's inputs),
    in the dtype `kind` names, one row in 7 masked; w: the head [V, h]."""
    dev, h = w.device, w.shape[1]
    g = torch.Generator(device=dev).manual_seed(n)
    ht = torch.randn(n, h, generator=g, device=dev)
    hd = ht + 0.7 * torch.randn(n, h, generator=g, device=dev)
    states = torch.bfloat16 if kind == "bf16" else torch.float32
    pw = torch.ones(n, device=dev)
    pw[::7] = 0.0
    return hd.to(states), ht.to(states), pw


def check_loss(s: Shapes, r: Result) -> None:
    """Every implementation against the naive PyTorch reference: loss (relative) and gradient
    (relative to the reference's largest entry), time per forward + backward, peak memory."""
    from vllm_onlinespec.kernels import distill_loss
    from vllm_onlinespec.learner.timing import Timer

    dev = torch.device(s.device)
    if dev.type == "cuda" and "triton" in s.loss_impls:
        from vllm_onlinespec.kernels import distill_triton

        if distill_triton.INTERPRETED:
            raise RuntimeError("Triton is interpreted on a GPU run: unset TRITON_INTERPRET")

    def step(impl, hd0, ht, w, pw):
        hd = hd0.detach().clone().requires_grad_(True)
        loss = distill_loss(hd, ht, w, pw, impl=impl, alpha=0.8, temperature=1.0, mode="reverse_kl")
        loss.backward()
        return loss.detach(), hd.grad

    rows = r.data.setdefault("loss", [])
    for v in s.loss_vocabs:
        g = torch.Generator(device=dev).manual_seed(v)
        head = torch.randn(v, s.loss_h, generator=g, device=dev) * (2.0 / s.loss_h ** 0.5)
        for kind in s.loss_inputs:
            w = head if kind == "fp32" else head.to(torch.bfloat16)  # the target's bf16 head
            for n in s.loss_ns:
                hd, ht, pw = _loss_inputs(n, w, kind)
                ref = None
                for impl in s.loss_impls:
                    row = dict(v=v, n=n, h=s.loss_h, inputs=kind, impl=impl)
                    try:
                        _free()
                        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
                        if dev.type == "cuda":
                            torch.cuda.reset_peak_memory_stats()
                        loss, grad = step(impl, hd, ht, w, pw)  # also the compile / warm-up
                        if dev.type == "cuda":
                            row["peak_mib"] = _mib(torch.cuda.max_memory_allocated() - base)
                        times = []
                        for _ in range(s.loss_reps):
                            with Timer(dev) as t:
                                step(impl, hd, ht, w, pw)
                            times.append(t.ms)
                        row.update(ms=_median(times), loss=float(loss))
                        if ref is None:
                            ref = (loss.float(), grad.float())
                        else:
                            scale = float(ref[1].abs().max()) or 1.0
                            row["loss_rel_err"] = float((loss - ref[0]).abs() / ref[0].abs())
                            row["grad_err"] = float((grad.float() - ref[1]).abs().max()) / scale
                            # the kernel tests' bounds for a bf16 head (tf32 dots on a GPU)
                            ok = (row["loss_rel_err"] <= 5e-3 and torch.allclose(
                                grad.float(), ref[1], rtol=2e-2, atol=1e-2 * scale))
                            row["ok"] = bool(ok)
                            if not ok:
                                r.fail(f"loss V={v} N={n} {kind} {impl}: loss rel err "
                                       f"{row['loss_rel_err']:.2e}, grad err {row['grad_err']:.2e}")
                        if not torch.isfinite(loss):
                            r.fail(f"loss V={v} N={n} {kind} {impl}: non-finite")
                        del loss, grad
                    except torch.cuda.OutOfMemoryError:
                        row["oom"] = True
                    rows.append(row)
                    say(f"    {json.dumps(row)}")
                del hd, ht, pw, ref
                _free()
        del head, w


# ------------------------------------------------------------------------------ shared pieces

def _drafter(dcfg, dev: torch.device, name: str):
    """vLLM's drafter stand-in (random weights from a fixed seed, made on the device: a
    1 B-parameter init on the host is slow; in the checkpoint's dtype, as vLLM loads it) and the
    same weights as a checkpoint folder for build_learner (written once per run, in the scratch
    folder gpu_check.sh removes)."""
    from vllm_onlinespec.drafter import DFlashDrafter, save_drafter

    torch.manual_seed(0)
    with torch.device(dev):
        d = DFlashDrafter(dcfg)
    path = SCRATCH / name
    if not (path / "config.json").is_file():
        save_drafter(path, dcfg, d)
    return path, d.to(getattr(torch, dcfg.torch_dtype)).requires_grad_(False)


def _fake_batch(s: Shapes, cfg, dev: torch.device, gen: torch.Generator):
    """An update's batch at the serving defaults: `windows` requests' recent windows of
    `window_tokens` tokens of target features, `anchors` blocks each tiling their fresh end."""
    from vllm_onlinespec.learner.batches import BlockBatch

    B, T, K = s.windows, s.window_tokens, cfg.num_draft_tokens
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # what vLLM captures
    aux = torch.randn(B, T, cfg.fc_in_features, generator=gen).to(dt)
    fin = torch.randn(B, T, cfg.hidden_size, generator=gen).to(dt)
    ids = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
    first = T - 1 - s.anchors * K
    anchors = (first + K * torch.arange(s.anchors)).expand(B, -1).contiguous()
    return BlockBatch(ids, aux, fin, torch.full((B,), T, dtype=torch.long), anchors,
                      num_fresh=B * s.anchors * K)


def _publish_in_place(snapshot, params: dict, dev: torch.device):
    """The snapshot copied into vLLM's drafter's weights in place, on the serving thread's
    stream after Snapshot.wait_ready (what compat.load_draft_weights does through vLLM's
    load_weights). Returns a function giving the copy's milliseconds: on CUDA read from events
    later, so the serving thread does not wait for the copy here."""
    if dev.type == "cuda":
        snapshot.wait_ready()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, tensor in snapshot.items():
            if name.startswith("drafter."):
                params[name.removeprefix("drafter.")].copy_(tensor)
    if dev.type != "cuda":
        ms = (time.perf_counter() - t0) * 1e3
        return lambda: ms
    end.record()
    return lambda: (end.synchronize(), start.elapsed_time(end))[1]


def _learner_cfg(dtype: str, dev: torch.device, **over):
    from vllm_onlinespec.config import OnlineSpecConfig

    return OnlineSpecConfig.from_any({"learner_dtype": dtype, "learner_device": str(dev), **over})


# ------------------------------------------------------------------------------ B. memory

def step_memory(s: Shapes, r: Result) -> None:
    from vllm_onlinespec.drafter import DFlashConfig

    dev = torch.device(s.device)
    dcfg = DFlashConfig(**s.drafter)
    K = dcfg.num_draft_tokens
    cuda = dev.type == "cuda"
    init_free, total = torch.cuda.mem_get_info(dev) if cuda else (None, None)
    r.data["device_total_gib"] = round(total / GIB, 2) if cuda else None
    with r.part("target and vLLM's drafter"):
        V, H = dcfg.vocab_size, dcfg.hidden_size
        embed, head = (_randn(V, H, dev, torch.bfloat16, seed) for seed in (1, 2))
        rest = max(s.target_bytes - 2 * embed.nbytes, 0)
        filler = torch.empty(rest, dtype=torch.uint8, device=dev)
        path, served = _drafter(dcfg, dev, "drafter")
        params = dict(served.named_parameters())
        r.data["target_gib"] = round((2 * embed.nbytes + filler.nbytes) / GIB, 2)
        r.data["vllm_drafter_gib"] = round(sum(p.nbytes for p in params.values()) / GIB, 2)
    if r.part_failed:
        return
    rows = r.data.setdefault("learners", [])
    gen = torch.Generator().manual_seed(0)
    batches = [_fake_batch(s, dcfg, dev, gen) for _ in range(2)]
    for dtype in s.learner_dtypes:
        row: dict = {"learner_dtype": dtype}
        rows.append(row)
        with r.part(f"learner {dtype}"):
            memory_one(s, r, row, dtype, dev, path, embed, head, params, batches, K,
                       init_free, total)
        say(f"    {json.dumps(row)}")
        _free()


def memory_one(s, r, row, dtype, dev, path, embed, head, params, batches, K, init_free, total):
    from vllm_onlinespec.learner.factory import build_learner
    from vllm_onlinespec.learner.memory import check_fits

    cuda = dev.type == "cuda"
    alloc = (lambda: torch.cuda.memory_allocated(dev)) if cuda else (lambda: 0)
    _free()
    before = alloc()
    t0 = time.perf_counter()
    parts = build_learner(_learner_cfg(dtype, dev), path, embed, head, K,
                          train_length_head=False, device=dev)
    row["build_s"] = round(time.perf_counter() - t0, 1)
    learner, fp = parts.learner, parts.footprint
    _free()
    row.update(loss_impl=learner.loss_fn.impl,
               params_m=round(sum(p.numel() for p in learner.params) / 1e6, 1),
               stated_gib=dict(held=round(fp.steady / GIB, 2), built=round(fp.built / GIB, 2),
                               later=round(fp.later / GIB, 2), peak=round(fp.peak / GIB, 2)),
               built_measured_gib=round((alloc() - before) / GIB, 2) if cuda else None)
    try:
        check_fits(fp, dev, s.utilization)
        row["check_fits"] = "fits"
    except MemoryError as e:  # reported; the updates still run: was the refusal right?
        row["check_fits"] = str(e)
    kv = None
    if cuda:
        # vLLM's arithmetic (gpu_worker.determine_available_memory): its share of the device
        # less what was consumed since start-up (the target, its drafter, the learner's build).
        free_now, _ = torch.cuda.mem_get_info(dev)
        kv_bytes = int(s.utilization * total) - (init_free - free_now)
        row["kv_cache_gib"] = round(kv_bytes / GIB, 2)
        if kv_bytes <= 0:
            r.fail(f"learner {dtype}: no room left for a KV cache ({kv_bytes / GIB:.2f} GiB)")
        kv = torch.empty(max(kv_bytes, 0), dtype=torch.uint8, device=dev)
        torch.cuda.reset_peak_memory_stats(dev)
    ups, snaps, pubs, min_free = [], [], [], None
    try:
        for i in range(s.updates):
            status = learner.sync_step(batches[i % len(batches)])
            if status != "updated":
                raise RuntimeError(f"update {i}: {status}: {learner.last_error}")
            ups.append(learner.update_ms)
            snaps.append(learner.snapshot_ms)
            pubs.append(_publish_in_place(learner.latest()[1], params, dev)())
            if cuda:
                f, _ = torch.cuda.mem_get_info(dev)
                min_free = f if min_free is None else min(min_free, f)
    except Exception as e:  # noqa: BLE001 - reported with the figures so far
        row["stopped_at_update"] = len(ups)
        r.fail(f"learner {dtype}: update {len(ups)} beside the KV cache failed: "
               f"{type(e).__name__}: {_line(e)}")
    served = [(params[n.removeprefix("drafter.")], p) for n, p in zip(learner.names, learner.params)
              if n.startswith("drafter.")]
    same = all(torch.equal(mine, p.to(mine.dtype)) for mine, p in served)
    if ups and not same:
        r.fail(f"learner {dtype}: vLLM's drafter does not hold the learner's last weights")
    if row["check_fits"] != "fits" and len(ups) == s.updates:
        r.fail(f"learner {dtype}: check_fits refused it, but its updates ran beside the KV cache")
    elif row["check_fits"] == "fits" and len(ups) < s.updates:
        r.fail(f"learner {dtype}: check_fits let it start, but its updates did not fit")
    row.update(updates=len(ups), update_ms=_median(ups[1:] or ups),
               snapshot_ms=_median(snaps[1:] or snaps), publish_ms=_median(pubs[1:] or pubs),
               last_loss=round(learner.last_loss, 4),
               published_equal=same)
    if cuda:
        row.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated(dev) / GIB, 2),
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved(dev) / GIB, 2),
                   min_free_gib=round(min_free / GIB, 2) if min_free is not None else None,
                   headroom_gib=round((min_free or 0) / GIB, 2))
    del parts, learner, kv


# ------------------------------------------------------------------------------ C. concurrency

class Replay:
    """fn(*static inputs) captured in a CUDA graph (one shared pool, as vLLM's graphs share
    one); off CUDA, or where capture fails (reported), an eager call."""

    def __init__(self, fn, args: tuple, pool=None, name: str = "") -> None:
        self.fn, self.args, self.graph, self.error = fn, args, None, None
        self.out = None
        if not args[0].is_cuda:
            return
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(2):  # lazy initialisations off the capture
                    fn(*args)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(g, pool=pool):
                self.out = fn(*args)
            self.graph = g
        except Exception as e:  # noqa: BLE001 - measured eagerly, and said so
            self.error = f"{name} capture failed: {type(e).__name__}: {_line(e)}"
            say(f"    {self.error}")
            torch.cuda.synchronize()

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
            return self.out
        with torch.no_grad():
            return self.fn(*self.args)


class TargetStandIn(torch.nn.Module):
    """Qwen3-8B's step at serving size: the embedding, `layers` MLP blocks of the target's width
    (what a decode step reads, most of its time), the residual stream after each of the
    drafter's target layers (vLLM's aux hidden states) and the normed final state."""

    def __init__(self, embed: torch.Tensor, layers: int, inter: int, aux_layers: list[int]) -> None:
        super().__init__()
        H = embed.shape[1]
        self.embed = embed
        self.aux_layers = set(aux_layers)
        dev, dt = embed.device, embed.dtype
        self.w = [(_randn(H, inter, dev, dt, 3 * i, 0.5 / H ** 0.5),
                   _randn(H, inter, dev, dt, 3 * i + 1, 0.5 / H ** 0.5),
                   _randn(inter, H, dev, dt, 3 * i + 2, 0.5 / inter ** 0.5)) for i in range(layers)]

    @staticmethod
    def rms(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def forward(self, ids: torch.Tensor):
        x = self.embed[ids]
        aux = []
        for i, (wg, wu, wd) in enumerate(self.w):
            x = self.rms(x + (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd)
            if i in self.aux_layers:
                aux.append(x)
        return self.rms(x), aux


class DraftStep(torch.nn.Module):
    """vLLM's drafter's forward for a running batch: the DFlash twin's `draft_hidden`."""

    def __init__(self, drafter, embed: torch.Tensor) -> None:
        super().__init__()
        self.d, self.embed = drafter, embed

    def forward(self, ctx, ctx_pos, ctx_mask, first, first_pos):
        return self.d.draft_hidden(ctx, ctx_pos, ctx_mask, first, first_pos, self.embed)


class ServingLoop:
    """vLLM's step order on a GPU runner: target forward; the step's features copied before
    the drafter runs (compat.own_features); drafter forward; the sampled tokens read on the
    host; then this project's after-step: feedback (the real FeedbackStage) and publish."""

    def __init__(self, s: Shapes, dev, dcfg, target, drafter, embed, learner, buffer) -> None:
        from vllm_onlinespec.policy.cutter import DraftCutter
        from vllm_onlinespec.serving import compat
        from vllm_onlinespec.serving.feedback import FeedbackStage
        from vllm_onlinespec.serving.guard import HookGuard

        compat.is_cpu = lambda: dev.type == "cpu"  # vLLM's platform, absent on the device image
        self.s, self.dev, self.K, self.B = s, dev, dcfg.num_draft_tokens, s.requests
        self.learner = learner
        self.guard = HookGuard()
        cfg = learner.cfg
        self.stage = FeedbackStage(DraftCutter(cfg.length_head, self.K), None, None, None,
                                   learner, buffer, self.guard)
        n = self.B * (self.K + 1)
        gen = self.gen = torch.Generator().manual_seed(3)
        # vLLM's input ids: its host buffer (compat.step_view reads that side), and the device
        # copy the target reads; positions live on the device only (vLLM 0.32).
        self.ids_host = torch.randint(1, dcfg.vocab_size, (n,), generator=gen, dtype=torch.int32)
        self.ids = self.ids_host.to(dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = [0] * self.B  # each request's next position
        pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.target = Replay(target, (self.ids,), pool, "target")
        T = s.ctx_tokens
        dt = drafter.dtype
        self.draft_args = (torch.randn(self.B, T, dcfg.fc_in_features, generator=gen).to(dev, dt),
                           torch.arange(T, device=dev).expand(self.B, T).contiguous(),
                           torch.ones(self.B, T, dtype=torch.bool, device=dev),
                           torch.randint(1, dcfg.vocab_size, (self.B,), generator=gen).to(dev),
                           torch.full((self.B,), T, dtype=torch.long, device=dev))
        self.draft_mod = DraftStep(drafter, embed)
        self.drafter = Replay(self.draft_mod, self.draft_args, pool, "drafter")
        self.params = dict(drafter.named_parameters())
        self.version, self.served = learner.latest()  # version 0: the checkpoint's weights
        self.pending = None  # (version, snapshot, the one before) whose next replay is checked
        self.checks: list[dict] = []
        self.publishes: list = []  # each publish's copy time, read at the end
        self.steps = 0  # the first is the requests' prefill: no drafts verified

    def step(self) -> float:
        """One engine step; its milliseconds on the serving thread (the checks' excluded)."""
        from vllm_onlinespec.serving import compat

        t0 = time.perf_counter()
        K, B, prefill = self.K, self.B, self.steps == 0
        rows = torch.tensor([p + j for p in self.pos for j in range(K + 1)])
        pinned = rows.pin_memory() if self.dev.type == "cuda" else rows
        self.positions.copy_(pinned, non_blocking=True)
        hidden, aux = self.target()
        view = compat.own_features(compat.StepView(
            req_ids=[f"r{i}" for i in range(B)], num_scheduled=[K + 1] * B,
            input_ids=self.ids_host, positions=self.positions, hidden_states=hidden,
            aux_hidden_states=aux, num_draft_tokens=None if prefill else [K] * B,
            finished_req_ids=set()))
        out = self.drafter()
        accepted = torch.randint(0, K + 1, (B,), generator=self.gen).tolist()
        sampled = [[1] * (a + 1) + [-1] * (K - a) for a in accepted]
        float(out.reshape(-1)[0])  # vLLM reads the sampled and drafted tokens on the host
        spent = self._check(out)
        self.stage.observe(view, sampled, self.version)
        for i, a in enumerate(accepted):
            self.pos[i] += K + 1 if prefill else a + 1
        latest = self.learner.latest()
        if latest[0] > self.version:
            self.publishes.append(_publish_in_place(latest[1], self.params, self.dev))
            self.pending = (latest[0], latest[1], self.served)
            self.version, self.served = latest
        self.steps += 1
        return (time.perf_counter() - t0) * 1e3 - spent

    def _check(self, out: torch.Tensor) -> float:
        """The first replay after a publish against an eager forward of that snapshot (and of the
        one before, to show the weights did change); milliseconds spent (not the step's)."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        version, snap, before = self.pending
        self.pending = None

        def eager(sn):
            named = {"d." + n.removeprefix("drafter."): t for n, t in sn.items()
                     if n.startswith("drafter.")}
            with torch.no_grad():
                return torch.func.functional_call(self.draft_mod, named, self.draft_args).float()

        got, want = out.float(), eager(snap)
        scale = float(want.abs().max()) or 1.0
        self.checks.append(dict(version=version, err=float((got - want).abs().max()) / scale,
                                err_vs_previous=float((got - eager(before)).abs().max()) / scale))
        return (time.perf_counter() - t0) * 1e3


def step_concurrency(s: Shapes, r: Result) -> None:
    from vllm_onlinespec.drafter import DFlashConfig
    from vllm_onlinespec.learner.factory import build_learner

    dev = torch.device(s.device)
    dcfg = DFlashConfig(**s.drafter)
    K = dcfg.num_draft_tokens
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    with r.part("set-up"):
        path, drafter = _drafter(dcfg, dev, "drafter")
        embed = _randn(dcfg.vocab_size, dcfg.hidden_size, dev, drafter.dtype, 1)
        target = TargetStandIn(embed, s.target_layers, s.target_inter, dcfg.target_layer_ids)
        # The learner at full pace (share 1, no gain pacing): the most it can take from serving.
        cfg = _learner_cfg(dtype, dev, update={"lr": 1e-3},
                           pacing={"share_control": "fixed", "learner_cpu_share": 1.0})
        parts = build_learner(cfg, path, embed, embed, K, train_length_head=False, device=dev)
        loop = ServingLoop(s, dev, dcfg, target, drafter, embed, parts.learner, parts.buffer)
        r.data["graphs"] = {name: g.error or ("captured" if g.graph else "eager")
                            for name, g in (("target", loop.target), ("drafter", loop.drafter))}
        r.data.update(learner_dtype=dtype, requests=s.requests, K=K,
                      loss_impl=parts.learner.loss_fn.impl)
    if r.part_failed:
        return
    learner = parts.learner
    with r.part("serving loop"):
        def run(seconds: float) -> list[float]:
            times, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end:
                times.append(loop.step())
            return times

        for _ in range(3):
            loop.step()  # warm-up: first step is the requests' prefill
        off = run(s.off_s)
        u0, t0 = learner.updates, time.perf_counter()
        learner.start()
        try:
            on = run(s.on_s)
        finally:
            stopped = learner.stop(timeout=10)
        dt = time.perf_counter() - t0
        for _ in range(2):
            loop.step()  # the last publish's check
        errs = [c["err"] for c in loop.checks]
        r.data.update(
            steps_off=len(off), steps_on=len(on), step_ms_off=_median(off), step_ms_on=_median(on),
            step_ms_on_p90=round(sorted(on)[int(0.9 * (len(on) - 1))], 3) if on else None,
            updates=learner.updates - u0, updates_per_s=round((learner.updates - u0) / dt, 2),
            update_ms=round(learner.update_ms_ema, 1) if learner.updates else None,
            publishes=len(loop.publishes), publish_ms=_median([ms() for ms in loop.publishes]),
            checked=len(loop.checks), check_max_err=max(errs) if errs else None,
            exact=sum(e == 0 for e in errs),
            changed=sum((c["err_vs_previous"] or 0) > 0 for c in loop.checks),
            learner_errors=learner.errors, learner_last_error=learner.last_error,
            learner_stopped=stopped, hook_errors=dict(loop.guard.errors),
            buffer=parts.buffer.stats())
        say(f"    {json.dumps({k: v for k, v in r.data.items() if k != 'part_seconds'})}")
        if not loop.publishes:
            r.fail("no publish while serving: the learner never updated")
        if errs and max(errs) > 1e-2:
            r.fail(f"a replay after a publish differs from the snapshot's eager forward "
                   f"(max relative error {max(errs):.2e})")
        if learner.errors or loop.guard.errors:
            r.fail(f"errors: learner {learner.errors} ({learner.last_error}), hooks "
                   f"{dict(loop.guard.errors)}")


# ------------------------------------------------------------------------------ D. graphs

def step_graphs(s: Shapes, r: Result) -> None:
    if s.device != "cuda":
        r.data["skipped"] = "CUDA graphs need a CUDA device"
        say("[D] skipped (needs CUDA)")
        return
    with r.part("graph pool"):
        graph_pool(s, r)
    with r.part("capture while the learner updates"):  # last: a failed capture may leave
        capture_beside_learner(s, r)  # the allocator's capture state behind


def capture_beside_learner(s: Shapes, r: Result) -> None:
    """The learner updating on its own thread and stream (its updates read losses and norms on
    the host), while the main thread captures a graph the way vLLM does (torch.cuda.graph,
    default capture_error_mode 'global'), then with 'thread_local'. Does capture fail, does the
    learner fail, does the replay compute the right thing, is the context usable after?"""
    from vllm_onlinespec.drafter import DFlashConfig
    from vllm_onlinespec.learner.factory import build_learner

    dev = torch.device("cuda")
    dcfg = DFlashConfig(**s.small_drafter)
    path, _ = _drafter(dcfg, dev, "small_drafter")
    embed = _randn(dcfg.vocab_size, dcfg.hidden_size, dev, torch.bfloat16, 1)
    parts = build_learner(_learner_cfg("bfloat16", dev), path, embed, embed, dcfg.num_draft_tokens,
                          train_length_head=False, device=dev)
    learner = parts.learner
    batch = _fake_batch(s, dcfg, dev, torch.Generator().manual_seed(0))
    stop = threading.Event()

    def updates():
        while not stop.is_set():
            learner.sync_step(batch)

    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) / 32 for _ in range(4)]

    def f():
        y = x
        for _ in range(100):  # a capture long enough to overlap the learner's host syncs
            for w in ws:
                y = torch.tanh(y @ w)
        return y

    want = f()
    torch.cuda.synchronize()
    thread = threading.Thread(target=updates, daemon=True)
    thread.start()
    time.sleep(1.0)
    attempts = []
    for mode in ("global", "thread_local"):
        for _ in range(3):
            e0 = learner.errors
            a = {"mode": mode}
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode=mode):
                    y = f()
                graph.replay()
                torch.cuda.synchronize()
                a["captured"] = True
                a["replay_right"] = bool(torch.allclose(y.float(), want.float(), atol=1e-2))
            except Exception as e:  # noqa: BLE001 - the finding
                a["captured"] = False
                a["error"] = f"{type(e).__name__}: {_line(e)}"
                try:
                    torch.cuda.synchronize()
                except Exception as e2:  # noqa: BLE001
                    a["sync_after"] = f"{type(e2).__name__}: {_line(e2)}"
            time.sleep(0.2)
            a["learner_errors_during"] = learner.errors - e0
            attempts.append(a)
            say(f"    {json.dumps(a)}")
    stop.set()
    thread.join(60)
    try:
        usable = float(torch.ones(4, device=dev).sum()) == 4.0
    except Exception as e:  # noqa: BLE001
        usable = f"{type(e).__name__}: {e}"
    r.data["capture_beside_learner"] = dict(
        attempts=attempts, learner_updates=learner.updates, learner_errors=learner.errors,
        learner_last_error=learner.last_error, context_usable_after=usable)
    if usable is not True:
        r.fail(f"the CUDA context is unusable after capturing beside the learner: {usable}")


class _Alias:
    """A tensor's memory without its ownership, as vLLM's `weak_ref_tensor` keeps a graph's
    outputs: the caching allocator may hand that memory to the next graph captured in the pool."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def graph_pool(s: Shapes, r: Result) -> None:
    """(a) Two graphs in one memory pool, the first's output kept only as a non-owning alias
    (vLLM's target model and its drafter): does replaying the second overwrite the first's
    output, and does a copy taken between the two replays (what serving/feedback does before
    the drafter runs) keep the right values? (b) Weights copied in place into a captured graph's
    parameters (the publish path): does the next replay compute with the new weights?"""
    dev = torch.device("cuda")
    n, h = 64, s.drafter["hidden_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, device=dev, generator=g)
    w1, w2 = (torch.randn(h, h, device=dev, generator=g) / h**0.5 for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
        for _ in range(2):
            (x @ w1).tanh_()
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool):
        y1 = (x @ w1).tanh_()
    out1 = torch.as_tensor(_Alias(y1), device=dev)  # what the runner's step view holds
    y1_ptr = y1.data_ptr()
    del y1
    with torch.cuda.graph(g2, pool=pool):  # the drafter: its own output and intermediates
        t = (x @ w2).relu_()
        y2 = t * 3.0 + 1.0
    want = (x @ w1).tanh_()
    g1.replay()
    copied = out1.clone()  # the feedback copy, before the drafter's replay
    g2.replay()
    torch.cuda.synchronize()
    res = {"n": n, "hidden": h, "shares_memory": y1_ptr in (t.data_ptr(), y2.data_ptr()),
           "output_overwritten_by_second_replay": not torch.equal(out1, want),
           "copy_before_second_replay_ok": torch.allclose(copied, want, atol=1e-5, rtol=1e-5)}
    w_new = torch.randn(h, h, device=dev, generator=g) / h**0.5
    pub = torch.cuda.Stream()
    with torch.cuda.stream(pub):
        w2.copy_(w_new)
    torch.cuda.current_stream().wait_stream(pub)  # vLLM's step waits on the publish event
    g2.replay()
    torch.cuda.synchronize()
    res["replay_sees_published_weights"] = torch.allclose(y2, (x @ w_new).relu_() * 3.0 + 1.0,
                                                          atol=1e-4, rtol=1e-4)
    r.data["graph_pool"] = res
    say(f"    {json.dumps(res)}")
    if not res["copy_before_second_replay_ok"]:
        r.fail("graph pool: the feature copy taken between the replays is wrong")
    if not res["replay_sees_published_weights"]:
        r.fail("graph pool: a replay after publish does not compute with the new weights")


# ------------------------------------------------------------------------------ report

def device_name(s: Shapes) -> str:
    if s.device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def run_step(key: str, s: Shapes, out: Path) -> int:
    r = Result(key, s)
    t0 = time.perf_counter()
    say(f"gpu_check [{key}] {STEPS[key]} on {device_name(s)}")
    try:
        {"A": step_kernels, "B": step_memory, "C": step_concurrency, "D": step_graphs}[key](s, r)
    except Exception as e:  # noqa: BLE001 - whatever escaped a part is this step's failure
        traceback.print_exc()
        r.fail(f"{type(e).__name__}: {e}")
    doc = dict(step=key, name=STEPS[key], seconds=round(time.perf_counter() - t0, 1),
               failures=r.failures, **r.data)
    (out / "steps").mkdir(parents=True, exist_ok=True)
    (out / "steps" / f"{key}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    say(f"gpu_check [{key}] {'ok' if not r.failures else 'FAILED'} in {doc['seconds']} s")
    return 1 if r.failures else 0


def report(s: Shapes, out: Path, smoke: bool, steps: str) -> int:
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    rep = dict(device=device_name(s), torch=torch.__version__, triton=tv,
               python=platform.python_version(), smoke=smoke,
               command="lab/gpu_check.sh" + (" --smoke" if smoke else ""), steps={}, failures=[])
    for key in steps:
        f = out / "steps" / f"{key}.json"
        if f.is_file():
            doc = json.loads(f.read_text())
        else:
            doc = dict(step=key, name=STEPS[key], failures=[
                "no result: the step was killed (time limit) or crashed; see gpu_check.log"])
        rep["steps"][key] = doc
        rep["failures"] += [f"{key} {STEPS[key]}: {x}" for x in doc["failures"]]
    (out / "gpu_check.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(render(rep))
    say(f"gpu_check: wrote {out}/gpu_check.json and gpu_check.md")
    if rep["failures"]:
        say("gpu_check: FAILED:\n  " + "\n  ".join(rep["failures"]))
        return 1
    say("gpu_check: all steps passed")
    return 0


def _c(x, prec=2) -> str:
    if x is None:
        return "-"
    return f"{x:.{prec}f}" if isinstance(x, float) else str(x)


def render(rep: dict) -> str:
    st = rep["steps"]
    L = [f"# GPU checks ({rep['device']})", "",
         f"`{rep['command']}`; torch {rep['torch']}, triton {rep['triton']}, Python "
         f"{rep['python']}." + (" **Smoke run (CPU, tiny shapes): not a measurement.**"
                               if rep["smoke"] else ""), ""]
    L += ["| step | seconds | result |", "|---|---|---|"]
    for k, d in st.items():
        L.append(f"| {k} {d['name']} | {_c(d.get('seconds'), 1)} | "
                 f"{'ok' if not d['failures'] else 'FAILED: ' + '; '.join(d['failures'])} |")
    a = st.get("A", {})
    if a:
        kt = a.get("kernel_tests", {})
        L += ["", "## A. Kernels", "", f"`tests/test_kernels.py` on the device: "
              f"{kt.get('summary')} (rc {kt.get('rc')}, {kt.get('seconds')} s).", "",
              "Fused loss vs the naive PyTorch reference (forward + backward; grad error relative "
              "to the reference's largest entry):", "",
              "| V | N | inputs | impl | ms | peak MiB | loss | loss rel err | grad err | ok |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for x in a.get("loss", []):
            L.append(f"| {x['v']} | {x['n']} | {x['inputs']} | {x['impl']} | {_c(x.get('ms'))} | "
                     f"{_c(x.get('peak_mib'), 0)} | {_c(x.get('loss'), 5)} | "
                     f"{_e(x.get('loss_rel_err'))} | {_e(x.get('grad_err'))} | "
                     f"{'OOM' if x.get('oom') else x.get('ok', 'ref')} |")
    b = st.get("B", {})
    if b.get("learners"):
        L += ["", "## B. Start-up memory at real sizes", "",
              f"Device {b.get('device_total_gib')} GiB; target stand-in {b.get('target_gib')} GiB, "
              f"vLLM's drafter {b.get('vllm_drafter_gib')} GiB; KV-cache stand-in = "
              f"gpu_memory_utilization 0.9 x total - consumed since start-up.", "",
              "| learner | params (M) | loss | stated held / built / later (GiB) | built, measured "
              "(GiB) | check_fits | KV cache (GiB) | updates | update ms | snapshot ms | publish "
              "ms | peak alloc / reserved (GiB) | headroom (GiB) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in b["learners"]:
            sg = x.get("stated_gib", {})
            L.append(f"| {x['learner_dtype']} | {x.get('params_m', '-')} | "
                     f"{x.get('loss_impl', '-')} | "
                     f"{sg.get('held', '-')} / {sg.get('built', '-')} / {sg.get('later', '-')} | "
                     f"{_c(x.get('built_measured_gib'))} | {x.get('check_fits', '-')} | "
                     f"{_c(x.get('kv_cache_gib'))} | {x.get('updates', '-')}"
                     f"{' (stopped)' if 'stopped_at_update' in x else ''} | "
                     f"{_c(x.get('update_ms'), 1)} | "
                     f"{_c(x.get('snapshot_ms'))} | {_c(x.get('publish_ms'))} | "
                     f"{_c(x.get('peak_allocated_gib'))} / {_c(x.get('peak_reserved_gib'))} | "
                     f"{_c(x.get('headroom_gib'))} |")
    c = st.get("C", {})
    if "step_ms_off" in c:
        L += ["", "## C. Serving beside the learner thread", "",
              f"{c.get('requests')} requests, K = {c.get('K')}, learner {c.get('learner_dtype')} "
              f"at full pace; graphs: {c.get('graphs')}.", "",
              "| step ms, learner off | on (median / p90) | updates/s | update ms | publishes | "
              "publish ms | replays checked (exact) | max rel err | weights changed |",
              "|---|---|---|---|---|---|---|---|---|",
              f"| {_c(c.get('step_ms_off'))} | {_c(c.get('step_ms_on'))} / "
              f"{_c(c.get('step_ms_on_p90'))} | {_c(c.get('updates_per_s'))} | "
              f"{_c(c.get('update_ms'), 1)} | {c.get('publishes')} | {_c(c.get('publish_ms'))} | "
              f"{c.get('checked')} ({c.get('exact')}) | {_e(c.get('check_max_err'))} | "
              f"{c.get('changed')} |"]
    d = st.get("D", {})
    if d.get("capture_beside_learner") or d.get("graph_pool"):
        cb = d.get("capture_beside_learner", {})
        L += ["", "## D. CUDA graphs", "", "Captured while the learner updates on its thread:", ""]
        L += [f"- {json.dumps(x)}" for x in cb.get("attempts", [])]
        L += [f"- learner: {cb.get('learner_updates')} updates, {cb.get('learner_errors')} errors "
              f"({cb.get('learner_last_error')}); context usable after: "
              f"{cb.get('context_usable_after')}", "", "Two graphs in one pool:", ""]
        L += [f"- {k}: {v}" for k, v in d.get("graph_pool", {}).items()]
    elif d.get("skipped"):
        L += ["", "## D. CUDA graphs", "", f"Skipped: {d['skipped']}."]
    if rep["failures"]:
        L += ["", "## Failures", ""] + [f"- {f}" for f in rep["failures"]]
    return "\n".join(L) + "\n"


def _e(x) -> str:
    return "-" if x is None else f"{x:.2e}"


SCRATCH = Path("scratch")  # <out>/scratch (main): checkpoints; gpu_check.sh removes it


def main(argv=None) -> int:
    global SCRATCH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the unit test)")
    ap.add_argument("--out", required=True, help="results folder ($OUT on the device)")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--step", choices=list(STEPS), help="run one step -> OUT/steps/STEP.json")
    g.add_argument("--report", action="store_true", help="merge OUT/steps -> OUT/gpu_check.*")
    ap.add_argument("--steps", default="ABCD", help="with --report: the steps that were run")
    a = ap.parse_args(argv)
    s = SMOKE if a.smoke else FULL
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    SCRATCH = out / "scratch"
    if a.report:
        return report(s, out, a.smoke, a.steps)
    if s.device == "cuda" and not torch.cuda.is_available():
        say("gpu_check: FAILED: no CUDA device (use --smoke on a CPU machine)")
        return 2
    if s.device == "cuda" and os.environ.get("TRITON_INTERPRET"):
        say("gpu_check: TRITON_INTERPRET is set: Triton would interpret, not compile; refused")
        return 2
    return run_step(a.step, s, out)


if __name__ == "__main__":
    sys.exit(main())
