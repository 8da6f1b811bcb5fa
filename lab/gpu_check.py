"""The GPU checks of /work/shared/gpu/README.md, without vLLM.

    PYTHONPATH=. python lab/gpu_check.py            # on the GPU machine (lab/gpu_check.sh)
    PYTHONPATH=. python lab/gpu_check.py --smoke    # tiny shapes on the CPU (tests/test_gpu_check.py)

1. kernels: tests/test_kernels.py on the real GPU (TRITON_INTERPRET unset, so Triton compiles
   for the device; the tests pick CUDA when it is available).
2. loss: fused Triton loss vs the PyTorch reference (and the chunked one) for a Qwen3-8B-shaped
   drafter (h 4096, V 151936, blocks of 16): time per forward+backward, peak memory.
3. learner: online updates of a Qwen3-8B-shaped DFlash drafter (5 layers, random weights)
   built by build_learner on the GPU, bf16 and float32 learners, on 128 sequences of 512 tokens
   of fake features (4 blocks per sequence), beside a stand-in KV cache: after the learner is
   built (its state reserved, as serving builds it before vLLM profiles memory), a dummy
   allocation takes 90 % of the device less what is allocated, as vLLM's KV cache would, and
   the updates run in what is left (a learner `check_fits` refuses is reported as refused).
   Time per update and per snapshot (CUDA events), publish time (the device-to-device copy of
   the snapshot into a second drafter standing in for vLLM's, on another stream after
   Snapshot.wait_ready), peak memory, the footprint the learner stated.
4. feedback copy: one step's committed rows (aux features of 5 target layers, final hidden
   states, ids) copied out of the runner's buffers by serving/feedback.records_from_step,
   synchronously (pageable) and asynchronously (pinned, handed on by FeedbackPipe a step later):
   the host time each call holds the serving thread, and the async records equal the sync ones.
5. graphs (CUDA only): two graphs captured in one memory pool, the first's output kept as a
   non-owning alias (as vLLM keeps its outputs): does the second's replay overwrite it, and is a
   copy taken between the replays right; and weights copied in place into a captured graph's
   parameters on another stream: does the next replay use them.

Writes <out>/gpu.json and <out>/gpu.md (default docs/results; with --smoke a temporary
folder). Any failed check makes the exit
status non-zero, after the other checks ran. What the device image lacks (vLLM, pydantic) is
blocked on import for the whole run, here too: the smoke run imports what the device run can.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# What the device image lacks (/work/.library/device/KINDS.md: Python 3.12, torch, Triton,
# transformers, safetensors; no vLLM, no pydantic): refused here on every machine, so the CPU
# smoke run imports what the device run can (config.py falls back to _pydantic_lite.py).
ABSENT_ON_DEVICE = ("vllm", "pydantic", "pydantic_core", "annotated_types")
# What the checks import (step [0] of gpu_check.sh imports each one first).
CHECKED_MODULES = ("vllm_onlinespec.kernels", "vllm_onlinespec.config", "vllm_onlinespec.learner",
                   "vllm_onlinespec.learner.factory", "vllm_onlinespec.learner.batches",
                   "vllm_onlinespec.learner.timing", "vllm_onlinespec.training.blocks",
                   "vllm_onlinespec.drafter", "vllm_onlinespec.serving.feedback")


class _NoVllm:
    """A meta-path finder that refuses what the device image lacks: the core must run there."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT_ON_DEVICE:
            raise ImportError(f"gpu_check: {name} imported, but the device image has no "
                              f"{name.split('.')[0]}")
        return None


def block_vllm() -> None:
    if not any(isinstance(f, _NoVllm) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoVllm())


