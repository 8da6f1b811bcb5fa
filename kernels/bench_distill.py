"""Benchmark of the fused LM-head + distillation loss: peak memory and time of forward + backward.

    python kernels/bench_distill.py --device cpu  --shapes 256,1024        # SmolLM2 h=576 V=49152
    python kernels/bench_distill.py --device cuda                          # Qwen3-8B h=4096 V=151936
    python kernels/bench_distill.py --device cuda --shapes 512:4096:151936,2048

``--shapes``: comma-separated entries ``N`` (the preset's h and V) or ``N:h:V``.

Method (printed with the table):

* CUDA: ``torch.cuda.max_memory_allocated()`` during one forward+backward, minus what was
  allocated before it (inputs and the head excluded); time = median over ``--reps`` runs after a
  warm-up, CUDA events.
* CPU: there is no allocator statistic, so every (impl, N) runs in a fresh subprocess; it resets
  the kernel's peak-RSS mark (``/proc/self/clear_refs`` = 5), runs one *cold* forward+backward and
  reports ``VmHWM - VmRSS`` before the run (the peak of resident memory the call added; a cold
  process so that malloc cannot recycle pages of an earlier run). Time = median of ``--reps``
  further runs (wall clock). The analytic size of one float32 ``[N, V]`` tensor is printed too.
"""

from __future__ import annotations

import importlib  # the benchmark imports the kernels by package name at run time

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

PRESETS = {
    "cpu": dict(name="SmolLM2 (h=576, V=49152)", h=576, v=49152, ns=[256, 1024, 4096],
                impls=["naive", "chunked"], dtype="float32"),
    # DFlash drafter blocks of 16 positions: N = 32 .. 512 blocks
    "cuda": dict(name="Qwen3-8B (h=4096, V=151936, block 16)", h=4096, v=151936,
                 ns=[512, 1024, 2048, 4096, 8192], impls=["naive", "triton", "chunked"],
                 dtype="bfloat16"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_inputs(n, h, v, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device=device, dtype=dtype)
    ht = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    hd = (ht.float() + 0.7 * torch.randn(n, h, generator=g).to(device)).to(dtype)
    pw = torch.ones(n, device=device)
    pw[::7] = 0.0
    return hd, ht, w, pw


def step(impl, hd0, ht, w, pw, chunk_size=None):
    distill_loss = importlib.import_module("vllm_onlinespec.kernels").distill_loss  # a script: absolute

    hd = hd0.detach().requires_grad_(True)
    loss = distill_loss(hd, ht, w, pw, impl=impl, chunk_size=chunk_size, alpha=0.8,
                        temperature=1.0, mode="reverse_kl")
    loss.backward()
    return loss.detach(), hd.grad


# ------------------------------------------------------------------------------------------ CPU


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def cpu_worker(impl, n, h, v, dtype, reps, chunk_size):
    """Runs in a fresh process; prints one JSON line."""
    torch.manual_seed(0)
    hd, ht, w, pw = make_inputs(n, h, v, DTYPES[dtype], "cpu")
    method = "VmHWM-reset"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        method = "ru_maxrss"  # fall back: the process high-water mark (may include setup)
    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    loss, _ = step(impl, hd, ht, w, pw, chunk_size)
    cold = time.perf_counter() - t0
    if method == "VmHWM-reset":
        peak_kb = _status_kb("VmHWM") - rss0
    else:
        import resource

        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(impl, hd, ht, w, pw, chunk_size)
        times.append(time.perf_counter() - t0)
    print(json.dumps(dict(peak_mib=peak_kb / 1024, time_s=statistics.median(times) if times else cold,
                          cold_s=cold, loss=loss.item(), method=method)))


def run_cpu(shapes, impls, dtype, reps, chunk_size):
    print(f"device=cpu threads={torch.get_num_threads()} dtype={dtype} reps={reps}")
    print("peak = VmHWM - VmRSS around one cold fwd+bwd in a fresh process; "
          "time = median wall clock of the warm runs")
    hdr = f"{'N':>6} {'h':>5} {'V':>7} {'impl':>8} {'peak MiB':>9} {'[N,V]f32 MiB':>12} " \
          f"{'time s':>8} {'cold s':>7} {'loss':>10}"
    print(hdr)
    print("-" * len(hdr))
    for n, h, v in shapes:
        for impl in impls:
            cmd = [sys.executable, os.path.abspath(__file__), "--_worker", impl, str(n), str(h),
                   str(v), dtype, str(reps), str(chunk_size or 0)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                err = (r.stderr.strip().splitlines() or ["?"])[-1][:60]
                print(f"{n:>6} {h:>5} {v:>7} {impl:>8}  failed: {err}")
                continue
            d = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{n:>6} {h:>5} {v:>7} {impl:>8} {d['peak_mib']:>9.1f} {n * v * 4 / 2**20:>12.1f} "
                  f"{d['time_s']:>8.3f} {d['cold_s']:>7.3f} {d['loss']:>10.5f}", flush=True)


# ------------------------------------------------------------------------------------------ CUDA


def run_cuda(shapes, impls, dtype, reps, chunk_size):
    dev = torch.device("cuda")
    print(f"device={torch.cuda.get_device_name(dev)} dtype={dtype} reps={reps}")
    print("peak = torch.cuda.max_memory_allocated during fwd+bwd minus memory allocated before "
          "(inputs excluded); time = median of CUDA-event timings after one warm-up")
    hdr = f"{'N':>6} {'h':>5} {'V':>7} {'impl':>8} {'peak MiB':>9} {'time ms':>9} {'loss':>10} " \
          f"{'max|dgrad|':>11}"
    print(hdr)
    print("-" * len(hdr))
    for n, h, v in shapes:
        hd, ht, w, pw = make_inputs(n, h, v, DTYPES[dtype], dev)
        ref_grad = None
        for impl in impls:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                loss, grad = step(impl, hd, ht, w, pw, chunk_size)  # also the warm-up
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                times = []
                for _ in range(reps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    step(impl, hd, ht, w, pw, chunk_size)
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1))
                diff = ""
                if ref_grad is None:
                    ref_grad = grad.float()
                else:
                    diff = f"{(grad.float() - ref_grad).abs().max().item():.2e}"
                print(f"{n:>6} {h:>5} {v:>7} {impl:>8} {peak:>9.0f} {statistics.median(times):>9.2f} "
                      f"{loss.item():>10.5f} {diff:>11}", flush=True)
                del grad, loss
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"{n:>6} {h:>5} {v:>7} {impl:>8} {'OOM':>9}", flush=True)
        del hd, ht, w, pw, ref_grad
        torch.cuda.empty_cache()


