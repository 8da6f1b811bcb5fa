"""Run arms one after the other, each in its own subprocess (`python -m vllm_onlinespec.bench.arm_process`).

Why subprocesses: one vLLM engine at a time fits this box, and an engine that shuts down inside
a long-lived process leaves threads and memory behind that would bias the next arm's timings.
The arm's engine logs go to `<out>/logs/<arm>.log`; its `@@bench` progress lines drive a bar.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from vllm_onlinespec.bench.arm_process import PROGRESS_TAG
from vllm_onlinespec.bench.arm_catalog import clear_own_checkpoints
from vllm_onlinespec.bench.results import ArmResult, ArmSpec


def run_arm(spec: ArmSpec, log_dir: Path, n_prompts: int, position: int = 0) -> ArmResult:
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path = log_dir / f"{spec.name}.spec.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    Path(spec.out).unlink(missing_ok=True)  # a stale result must never pass for this run's
    clear_own_checkpoints(spec)
    log_path = log_dir / f"{spec.name}.log"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    cmd = [sys.executable, "-m", "vllm_onlinespec.bench.arm_process", str(spec_path)]
    bar = tqdm(total=n_prompts, desc=f"{spec.name:>18} (starting)", unit="req", position=position,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith(PROGRESS_TAG):
                log.write(line)  # vLLM logs to stdout too
                continue
            ev = json.loads(line[len(PROGRESS_TAG):])
            if ev["event"] == "started":
                bar.set_description(f"{spec.name:>18}")
                bar.set_postfix_str(f"engine up in {ev['startup_s']:.0f} s")
            elif ev["event"] == "request":  # continuous protocols: one per finished request
                bar.update(1)
            elif ev["event"] == "wave":
                bar.update(ev["prompts"])
                post = f"accept len {ev['acceptance_length']:.2f}, {ev['tok_s']:.1f} tok/s"
                if ev.get("version"):
                    post += f", drafter v{ev['version']}"
                bar.set_postfix_str(post)
        rc = proc.wait()
    bar.close()
    res = ArmResult.load(spec.out) if Path(spec.out).is_file() else ArmResult(spec=spec)
    if rc != 0 and not res.error:
        res.error = f"arm process exited with code {rc}"
    if res.error:
        tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-15:])
        tqdm.write(f"{spec.name}: FAILED ({res.error}); log {log_path}\n{tail}")
    elif not res.waves:
        res.error = "no waves measured"
    tqdm.write(f"{spec.name}: {time.perf_counter() - t0:.0f} s (engine start "
               f"{res.startup_s:.0f} s, serving {res.serve_s:.0f} s)")
    return res


def counterbalanced(n: int, repeat: int) -> list[int]:
    """The order to run n arms in on the repeat-th stream order (0-based): as given on even
    repeats, reversed on odd ones. The box's speed drifts over minutes (docs/results/
    domain_shift.md), and arms run one after another; over an ABBA pair a linear drift
    weighs on every arm alike instead of favouring the first ones."""
    return list(range(n)) if repeat % 2 == 0 else list(range(n))[::-1]


def run_arms(specs: Sequence[ArmSpec], out_dir: str | Path, repeat: int = 0) -> list[ArmResult]:
    """Each arm in its own engine, one at a time, in `counterbalanced` order for this repeat;
    results in the order of `specs`."""
    out = Path(out_dir)
    results: dict[int, ArmResult] = {}
    for i in counterbalanced(len(specs), repeat):
        spec = specs[i]
        n = sum(1 for line in open(spec.prompts, encoding="utf-8") if line.strip())
        results[i] = run_arm(spec, out / "logs", n)
    return [results[i] for i in range(len(specs))]
