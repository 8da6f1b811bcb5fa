"""Starting drafters for benchmarks and the demo: trained once by `vllm-onlinespec train`,
then reused from the cache while the training arguments stay the same."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

STAMP = "bench_train_args.json"


def cache_key(args: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()[:10]


def is_trained(out: Path, args: Sequence[str]) -> bool:
    try:
        return ((out / "config.json").is_file()
                and json.loads((out / STAMP).read_text())["args"] == list(args))
    except (OSError, ValueError, KeyError):
        return False


def ensure_drafter(out: str | Path, train_args: Sequence[str], *, quiet_vllm: bool = True) -> Path:
    """Train a drafter into `out` with `vllm-onlinespec train --out out *train_args`, unless `out`
    already holds one trained with exactly these arguments. The trainer's own progress bars go to
    the terminal; it runs in a subprocess so its engine and features are gone before serving."""
    out = Path(out)
    if is_trained(out, train_args):
        print(f"drafter: reusing {out} (trained earlier with the same arguments)")
        return out
    (out / STAMP).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "vllm_onlinespec.cli", "train", "--out", str(out), *train_args]
    print("drafter: training: vllm-onlinespec train " + " ".join(cmd[4:]), flush=True)
    env = dict(os.environ)
    if quiet_vllm:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise RuntimeError(f"drafter training failed (exit code {rc}); command: {' '.join(cmd)}")
    (out / STAMP).write_text(json.dumps({"args": list(train_args),
                                         "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    return out