def parse_shapes(spec, preset):
    if not spec:
        return [(n, preset["h"], preset["v"]) for n in preset["ns"]]
    out = []
    for item in spec.split(","):
        parts = [int(x) for x in item.strip().split(":")]
        if len(parts) == 1:
            out.append((parts[0], preset["h"], preset["v"]))
        elif len(parts) == 3:
            out.append(tuple(parts))
        else:
            raise SystemExit(f"bad --shapes entry {item!r}: want N or N:h:V")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="", help="comma-separated N or N:h:V (default: preset)")
    ap.add_argument("--impls", default="", help="comma-separated subset of naive,chunked,triton")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--_worker", nargs=7, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        impl, n, h, v, dtype, reps, cs = a._worker
        cpu_worker(impl, int(n), int(h), int(v), dtype, int(reps), int(cs) or None)
        return
    preset = PRESETS[a.device]
    shapes = parse_shapes(a.shapes, preset)
    impls = a.impls.split(",") if a.impls else preset["impls"]
    dtype = a.dtype or preset["dtype"]
    print(f"preset: {preset['name']}; loss: reverse_kl, alpha 0.8, T 1, 1/7 of positions masked")
    if a.device == "cpu":
        run_cpu(shapes, impls, dtype, a.reps if a.reps is not None else 2, a.chunk_size)
    else:
        run_cuda(shapes, impls, dtype, a.reps if a.reps is not None else 3, a.chunk_size)


if __name__ == "__main__":
    main()
