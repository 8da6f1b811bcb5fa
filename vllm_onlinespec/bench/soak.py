"""`vllm-onlinespec bench-soak`: `vllm serve` with the `cpu` preset learning, for a set time,
under mixed traffic with faults; then SIGKILL mid-update and mid-checkpoint-write, and a restart.

    vllm-onlinespec bench-soak --duration 1800 --out runs/soak --docs docs/results

The traffic: C closed-loop clients send a weighted mix of well-formed requests (greedy, sampled,
seeded, n = 2, a prompt near max_model_len, streamed, and streamed then dropped by the client
mid-answer) and, one request in `--malformed-every`, a malformed one (negative temperature, an
unknown field, max_tokens over the context, empty messages). At `--swap-at` of the duration the
target is replaced in place by `--swap-to` (vLLM's dev-mode /collective_rpc, the worker's
onlinespec_swap_target). Every 10 s: RSS of every vLLM process, the learner's counters.

Afterwards every greedy answer is compared, token for token, with the target's own greedy
continuation (HF, float32: what vLLM without speculation serves, the greedy-equality tests'
reference) of the same prompt tokens, on the target that served it; answers that straddle the
swap are counted, not compared. Then the kill tests (`--kills`, default on): the server is killed
with SIGKILL while the learner updates and while a checkpoint is being written, restarted with
the same command (`--kills`), and must resume the newest complete checkpoint, serve vLLM that drafter's
weights (digest), say in one line what it resumed, and answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_onlinespec.bench.concurrency import SERVED_NAME, free_port, scrape, wait_healthy
from vllm_onlinespec.bench.results import percentile

# Weights of the well-formed kinds (out of 20).
KINDS: dict[str, int] = {"greedy": 5, "sampled": 3, "seeded": 3, "n2": 2, "long": 1, "stream": 4,
                         "abort": 2}
MALFORMED = ("negative_temperature", "unknown_field", "max_tokens_over", "empty_messages")
KILL_MOMENTS = ("update", "checkpoint")
STRICT_MIDDLEWARE = "vllm_onlinespec.serving.compat.strict_requests.StrictRequests"
QUESTIONS = [
    "What is 17 times 23? Show the steps.", "Name three uses of copper.",
    "Write a haiku about rain.", "Explain what a hash table is in two sentences.",
    "List the first five prime numbers.", "How do I reverse a list in Python?",
    "Summarize the water cycle.", "Give two tips for a job interview.",
    "What is the capital of Australia, and why not Sydney?", "Translate 'good morning' to French.",
    "A train travels 60 km in 45 minutes. What is its speed in km/h?",
    "Write a short SQL query that counts rows in a table named users.",
]
METRICS = {"updates": "onlinespec:learner_updates_total", "errors": "onlinespec:learner_errors_total",
           "publishes": "onlinespec:publishes_total", "version": "onlinespec:drafter_version",
           "hook_errors": "onlinespec:hook_errors_total",
           # the feedback buffer's tokens (target features held for training: bounded by the
           # preset's buffer.max_tokens, ~9 KB a token in float32 for SmolLM2)
           "buffer_tokens": "onlinespec:buffer_tokens"}


@dataclass
class Record:
    """One request as the client saw it."""
    i: int
    kind: str
    malformed: bool
    t0: float  # seconds since the soak began
    t1: float = 0.0
    status: int = 0  # HTTP status; 0 = no answer (connection error, timeout)
    ok: bool = False  # well-formed: answered (or dropped by us mid-stream); malformed: 4xx
    error: str = ""
    tokens: int = 0
    tpot_ms: float | None = None  # streamed requests: (end - first token) / (tokens - 1)
    dropped: bool = False  # the client closed the connection mid-answer (kind "abort")
    prompt_ids: list[int] | None = None  # greedy kinds: compared afterwards
    token_ids: list[int] | None = None
    phase: str = ""  # greedy kinds: "base", "swapped" or "straddle"


@dataclass
class Sample:
    t: float
    rss_mb: dict[str, float]  # per vLLM process: "<name>-<pid>"
    metrics: dict[str, float]


@dataclass
class Soak:
    url: str
    duration_s: float
    concurrency: int = 4
    max_tokens: int = 64
    max_model_len: int = 2048
    malformed_every: int = 10
    swap_at: float = 0.5  # fraction of the duration; 0 = no swap
    swap_to: str | None = None
    sample_s: float = 10.0
    seed: int = 0
    server_pid: int | None = None
    long_prompt: str = ""
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    swap: dict[str, Any] = field(default_factory=dict)

    # -- requests ---------------------------------------------------------------------------------
    def body(self, i: int, kind: str) -> tuple[dict, bool, int]:
        """(JSON body, stream, chunks after which the client drops the connection or 0)."""
        q = QUESTIONS[i % len(QUESTIONS)]
        msgs = [{"role": "user", "content": q}]
        b: dict[str, Any] = {"model": SERVED_NAME, "messages": msgs, "max_tokens": self.max_tokens}
        if kind in ("greedy", "long"):
            if kind == "long":
                b["messages"] = [{"role": "user", "content": self.long_prompt}]
            return {**b, "temperature": 0.0, "return_token_ids": True}, False, 0
        if kind == "sampled":
            return {**b, "temperature": 1.0, "top_p": 1.0}, False, 0
        if kind == "seeded":
            return {**b, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": i}, False, 0
        if kind == "n2":
            return {**b, "temperature": 1.0, "n": 2}, False, 0
        if kind in ("stream", "abort"):
            s = {**b, "temperature": 0.7, "stream": True,
                 "stream_options": {"include_usage": True}}
            return s, True, (3 if kind == "abort" else 0)
        if kind == "negative_temperature":
            return {**b, "temperature": -1.0}, False, 0
        if kind == "unknown_field":
            return {**b, "temprature": 0.5}, False, 0
        if kind == "max_tokens_over":
            return {**b, "max_tokens": self.max_model_len + 1000}, False, 0
        if kind == "empty_messages":
            return {**b, "messages": []}, False, 0
        raise ValueError(f"unknown request kind {kind!r}")

    def kind_of(self, i: int, rng: random.Random) -> tuple[str, bool]:
        if self.malformed_every and i % self.malformed_every == self.malformed_every - 1:
            return MALFORMED[(i // self.malformed_every) % len(MALFORMED)], True
        kinds, weights = zip(*KINDS.items())
        return rng.choices(kinds, weights)[0], False

    async def one(self, http: Any, i: int, kind: str, malformed: bool, t_start: float) -> Record:
        import aiohttp

        rec = Record(i=i, kind=kind, malformed=malformed, t0=time.monotonic() - t_start)
        body, stream, drop_after = self.body(i, kind)
        try:
            async with http.post(self.url + "/v1/chat/completions", json=body) as r:
                rec.status = r.status
                if r.status != 200:
                    rec.error = (await r.text())[:300]
                elif not stream:
                    data = await r.json()
                    rec.tokens = int(data["usage"]["completion_tokens"])
                    if body.get("return_token_ids"):
                        rec.prompt_ids = data.get("prompt_token_ids")
                        rec.token_ids = data["choices"][0].get("token_ids")
                else:
                    await self._read_stream(r, rec, drop_after)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.t1 = time.monotonic() - t_start
        if malformed:
            rec.ok = 400 <= rec.status < 500
        else:
            rec.ok = rec.status == 200 and (rec.tokens > 0 or kind == "abort") and not rec.error
        return rec

    async def _read_stream(self, r: Any, rec: Record, drop_after: int) -> None:
        chunks, first = 0, None
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                rec.tokens = int(data["usage"]["completion_tokens"])
            if any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                chunks += 1
                first = first if first is not None else time.monotonic()
                if drop_after and chunks >= drop_after:
                    r.close()  # the client goes away mid-answer: the server must abort it
                    rec.tokens, rec.dropped = chunks, True
                    return
        if first is not None and rec.tokens > 1:
            rec.tpot_ms = (time.monotonic() - first) * 1e3 / (rec.tokens - 1)

    # -- the run ----------------------------------------------------------------------------------
    async def run(self) -> None:
        import aiohttp

        t_start, rng, counter = time.monotonic(), random.Random(self.seed), iter(range(10 ** 9))
        stop_at = t_start + self.duration_s
        timeout = aiohttp.ClientTimeout(total=600)

        async def client(http: Any) -> None:
            while time.monotonic() < stop_at:
                i = next(counter)
                kind, bad = self.kind_of(i, rng)
                self.records.append(await self.one(http, i, kind, bad, t_start))

        async def sampler() -> None:
            while True:
                self.samples.append(Sample(t=time.monotonic() - t_start,
                                           rss_mb=process_rss(self.server_pid),
                                           metrics=await asyncio.to_thread(self._metrics)))
                if time.monotonic() >= stop_at:
                    return
                await asyncio.sleep(min(self.sample_s, max(0.0, stop_at - time.monotonic())))

        async def swapper() -> None:
            await asyncio.sleep(self.swap_at * self.duration_s)
            t0 = time.monotonic() - t_start
            try:
                res = await asyncio.to_thread(swap_target, self.url, self.swap_to)
                self.swap = {"t0": t0, "t1": time.monotonic() - t_start, "ok": True, **res}
            except Exception as e:  # noqa: BLE001 - recorded; the soak goes on
                self.swap = {"t0": t0, "t1": time.monotonic() - t_start, "ok": False,
                             "error": str(e)[:300]}

        async with aiohttp.ClientSession(timeout=timeout) as http:
            tasks = [client(http) for _ in range(self.concurrency)] + [sampler()]
            if self.swap_to and self.swap_at > 0:
                tasks.append(swapper())
            await asyncio.gather(*tasks)
        for r in self.records:
            if r.token_ids is not None:
                r.phase = self.phase(r)

    def phase(self, r: Record) -> str:
        if not self.swap.get("ok"):
            return "base"
        if r.t1 < self.swap["t0"]:
            return "base"
        return "swapped" if r.t0 > self.swap["t1"] else "straddle"

    def _metrics(self) -> dict[str, float]:
        try:
            m = scrape(self.url)
        except OSError:
            return {}
        return {k: m.get(name, 0.0) for k, name in METRICS.items()}


def rpc(url: str, method: str, *args: str, timeout: float = 600) -> Any:
    """The first worker's answer to `method` over vLLM's dev-mode /collective_rpc
    (VLLM_SERVER_DEV_MODE=1)."""
    req = urllib.request.Request(url + "/collective_rpc", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"method": method, "args": list(args)}).encode())
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["results"][0]


def swap_target(url: str, folder: str) -> dict:
    """The worker's in-place target swap, then the prefix cache reset: its K/V came from the
    old weights (serving/target_swap.py)."""
    out = rpc(url, "onlinespec_swap_target", str(folder))
    out = out if isinstance(out, dict) else {"result": out}
    reset = urllib.request.Request(url + "/reset_prefix_cache?reset_running_requests=true",
                                   method="POST", data=b"")
    with urllib.request.urlopen(reset, timeout=600) as r:
        out["prefix_cache_reset"] = r.status == 200
    return out


# -- processes ------------------------------------------------------------------------------------

def process_tree(pid: int | None) -> list[int]:
    """pid and all its descendants (from /proc: vLLM's engine core and workers)."""
    if pid is None:
        return []
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def process_rss(pid: int | None) -> dict[str, float]:
    """RSS in MB of pid's process tree, keyed '<name>-<pid>' (the engine core names itself
    VLLM::EngineCore)."""
    out = {}
    for p in process_tree(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
            rss = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{p}/status").read_text(), re.M)
        except OSError:
            continue
        if rss:
            out[f"{name}-{p}"] = int(rss.group(1)) / 1024
    return out


class Server:
    """`vllm serve` in a session of its own (killed with its engine processes), logs to a file."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log, self.env = cmd, log, env or {}
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 900) -> float:
        t0 = time.monotonic()
        with open(self.log, "a") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, **self.env})
        try:
            wait_healthy(self.url, self.proc, timeout)
        except Exception:
            self.kill()
            raise
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL to the server and every engine process (its session)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def stop(self) -> int:
        """SIGINT (the worker writes its final checkpoint); SIGKILL after 90 s."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9


def serve_command(target: str, drafter: str, port: int, ckpt_dir: Path, dtype: str,
                  max_model_len: int, online: dict | None = None) -> list[str]:
    """The soak's server: the cpu preset learning, a checkpoint at every publish, what OpenAI's
    API refuses refused (StrictRequests: unknown fields, an empty chat)."""
    from vllm_onlinespec.bench.arm_catalog import base_settings, make_arm, merge_sections
    from vllm_onlinespec.bench.concurrency import serve_cmd

    settings = merge_sections(base_settings("cpu"), {"checkpoint": {"dir": str(ckpt_dir),
                                                                     "every_n_versions": 1}})
    settings = merge_sections(settings, online or {})
    spec = make_arm("online-ogd", target=target, prompts="", out_dir=ckpt_dir.parent,
                    drafter=drafter, online=settings, dtype=dtype, max_model_len=max_model_len)
    return serve_cmd(spec, port) + ["--middleware", STRICT_MIDDLEWARE]


# -- after the run --------------------------------------------------------------------------------

def long_prompt(tokenizer: Any, max_model_len: int, max_tokens: int) -> str:
    """A user message whose chat prompt is at most max_model_len - max_tokens - 32 tokens, and
    within one sentence of it."""
    budget = max_model_len - max_tokens - 32

    def text(n: int) -> str:
        return " ".join(f"Fact {i}: {i} plus {i} is {2 * i}." for i in range(n)) + \
            " Which fact mentions 7?"

    def length(n: int) -> int:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text(n)}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])

    lo, hi = 0, 1
    while length(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # length(lo) <= budget < length(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= budget else (lo, mid)
    return text(lo)


def greedy_reference(records: list[Record], targets: dict[str, str], max_tokens: int) -> dict:
    """Compare every greedy answer with the HF target's float32 greedy continuation of the same
    prompt tokens, on the target of its phase. {"compared", "mismatches", "straddling",
    "first_mismatch"}."""
    import torch
    from transformers import AutoModelForCausalLM

    out: dict[str, Any] = {"compared": 0, "mismatches": 0, "straddling": 0, "mismatched": []}
    todo = [r for r in records if r.token_ids is not None and r.prompt_ids]
    out["straddling"] = sum(r.phase == "straddle" for r in todo)
    for phase, folder in targets.items():
        rows = [r for r in todo if r.phase == phase]
        if not rows:
            continue
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        cache: dict[tuple, list[int]] = {}
        for r in rows:
            key = (tuple(r.prompt_ids), len(r.token_ids))
            if key not in cache:
                ids = torch.tensor([r.prompt_ids])
                with torch.no_grad():
                    g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=len(r.token_ids))
                cache[key] = g[0, ids.shape[1]:].tolist()
            out["compared"] += 1
            want = cache[key]
            if want != r.token_ids:
                out["mismatches"] += 1
                at = next((j for j, (a, b) in enumerate(zip(want, r.token_ids)) if a != b),
                          min(len(want), len(r.token_ids)))
                out["mismatched"].append({"i": r.i, "kind": r.kind, "phase": phase,
                                          "t0": round(r.t0, 1), "prompt_tokens": len(r.prompt_ids),
                                          "first_difference": at})
        del hf
    return out