def check_imports() -> int:
    """Step [0]: import every module the checks use with the device image's gaps refused. On
    failure: which module, the exception, and the import chain inside this repository."""
    import importlib

    failed = 0
    for mod in CHECKED_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - reported with its chain
            failed += 1
            chain = [f"{Path(f.filename).resolve().relative_to(REPO)}:{f.lineno}"
                     for f in traceback.extract_tb(e.__traceback__)
                     if Path(f.filename).resolve().is_relative_to(REPO)]
            say(f"gpu_check: [0] cannot import {mod}: {type(e).__name__}: {e}"
                + (f" (via {' -> '.join(chain)})" if chain else ""))
    if failed:
        say(f"gpu_check: [0] {failed} of {len(CHECKED_MODULES)} modules do not import without "
            f"{', '.join(ABSENT_ON_DEVICE)} (absent on the device image)")
        return 3
    say(f"[0] imports without {', '.join(ABSENT_ON_DEVICE)}: ok")
    return 0


block_vllm()
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


@dataclass
class Shapes:
    """What each check runs on (full = the README's Qwen3-8B shapes; smoke = tiny, CPU)."""

    device: str
    loss_h: int
    loss_v: int
    loss_ns: list[int]
    loss_impls: list[str]
    loss_dtype: str
    loss_reps: int
    drafter: dict
    seqs: int
    seq_len: int
    anchors: int
    learner_dtypes: list[str]
    updates: int
    kernel_test_args: list[str]
    utilization: float = 0.9  # the share of the device vLLM's KV cache is sized to (its default)


FULL = Shapes(
    device="cuda", loss_h=4096, loss_v=151936, loss_ns=[512, 1024, 2048, 4096, 8192],
    loss_impls=["naive", "triton", "chunked"], loss_dtype="bfloat16", loss_reps=3,
    drafter=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669, block_size=16,
                 rope_theta=1_000_000.0, torch_dtype="bfloat16"),
    seqs=128, seq_len=512, anchors=4, learner_dtypes=["bfloat16", "float32"], updates=3,
    kernel_test_args=[])
SMOKE = Shapes(
    device="cpu", loss_h=64, loss_v=1000, loss_ns=[64, 128], loss_impls=["naive", "chunked"],
    loss_dtype="float32", loss_reps=1,
    drafter=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                 target_layer_ids=[0, 1], mask_token_id=0, block_size=5, rope_theta=10000.0,
                 torch_dtype="float32"),
    seqs=4, seq_len=64, anchors=2, learner_dtypes=["float32"], updates=2,
    kernel_test_args=["-k", "argument_errors"])


@dataclass
class Report:
    device: str
    torch: str
    triton: str | None
    python: str
    smoke: bool
    kernel_tests: dict = field(default_factory=dict)
    loss: list[dict] = field(default_factory=list)
    learner: list[dict] = field(default_factory=list)
    feedback: list[dict] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def say(*a) -> None:
    print(*a, flush=True)


# ------------------------------------------------------------------------------ 1. kernel tests