def per_minute(soak: Soak) -> list[dict]:
    rows = []
    for m in range(int(max(1.0, soak.duration_s) // 60 + (soak.duration_s % 60 > 0))):
        lo, hi = 60.0 * m, 60.0 * (m + 1)
        done = [r for r in soak.records if lo <= r.t1 < hi]
        smp = [s for s in soak.samples if s.t < hi]
        last = smp[-1] if smp else None
        tpots = [r.tpot_ms for r in done if r.tpot_ms is not None]
        rows.append({
            "minute": m + 1,
            "served": dict(Counter(r.kind for r in done if r.ok and not r.malformed)),
            "failed": dict(Counter(r.kind for r in done if not r.ok and not r.malformed)),
            "malformed_4xx": sum(r.ok for r in done if r.malformed),
            "statuses": {str(k): v for k, v in Counter(r.status for r in done).items()},
            "tok_s": round(sum(r.tokens for r in done if not r.malformed)
                           / (min(hi, soak.duration_s) - lo), 2),
            "tpot_p50_ms": percentile(tpots, 0.5), "tpot_p99_ms": percentile(tpots, 0.99),
            "rss_mb": {k: round(v, 1) for k, v in last.rss_mb.items()} if last else {},
            **({k: last.metrics.get(k) for k in METRICS} if last else {})})
    return rows


def rss_growth(samples: list[Sample], from_s: float) -> tuple[float | None, str | None]:
    """The largest fractional RSS growth over vLLM's processes, from the first sample at or after
    from_s to the last sample (the process named)."""
    later = [s for s in samples if s.t >= from_s]
    if len(later) < 2:
        return None, None
    first, last = later[0].rss_mb, later[-1].rss_mb
    growth = {k: (last[k] - first[k]) / first[k] for k in first if k in last and first[k] > 0}
    if not growth:
        return None, None
    worst = max(growth, key=growth.get)
    return round(growth[worst], 4), worst


def summary(soak: Soak, greedy: dict, kills: list[dict]) -> dict:
    wf = [r for r in soak.records if not r.malformed]
    bad = [r for r in soak.records if r.malformed]
    rss_from = min(300.0, soak.duration_s / 3)  # minute 5; a short smoke run: its first third
    growth, worst = rss_growth(soak.samples, rss_from)
    last = soak.samples[-1].metrics if soak.samples else {}
    first = soak.samples[0].metrics if soak.samples else {}
    return {
        "duration_s": round(soak.samples[-1].t if soak.samples else 0.0, 1),
        "requests": len(soak.records), "wellformed": len(wf),
        "failed_wellformed": sum(not r.ok for r in wf),
        "aborted_by_client": sum(r.dropped for r in wf),
        "malformed_total": len(bad), "malformed_4xx": sum(r.ok for r in bad),
        "malformed_statuses": {k: dict(Counter(r.status for r in bad if r.kind == k))
                               for k in MALFORMED},
        "rss_growth": growth, "rss_growth_process": worst, "rss_from_s": rss_from,
        "learner_errors": last.get("errors"), "hook_errors": last.get("hook_errors"),
        "learner_updates": (last.get("updates", 0) or 0) - (first.get("updates", 0) or 0),
        "publishes": (last.get("publishes", 0) or 0) - (first.get("publishes", 0) or 0),
        "drafter_version": last.get("version"),
        "swap": soak.swap, "greedy": greedy,
        "output_tok_s": round(sum(r.tokens for r in wf) / max(soak.duration_s, 1e-9), 2),
        "kills": kills,
    }


# -- kills ----------------------------------------------------------------------------------------

def _traffic(url: str, stop: Any) -> None:
    """Short greedy requests back to back (feedback for the learner) until stop is set."""
    body = json.dumps({"model": SERVED_NAME, "max_tokens": 24, "temperature": 0.0,
                       "messages": [{"role": "user", "content": ""}]})
    i = 0
    while not stop.is_set():
        b = json.loads(body)
        b["messages"][0]["content"] = QUESTIONS[i % len(QUESTIONS)]
        i += 1
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(b).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:  # the server was killed under it
            return


def _partial(ckpt_dir: Path) -> set[str]:
    """Checkpoint folders being written (or left half-written by a kill): learner/checkpoint.py
    writes into `<name>.tmp-XXXX` and renames it once complete."""
    return {p.name for p in ckpt_dir.iterdir() if ".tmp-" in p.name} if ckpt_dir.is_dir() else set()


def kill_and_resume(server: Server, ckpt_dir: Path, moment: str, timeout: float = 300) -> dict:
    """SIGKILL the running server at `moment` ("update": while the learner holds a batch;
    "checkpoint": while a checkpoint folder is being written), restart it with the same command,
    and check what it resumed. The figures of one kill as a dict."""
    import threading

    from vllm_onlinespec.learner import checkpoint as ckpt

    stop = threading.Event()
    feeder = threading.Thread(target=_traffic, args=(server.url, stop), daemon=True)
    feeder.start()
    out: dict[str, Any] = {"moment": moment, "caught": False}
    deadline = time.monotonic() + timeout
    # A folder an earlier kill left stays (removed once stale): only a new one is this write.
    earlier = _partial(ckpt_dir)
    try:
        while time.monotonic() < deadline and server.proc.poll() is None:
            if moment == "checkpoint":
                if _partial(ckpt_dir) - earlier:
                    server.kill()
                    break
                time.sleep(0.001)
            else:
                st = rpc(server.url, "onlinespec_stats", timeout=30).get("learner", {})
                if st.get("in_update"):
                    server.kill()
                    out["update_ms_ema"] = st.get("update_ms_ema")
                    break
                time.sleep(0.02)
        else:
            raise TimeoutError(f"kill at {moment}: the moment did not come in {timeout:.0f} s")
    finally:
        stop.set()
        server.kill()
        feeder.join(timeout=70)
    left = sorted(_partial(ckpt_dir) - earlier)
    out["tmp_left"] = left  # checkpoint folders this kill left half-written
    out["caught"] = bool(left) if moment == "checkpoint" else True
    newest = ckpt.load_latest(ckpt_dir)
    out["newest_complete"] = newest.version if newest is not None else None
    log_from = server.log.stat().st_size
    out["restart_s"] = round(server.start(), 1)
    lines = server.log.read_text(errors="replace")[log_from:].splitlines()
    said = [ln for ln in lines if "onlinespec: resumed drafter version" in ln
            or "unusable checkpoint" in ln]
    out["said"] = [re.sub(r"^.*?(onlinespec: )", r"\1", ln) for ln in said]
    m = re.search(r"resumed drafter version (\d+)", " ".join(said))
    out["resumed_version"] = int(m.group(1)) if m else None
    if newest is not None:
        state = {k.removeprefix("drafter."): v for k, v in newest.model_state.items()
                 if k.startswith("drafter.")}
        served = str(rpc(server.url, "onlinespec_digest", timeout=60))
        out["digest_equal"] = served == ckpt.state_digest(state)
    req = urllib.request.Request(server.url + "/v1/chat/completions", headers={
        "Content-Type": "application/json"}, data=json.dumps({
            "model": SERVED_NAME, "max_tokens": 8, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Say hi."}]}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        out["answered"] = json.loads(r.read())["usage"]["completion_tokens"] > 0
    out["ok"] = bool(out["caught"] and out["answered"] and newest is not None
                     and out["resumed_version"] == newest.version and out.get("digest_equal"))
    return out


# -- report ---------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    s, rows = result["summary"], result["minutes"]
    g = s["greedy"]
    lines = [
        "# Served soak with faults", "",
        f"`{result['command']}`", "",
        f"{result['box']}; `vllm serve` with the `cpu` preset learning, {result['dtype']}, "
        f"{result['concurrency']} closed-loop clients, {result['max_tokens']} tokens per answer, "
        f"one request in {result['malformed_every']} malformed; the target swapped to "
        f"`{result['swap_to']}` at {result['swap_at']:.0%} of the run.", "",
        "| figure | value |", "|---|---|",
        f"| duration | {s['duration_s']:.0f} s |",
        f"| well-formed requests | {s['wellformed']} ({s['aborted_by_client']} dropped by the "
        "client mid-stream) |",
        f"| well-formed failed | **{s['failed_wellformed']}** |",
        f"| malformed answered 4xx | **{s['malformed_4xx']} / {s['malformed_total']}** |",
        f"| greedy answers equal to the target's greedy | **{g['compared'] - g['mismatches']} / "
        f"{g['compared']}** ({g['straddling']} straddled the swap, not compared) |",
        f"| RSS growth from {s['rss_from_s']:.0f} s to the end (largest process) | "
        f"**{_fmt_pct(s['rss_growth'])}** ({s['rss_growth_process']}) |",
        f"| learner errors / hook errors | **{s['learner_errors']:.0f}** / "
        f"{s['hook_errors']:.0f} |" if s["learner_errors"] is not None else
        "| learner errors | not read |",
        f"| learner updates / publishes, drafter version at the end | {s['learner_updates']:.0f} "
        f"/ {s['publishes']:.0f}, v{s['drafter_version']:.0f} |"
        if s["drafter_version"] is not None else "| learner | not read |",
        f"| output tok/s (whole run) | {s['output_tok_s']} |",
        f"| target swap | {_swap(s['swap'])} |", "",
        "Malformed requests, HTTP statuses by kind: " + "; ".join(
            f"{k} {v}" for k, v in s["malformed_statuses"].items()) + ".", "",
        "## Per minute", "",
        "| min | served | failed | malformed 4xx | statuses | tok/s | TPOT p50 / p99 ms | "
        "RSS MB (largest) | buffer tokens | updates | publishes | version |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rss = max(r["rss_mb"].values()) if r["rss_mb"] else float("nan")
        lines.append(
            f"| {r['minute']} | {sum(r['served'].values())} | {sum(r['failed'].values())} | "
            f"{r['malformed_4xx']} | {', '.join(f'{k}: {v}' for k, v in sorted(r['statuses'].items()))} | "
            f"{r['tok_s']} | {_ms(r['tpot_p50_ms'])} / {_ms(r['tpot_p99_ms'])} | {rss:.0f} | "
            f"{_n(r.get('buffer_tokens'))} | {_n(r.get('updates'))} | {_n(r.get('publishes'))} | "
            f"{_n(r.get('version'))} |")
    if s["kills"]:
        lines += ["", "## Killed and restarted with the same command", "",
                  "| SIGKILL during | caught there | newest complete checkpoint | resumed | "
                  "served drafter = checkpoint | answered | restart s | what it said |",
                  "|---|---|---|---|---|---|---|---|"]
        for k in s["kills"]:
            lines.append(
                f"| {k['moment']} | {'yes' if k['caught'] else 'no'}"
                f"{' (' + ', '.join(k['tmp_left']) + ' left)' if k.get('tmp_left') else ''} | "
                f"v{k['newest_complete']} | v{k['resumed_version']} | "
                f"{'yes' if k.get('digest_equal') else 'NO'} | "
                f"{'yes' if k.get('answered') else 'NO'} | {k['restart_s']} | "
                f"{'<br>'.join('`' + x + '`' for x in k['said']) or '(nothing)'} |")
    return "\n".join(lines) + "\n"


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} %"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _swap(sw: dict) -> str:
    if not sw:
        return "none"
    if not sw.get("ok"):
        return f"FAILED at {sw['t0']:.0f} s: {sw.get('error')}"
    return (f"at {sw['t0']:.0f} s, {sw['t1'] - sw['t0']:.1f} s over the RPC, "
            f"{sw.get('dropped_tokens', 0)} stale feedback tokens dropped")


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, samples = result["minutes"], result["samples"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    mins = [r["minute"] for r in rows]
    ax[0].plot(mins, [r["tok_s"] for r in rows], "o-", label="output tok/s")
    ax0 = ax[0].twinx()
    ax0.plot(mins, [r["tpot_p50_ms"] or float("nan") for r in rows], "s--", color="C1",
             label="TPOT p50 ms")
    ax[0].set(xlabel="minute", ylabel="tok/s", title="throughput and TPOT p50 (dashed)")
    ax0.set_ylabel("ms")
    for name in sorted({k for s in samples for k in s["rss_mb"]}):
        pts = [(s["t"] / 60, s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
        ax[1].plot(*zip(*pts), label=name)
    ax[1].set(xlabel="minute", ylabel="MB", title="RSS of each vLLM process; feedback buffer (dotted)")
    ax[1].legend(fontsize=7)
    buf = [(s["t"] / 60, s["metrics"]["buffer_tokens"]) for s in samples
           if s["metrics"].get("buffer_tokens") is not None]
    if buf:
        ax1 = ax[1].twinx()
        ax1.plot(*zip(*buf), ":", color="black")
        ax1.set_ylabel("feedback buffer, tokens")
        ax1.set_ylim(bottom=0)
    t = [s["t"] / 60 for s in samples]
    ax[2].plot(t, [s["metrics"].get("updates", float("nan")) for s in samples], label="updates")
    ax[2].plot(t, [s["metrics"].get("publishes", float("nan")) for s in samples],
               label="publishes")
    ax[2].plot(t, [s["metrics"].get("errors", float("nan")) for s in samples], label="errors")
    ax[2].set(xlabel="minute", title="learner counters")
    ax[2].legend(fontsize=7)
    sw = result["summary"]["swap"]
    if sw.get("ok"):
        for a in ax:
            a.axvline(sw["t0"] / 60, color="grey", ls=":")
    fig.suptitle("vllm serve, cpu preset learning: mixed traffic with faults (dotted: target swap)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the verb -------------------------------------------------------------------------------------

def box() -> str:
    import platform

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                  .splitlines() if ln.startswith("model name")), platform.processor())
    return f"{os.cpu_count()}-vCPU {model}"


def run_soak(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_onlinespec.models import resolve, shipped_drafter
    from vllm_onlinespec.serving_dtype import resolve_dtype

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, swap_to = str(resolve(args.target)), str(resolve(args.swap_to)) if args.swap_to else None
    drafter = args.drafter or str(shipped_drafter(args.target))
    dtype = resolve_dtype(args.dtype)
    ckpt_dir = out / "checkpoints"
    import shutil

    shutil.rmtree(ckpt_dir, ignore_errors=True)  # a rerun starts from the drafter
    cmd = serve_command(target, drafter, free_port(), ckpt_dir, dtype, args.max_model_len,
                        json.loads(args.online))
    server = Server(cmd, out / "serve.log", {"VLLM_SERVER_DEV_MODE": "1",
                                             "VLLM_LOGGING_LEVEL": "INFO"})
    (out / "serve.log").write_text("")
    print(f"starting: {' '.join(cmd)}", flush=True)
    startup = server.start()
    print(f"server up in {startup:.0f} s; soaking {args.duration:.0f} s", flush=True)
    tok = AutoTokenizer.from_pretrained(target)
    soak = Soak(url=server.url, duration_s=args.duration, concurrency=args.concurrency,
                max_tokens=args.max_tokens, max_model_len=args.max_model_len,
                malformed_every=args.malformed_every, swap_at=args.swap_at, swap_to=swap_to,
                server_pid=server.proc.pid, seed=args.seed,
                long_prompt=long_prompt(tok, args.max_model_len, args.max_tokens))
    kills: list[dict] = []
    try:
        asyncio.run(soak.run())
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server died during the soak (code {server.proc.returncode}); "
                               f"log {server.log}")
        for moment in args.kills:
            for attempt in range(3):  # a write may end between seeing it and the kill: again
                print(f"kill during {moment} ...", flush=True)
                kills.append(kill_and_resume(server, ckpt_dir, moment) | {"attempt": attempt})
                print(f"  {kills[-1]}", flush=True)
                if kills[-1]["caught"]:
                    break
        rc_stop = server.stop()
    finally:
        server.kill()
    targets = {"base": target, **({"swapped": swap_to} if swap_to else {})}
    greedy = greedy_reference(soak.records, targets, args.max_tokens)
    result = {
        "command": "vllm-onlinespec bench-soak " + " ".join(sys.argv[2:]) if len(sys.argv) > 2
        else "vllm-onlinespec bench-soak", "box": box(), "dtype": dtype,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "malformed_every": args.malformed_every, "swap_at": args.swap_at,
        "swap_to": args.swap_to, "startup_s": round(startup, 1),
        "server_command": [Path(cmd[0]).name] + [c.replace(drafter, "DRAFTER").replace(target, "TARGET")
                                                  for c in cmd[1:]],
        "stop_exit_code": rc_stop,
        "summary": summary(soak, greedy, kills), "minutes": per_minute(soak),
        "samples": [asdict(s) for s in soak.samples],
        "failures": [asdict(r) | {"prompt_ids": None, "token_ids": None}
                     for r in soak.records if not r.ok][:50]}
    docs = Path(args.docs) if args.docs else out
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "soak.json").write_text(json.dumps(result, indent=1))
    (docs / "soak.md").write_text(markdown(result))
    plot(result, docs / "soak.png")
    print(markdown(result))
    s = result["summary"]
    ok = (s["failed_wellformed"] == 0 and s["malformed_4xx"] == s["malformed_total"]
          and not s["learner_errors"] and greedy["mismatches"] == 0
          and all(k["ok"] or not k["caught"] for k in kills) and rc_stop == 0
          and all(any(k["moment"] == m and k["ok"] for k in kills) for m in args.kills))
    print(f"soak: {'PASSED' if ok else 'FAILED'} ({docs / 'soak.md'})")
    return 0 if ok else 1


def _kills(text: str) -> list[str]:
    moments = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in moments if m not in KILL_MOMENTS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown kill moment(s) {bad}; known: "
                                         f"{', '.join(KILL_MOMENTS)}")
    return moments


def add_bench_soak_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench-soak", help="`vllm serve` learning under mixed traffic with faults "
                       "for a set time, then kills and restarts", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a = b.add_argument
    a("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    a("--concurrency", type=int, default=4, help="closed-loop clients (default 4)")
    a("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    a("--max-model-len", type=int, default=2048, help="the server's context (default 2048)")
    a("--malformed-every", type=int, default=10, help="one request in N malformed (default 10)")
    a("--swap-at", type=float, default=0.5, help="fraction of the duration at which the target "
      "is swapped (default 0.5; 0 = no swap)")
    a("--swap-to", default="smollm2-135m-terse", help="known model swapped in (`model pull` it "
      "first; default smollm2-135m-terse)")
    a("--target", default="smollm2-135m")
    a("--drafter", help="DFlash drafter folder (default: the one shipped for --target)")
    a("--dtype", default="float32", help="float32 (default: greedy answers compared exactly), "
      "bfloat16 or auto")
    a("--seed", type=int, default=0, help="the traffic mix's seed")
    a("--online", default="{}", help="JSON merged into the server's onlinespec settings")
    a("--kills", default="update,checkpoint", type=_kills, help="after the soak, SIGKILL the "
      "server during these moments, each followed by a restart with the same command: "
      "'update' (the learner holds a batch), 'checkpoint' (a checkpoint folder is being "
      "written); default update,checkpoint; '' = none")
    a("--docs", help="folder for soak.{md,json,png} (default: --out)")
    a("--out", required=True, help="server log and checkpoints")
    b.set_defaults(func=run_soak)