def check_kernel_tests(s: Shapes, rep: Report) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if s.device == "cuda":
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not vllm", "-p", "no:cacheprovider",
           str(REPO / "tests" / "test_kernels.py"), *s.kernel_test_args]
    say(f"[1] kernel tests: {' '.join(cmd[2:])} (TRITON_INTERPRET unset, "
        f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')})")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()
    summary = tail[-1] if tail else "?"
    rep.kernel_tests = dict(rc=r.returncode, summary=summary, seconds=round(time.perf_counter() - t0, 1))
    say("\n".join(tail[-15:]))
    if r.returncode != 0:
        rep.failures.append(f"kernel tests: {summary}")


# ------------------------------------------------------------------------------ 2. loss

def check_loss(s: Shapes, rep: Report) -> None:
    from vllm_onlinespec.learner.timing import Timer

    bench = _bench_module()
    dev = torch.device(s.device)
    if dev.type == "cuda" and "triton" in s.loss_impls:
        from vllm_onlinespec.kernels import distill_triton

        if distill_triton.INTERPRETED:
            raise RuntimeError("Triton kernels are interpreted on a GPU run: unset TRITON_INTERPRET")
    dtype = bench.DTYPES[s.loss_dtype]
    say(f"[2] loss: h={s.loss_h} V={s.loss_v} dtype={s.loss_dtype} device={dev}; time = median "
        f"of {s.loss_reps} fwd+bwd after a warm-up; peak = max allocated minus inputs")
    say(f"{'N':>6} {'impl':>8} {'ms':>9} {'peak MiB':>9} {'loss':>10} {'max|dgrad-ref|':>15}")
    for n in s.loss_ns:
        hd, ht, w, pw = bench.make_inputs(n, s.loss_h, s.loss_v, dtype, dev)
        ref = None
        for impl in s.loss_impls:
            row = dict(n=n, h=s.loss_h, v=s.loss_v, dtype=s.loss_dtype, impl=impl)
            try:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                loss, grad = bench.step(impl, hd, ht, w, pw)  # also the warm-up / compile
                peak = None
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                times = []
                for _ in range(s.loss_reps):
                    with Timer(dev) as t:
                        bench.step(impl, hd, ht, w, pw)
                    times.append(t.ms)
                diff = None
                if ref is None:
                    ref = grad.float()
                else:
                    diff = float((grad.float() - ref).abs().max())
                row.update(ms=statistics.median(times), peak_mib=peak, loss=float(loss),
                           max_grad_diff_vs_first=diff)
                if not torch.isfinite(loss):
                    rep.failures.append(f"loss N={n} {impl}: non-finite loss")
                del loss, grad
            except torch.cuda.OutOfMemoryError:
                row.update(ms=None, peak_mib=None, oom=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rep.loss.append(row)
            say(f"{n:>6} {impl:>8} {_f(row.get('ms'), 9, 2)} {_f(row.get('peak_mib'), 9, 0)} "
                f"{_f(row.get('loss'), 10, 5)} {_f(row.get('max_grad_diff_vs_first'), 15, 3, e=True)}"
                + ("  OOM" if row.get("oom") else ""))
        del hd, ht, w, pw, ref
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _bench_module():
    """kernels/bench_distill.py is a script beside the kernels: load it by path (reused, not
    copied: its inputs and its fwd+bwd step)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_distill", REPO / "kernels" / "bench_distill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _f(x, width, prec, e=False) -> str:
    if x is None:
        return f"{'-':>{width}}"
    return f"{x:>{width}.{prec}e}" if e else f"{x:>{width}.{prec}f}"


# ------------------------------------------------------------------------------ 3. learner

def fake_batch(s: Shapes, cfg, device: str, gen: torch.Generator):
    """seqs x seq_len tokens of fake features; `anchors` blocks per sequence tiling its end (the
    fresh tokens of an online step), each with its K labels inside the sequence."""
    from vllm_onlinespec.learner.batches import BlockBatch

    B, T, K = s.seqs, s.seq_len, cfg.num_draft_tokens
    F, H = cfg.fc_in_features, cfg.hidden_size
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # what vLLM captures on each
    # made on the device (fast), then kept on the host, where the feedback buffer keeps it
    aux = torch.randn(B, T, F, device=device, dtype=dt).cpu()
    fin = torch.randn(B, T, H, device=device, dtype=dt).cpu()
    ids = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
    first = T - 1 - s.anchors * K
    anchors = (first + K * torch.arange(s.anchors)).expand(B, -1).contiguous()
    return BlockBatch(ids, aux, fin, torch.full((B,), T, dtype=torch.long), anchors,
                      num_fresh=B * s.anchors * K)


def check_learner(s: Shapes, rep: Report, workdir: Path) -> None:
    from vllm_onlinespec.config import OnlineSpecConfig
    from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, save_drafter
    from vllm_onlinespec.learner.factory import build_learner
    from vllm_onlinespec.learner.timing import Timer

    dev = torch.device(s.device)
    dcfg = DFlashConfig(**s.drafter)
    gen = torch.Generator().manual_seed(0)
    path = workdir / "drafter"
    t0 = time.perf_counter()
    with torch.device(dev):  # random init on the device: a 1 B-parameter init on the host is slow
        d0 = DFlashDrafter(dcfg).to(getattr(torch, dcfg.torch_dtype))
    save_drafter(path, dcfg, d0)
    del d0
    say(f"[3] learner: drafter {dcfg.num_hidden_layers} layers h={dcfg.hidden_size} "
        f"written in {time.perf_counter() - t0:.1f} s; {s.seqs} x {s.seq_len} tokens, "
        f"{s.anchors} blocks of K={dcfg.num_draft_tokens} per sequence")
    V, H = dcfg.vocab_size, dcfg.hidden_size
    tdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    embed = (torch.randn(V, H, device=dev, dtype=tdt) * 0.02)
    lm_head = (torch.randn(V, H, device=dev, dtype=tdt) * (2.0 / H**0.5))
    from vllm_onlinespec.learner.memory import check_fits

    for dtype in s.learner_dtypes:
        row: dict = dict(learner_dtype=dtype, seqs=s.seqs, seq_len=s.seq_len,
                         blocks=s.seqs * s.anchors, loss_rows=s.seqs * s.anchors * dcfg.num_draft_tokens)
        try:
            cfg = OnlineSpecConfig.from_any(dict(learner_device=s.device, learner_dtype=dtype,
                                                 lr=1e-5, grad_clip=1.0))
            parts = build_learner(cfg, path, embed, lm_head, dcfg.num_draft_tokens,
                                  train_length_head=False)
            learner = parts.learner
            assert learner.loss_fn.lm_head_w is lm_head and learner.loss_fn.embed_w is embed
            assert all(p.device.type == dev.type for p in learner.params)
            n_params = sum(p.numel() for p in learner.params)
            row.update(params_m=round(n_params / 1e6, 1), loss_impl=learner.loss_fn.impl)
            fp = parts.footprint
            row.update(stated_steady_mib=round(fp.steady / 2**20, 1),
                       stated_peak_mib=round(fp.peak / 2**20, 1))
            batch = fake_batch(s, dcfg, s.device, gen)
            hold = None
            if dev.type == "cuda":
                # Co-residency as serving has it: the learner's state exists before vLLM
                # profiles, then the KV cache takes gpu_memory_utilization of the device less
                # what is allocated; the updates must run in what is left.
                try:
                    check_fits(fp, dev, s.utilization)
                except MemoryError as e:  # the designed outcome for a learner that cannot fit
                    row["refused"] = str(e)
                    say(f"    {dtype}: refused before serving: {e}")
                    rep.learner.append(row)
                    del parts, learner, batch
                    torch.cuda.empty_cache()
                    continue
                torch.cuda.synchronize()
                _, total = torch.cuda.mem_get_info(dev)
                held = int(s.utilization * total) - torch.cuda.memory_reserved(dev)
                hold = torch.empty(max(held, 0), dtype=torch.uint8, device=dev)
                row["held_mib"] = round(hold.numel() / 2**20)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            ups, snaps, walls = [], [], []
            for i in range(s.updates + 1):  # the first one compiles and allocates: not counted
                w0 = time.perf_counter()
                status = learner.sync_step(batch)
                if status != "updated":
                    raise RuntimeError(f"update {i}: {status}: {learner.last_error}")
                if i:
                    ups.append(learner.update_ms)
                    snaps.append(learner.snapshot_ms)
                    walls.append((time.perf_counter() - w0) * 1e3)
            row.update(update_ms=statistics.median(ups), snapshot_ms=statistics.median(snaps),
                       update_wall_ms=statistics.median(walls), last_loss=learner.last_loss)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                row["peak_over_model_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20

            # publish: snapshot -> a second drafter (vLLM's stand-in) on another stream
            with torch.device(dev):
                served = DFlashDrafter(dcfg).to(dtype=learner.params[0].dtype)
            target = dict(served.named_parameters())
            side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            pubs = []
            for _ in range(s.updates):
                _, snap = learner.latest()
                ctx = torch.cuda.stream(side) if side is not None else _null()
                with ctx, torch.no_grad():
                    with Timer(dev) as t:
                        snap.wait_ready()
                        for name, tensor in snap.items():
                            target[name.removeprefix("drafter.")].copy_(tensor)
                pubs.append(t.ms)
            ok = all(torch.equal(target[n.removeprefix("drafter.")], p)
                     for n, p in zip(learner.names, learner.params))
            if not ok:
                raise RuntimeError("published weights differ from the learner's")
            row["publish_ms"] = statistics.median(pubs)
            row["publish_mib"] = sum(p.numel() * p.element_size() for p in learner.params) / 2**20
            del served, target, parts, learner, batch, hold
        except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"
            rep.failures.append(f"learner {dtype}: {row['error']}")
        rep.learner.append(row)
        say("    " + json.dumps(row))
        if dev.type == "cuda":
            torch.cuda.empty_cache()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------------------ 4. feedback copy

def check_feedback_copy(s: Shapes, rep: Report) -> None:
    from types import SimpleNamespace

    from vllm_onlinespec.serving.feedback import FeedbackPipe, records_from_step

    h, layers = s.drafter["hidden_size"], len(s.drafter["target_layer_ids"])
    dev = torch.device(s.device)
    for reqs in (8, 64) if s.device == "cuda" else (2,):
        k = 4  # each request: last token + 4 drafts, 2 accepted -> 3 committed rows
        n = reqs * (k + 1)
        view = SimpleNamespace(
            req_ids=[f"r{i}" for i in range(reqs)], num_scheduled=[k + 1] * reqs,
            num_draft_tokens=[k] * reqs, finished_req_ids=set(),
            aux_hidden_states=[torch.randn(n, h, device=dev, dtype=torch.bfloat16)
                               for _ in range(layers)],
            hidden_states=torch.randn(n, h, device=dev, dtype=torch.bfloat16),
            input_ids=torch.arange(n, device=dev), positions=torch.arange(n, device=dev) + 100)
        accepted = [2] * reqs
        row = {"requests": reqs, "rows": 3 * reqs, "hidden": h, "layers": layers}
        times = {"sync": [], "async_issue": [], "async_ready": []}
        for rep_i in range(6):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = records_from_step(view, accepted, 0)
            t1 = time.perf_counter()
            pipe = FeedbackPipe()
            fb = records_from_step(view, accepted, 0, async_copy=True)
            t2 = time.perf_counter()
            got = pipe.submit(fb) or pipe.flush()
            t3 = time.perf_counter()
            if rep_i:  # the first is a warm-up (pinned pool, kernels)
                times["sync"].append((t1 - t0) * 1e3)
                times["async_issue"].append((t2 - t1) * 1e3)
                times["async_ready"].append((t3 - t1) * 1e3)
        ok = all(torch.equal(a.aux, b.aux) and torch.equal(a.target_hidden, b.target_hidden)
                 and torch.equal(a.token_ids, b.token_ids)
                 for a, b in zip(ref.records, got[0].records))
        row.update({f"{key}_ms": round(statistics.median(v), 3) for key, v in times.items()},
                   equal=ok, bytes=int(sum(r.aux.numel() * r.aux.element_size()
                                           + r.target_hidden.numel() * 2 for r in ref.records)))
        say(f"  feedback copy: {row}")
        rep.feedback.append(row)
        if not ok:
            rep.failures.append(f"feedback copy ({reqs} requests): async records differ from sync")


# ------------------------------------------------------------------------------ 5. CUDA graphs

class _Alias:
    """A tensor's memory without its ownership, as vLLM's `weak_ref_tensor` keeps a graph's
    outputs: the caching allocator may hand that memory to the next graph captured in the pool."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def check_graphs(s: Shapes, rep: Report) -> None:
    """(a) Two graphs in one memory pool, the first's output kept only as a non-owning alias
    (vLLM's target model and its drafter): does replaying the second overwrite the first's
    output, and does a copy taken between the two replays (what serving/feedback does before
    the drafter runs) keep the right values? (b) Weights copied in place into a captured graph's
    parameters (the publish path): does the next replay compute with the new weights?"""
    if s.device != "cuda":
        rep.graphs = {"skipped": "CUDA graphs need a CUDA device"}
        say("[5] graphs: skipped (needs CUDA)")
        return
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
    overwritten = not torch.equal(out1, want)
    copy_ok = torch.allclose(copied, want, atol=1e-5, rtol=1e-5)
    res = {"n": n, "hidden": h, "shares_memory": y1_ptr in (t.data_ptr(), y2.data_ptr()),
           "output_overwritten_by_second_replay": overwritten, "copy_before_second_replay_ok": copy_ok}
    # (b) publish into the captured weights: an in-place copy on another stream, then replay
    w_new = torch.randn(h, h, device=dev, generator=g) / h**0.5
    pub = torch.cuda.Stream()
    with torch.cuda.stream(pub):
        w2.copy_(w_new)
    torch.cuda.current_stream().wait_stream(pub)  # vLLM's step waits on the publish event
    g2.replay()
    torch.cuda.synchronize()
    res["replay_sees_published_weights"] = torch.allclose(y2, (x @ w_new).relu_() * 3.0 + 1.0,
                                                          atol=1e-4, rtol=1e-4)
    rep.graphs = res
    say(f"[5] graphs: {json.dumps(res)}")
    if not copy_ok:
        rep.failures.append("graphs: the feature copy taken between the replays is wrong")
    if not res["replay_sees_published_weights"]:
        rep.failures.append("graphs: a replay after publish does not compute with the new weights")


# ------------------------------------------------------------------------------ output

def write(rep: Report, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    d = dataclasses.asdict(rep)
    d["command"] = command
    (out / "gpu.json").write_text(json.dumps(d, indent=1) + "\n")
    lines = [f"# GPU checks ({rep.device})", "",
             f"Command: `{command}`. torch {rep.torch}, triton {rep.triton}, Python {rep.python}."
             + (" **Smoke run (CPU, tiny shapes): not a measurement.**" if rep.smoke else ""), "",
             "## 1. Kernel tests on the device", "",
             f"`tests/test_kernels.py`: {rep.kernel_tests.get('summary')} "
             f"(rc {rep.kernel_tests.get('rc')}, {rep.kernel_tests.get('seconds')} s)", "",
             "## 2. Fused loss vs the PyTorch reference (forward + backward)", "",
             "| N | h | V | dtype | impl | ms | peak MiB | loss | max abs grad diff vs naive |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rep.loss:
        lines.append(f"| {r['n']} | {r['h']} | {r['v']} | {r['dtype']} | {r['impl']} | "
                     f"{_cell(r.get('ms'), 2)} | {_cell(r.get('peak_mib'), 0)} | "
                     f"{_cell(r.get('loss'), 5)} | {_cell(r.get('max_grad_diff_vs_first'), 3, True)}"
                     + (" (OOM)" if r.get("oom") else "") + " |")
    lines += ["", "## 3. One online update of the drafter on the device", "",
              "| learner dtype | params (M) | loss impl | blocks | loss rows | held by the "
              "stand-in KV cache (MiB) | stated footprint, held / at peak (MiB) | update ms | "
              "snapshot ms | publish ms | publish MiB | peak MiB | error or refusal |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep.learner:
        lines.append(f"| {r['learner_dtype']} | {r.get('params_m', '-')} | {r.get('loss_impl', '-')} | "
                     f"{r['blocks']} | {r['loss_rows']} | {r.get('held_mib', '-')} | "
                     f"{r.get('stated_steady_mib', '-')} / {r.get('stated_peak_mib', '-')} | "
                     f"{_cell(r.get('update_ms'), 1)} | "
                     f"{_cell(r.get('snapshot_ms'), 2)} | {_cell(r.get('publish_ms'), 2)} | "
                     f"{_cell(r.get('publish_mib'), 0)} | {_cell(r.get('peak_mib'), 0)} | "
                     f"{r.get('error', r.get('refused', ''))} |")
    lines += ["", "Update/snapshot ms: CUDA events on the learner's stream (host clock on CPU), "
              "median of the updates after a warm-up one. Publish: Snapshot.wait_ready, then a "
              "device-to-device copy_ into a second drafter on another stream (vLLM's "
              "load_weights does the same copy plus name mapping). Peak: "
              "torch.cuda.max_memory_allocated over the updates (drafter, state, head and "
              "embedding included).", ""]
    lines += ["## 4. Feedback copy off the serving thread", "",
              "| requests | committed rows | bytes | sync ms | async: call ms | async: ready ms | "
              "equal |", "|---|---|---|---|---|---|---|"]
    for r in rep.feedback:
        lines.append(f"| {r['requests']} | {r['rows']} | {r['bytes']} | {r['sync_ms']} | "
                     f"{r['async_issue_ms']} | {r['async_ready_ms']} | {r['equal']} |")
    lines += ["", "sync: records_from_step with pageable copies (what the serving thread waited "
              "for); async: the call with pinned non-blocking copies (what it waits for now), and "
              "until the records are usable (FeedbackPipe hands them on a step later). Host "
              "clock, median of 5 after a warm-up.", ""]
    lines += ["## 5. CUDA graphs: a shared memory pool and publishing into captured weights", ""]
    lines += [f"- {k}: {v}" for k, v in rep.graphs.items()] + [""]
    if rep.failures:
        lines += ["## Failures", ""] + [f"- {f}" for f in rep.failures] + [""]
    (out / "gpu.md").write_text("\n".join(lines))


def _cell(x, prec, e=False) -> str:
    if x is None:
        return "-"
    return f"{x:.{prec}e}" if e else f"{x:.{prec}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (for the unit test)")
    ap.add_argument("--out", default=None,
                    help="folder for gpu.json/gpu.md (default: docs/results on a device; a new "
                         "temporary folder with --smoke, whose figures are not measurements)")
    ap.add_argument("--skip", default="", help="comma-separated checks to skip: kernels,loss,learner,feedback,graphs")
    ap.add_argument("--learner-dtypes", default="", help="e.g. bfloat16,float32 (default: bfloat16)")
    ap.add_argument("--imports-only", action="store_true",
                    help="step [0] only: import what the checks use, without " + ", ".join(ABSENT_ON_DEVICE))
    a = ap.parse_args(argv)
    if a.imports_only:
        return check_imports()
    s = dataclasses.replace(SMOKE if a.smoke else FULL)
    if a.learner_dtypes:
        s.learner_dtypes = a.learner_dtypes.split(",")
    if s.device == "cuda" and not torch.cuda.is_available():
        say("gpu_check: FAILED: no CUDA device (use --smoke on a CPU machine)")
        return 2
    if s.device == "cuda" and os.environ.get("TRITON_INTERPRET"):
        say("gpu_check: TRITON_INTERPRET is set: unsetting it for the kernel tests; this process "
            "would run interpreted kernels, so it refuses")
        return 2
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="gpu_check-smoke-")) if a.smoke
                                     else REPO / "docs" / "results")
    skip = set(filter(None, a.skip.split(",")))
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    name = torch.cuda.get_device_name() if s.device == "cuda" else f"cpu ({platform.processor() or 'cpu'})"
    rep = Report(device=name, torch=torch.__version__, triton=tv, python=platform.python_version(),
                 smoke=a.smoke)
    say(f"gpu_check: {name}, torch {rep.torch}, triton {tv}{' (smoke)' if a.smoke else ''}")
    t0 = time.perf_counter()
    checks = [("kernels", lambda: check_kernel_tests(s, rep)), ("loss", lambda: check_loss(s, rep))]
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        checks.append(("learner", lambda: check_learner(s, rep, Path(tmp))))
        checks.append(("feedback", lambda: check_feedback_copy(s, rep)))
        checks.append(("graphs", lambda: check_graphs(s, rep)))
        for key, run in checks:
            if key in skip:
                continue
            c0 = time.perf_counter()
            try:
                run()
            except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
                traceback.print_exc()
                rep.failures.append(f"{key}: {type(e).__name__}: {e}")
            say(f"    ({key}: {time.perf_counter() - c0:.1f} s)")
    command = "lab/gpu_check.sh" + (" --smoke" if a.smoke else "")
    write(rep, out, command)
    say(f"gpu_check: wrote {out}/gpu.json and gpu.md in {time.perf_counter() - t0:.0f} s")
    if rep.failures:
        say("gpu_check: FAILED:\n  " + "\n  ".join(rep.failures))
        return 1
    say("gpu_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
