"""What an arm is asked to do and what it measured: plain dataclasses, JSON on disk.

An arm's spec and result cross a process boundary (the arm runs in its own subprocess so that
every engine starts from a clean process), so both are JSON-serialisable.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from vllm_onlinespec.serving_dtype import AUTO, resolve_dtype


@dataclass
class ArmSpec:
    name: str
    target: str  # HF folder
    prompts: str  # jsonl of Prompt.to_json() rows, served in file order
    out: str  # result JSON path
    method: str = "none"  # "none" | "ngram" | "dflash"
    drafter: str | None = None
    num_speculative_tokens: int = 0
    # vLLM's scheduler-level K per batch size: [[first_bs, last_bs, K], ...], K >= 0 (None: off)
    k_per_batch_size: list[list[int]] | None = None
    onlinespec: dict | None = None  # additional_config["onlinespec"]; None = plain vLLM worker
    # bfloat16 where the hardware has it, else float32 (serving_dtype.py); float32 wherever
    # outputs must match exactly
    dtype: str = field(default_factory=lambda: resolve_dtype(AUTO))
    wave: int = 4  # prompts per wave: one llm.chat call, batched
    max_tokens: int = 128
    # 0 = greedy; > 0 samples at this temperature, each request seeded by its place in the
    # stream (the same seed for every arm), top-p 1
    temperature: float = 0.0
    max_model_len: int = 2048
    # Seconds the stream may pause after each wave while the learner still has fresh feedback:
    # real traffic has gaps, a closed-loop benchmark on 2 cores has none. 0 = back to back.
    catch_up_s: float = 0.0
    # The continuous protocols (bench/engine_loop.py): "closed:C" (C clients, each sends its next
    # request when the previous one finished) or "poisson:RATE" (requests/s, open loop); "" =
    # the wave protocol above. Windows of window_s seconds replace the waves in the result.
    arrivals: str = ""
    window_s: float = 20.0
    arrival_seed: int = 0  # the Poisson gaps
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the engine
    # Mid-stream target swap (continuous protocols only): before the swap_at-th request (1-based)
    # is sent, the target's weights are replaced in place by swap_to's (an HF folder), as an RL
    # loop or a fine-tuning job does; requests in flight run on.
    swap_at: int = 0  # 0 = no swap
    swap_to: str | None = None

    @property
    def speculative_config(self) -> dict | None:
        if self.method == "none":
            return None
        cfg: dict[str, Any] = {"method": self.method,
                               "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            cfg.update(prompt_lookup_min=2, prompt_lookup_max=4)
        elif self.method != "suffix":  # suffix decoding: trees over the text, no model
            cfg["model"] = self.drafter
        if self.k_per_batch_size is not None:
            cfg["num_speculative_tokens_per_batch_size"] = self.k_per_batch_size
        return cfg

    @property
    def learning(self) -> bool:
        return self.onlinespec is not None and self.onlinespec.get("enabled", True)


@dataclass
class WaveResult:
    index: int
    prompts: int
    output_tokens: int
    wall_s: float  # serving time only (catch-up pauses are counted in catch_up_s)
    drafts: int  # verify steps that carried a draft (vLLM counter delta)
    draft_tokens: int
    accepted: int
    tpot_ms: float  # mean over the wave's requests of (last - first token time) / (tokens - 1)
    version_start: int = 0  # published drafter version when the wave started / ended
    version_end: int = 0
    learner_updates: int = 0  # cumulative
    catch_up_s: float = 0.0
    t_start_s: float | None = None  # continuous protocols: the window's start in the stream

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verify step that carried a draft (1 = nothing accepted)."""
        return (self.accepted + self.drafts) / self.drafts if self.drafts else 1.0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class RequestResult:
    index: int  # position in the stream
    prompt_id: str
    category: str
    wave: int
    output_tokens: int
    tpot_ms: float
    acceptance_length: float | None = None  # vLLM's per-request spec metrics; None = no spec
    drafter_version: int = 0  # version published when the request's wave started (or it was sent)
    submit_s: float | None = None  # continuous protocols: sent / finished, s into the stream
    finish_s: float | None = None


@dataclass
class ArmResult:
    spec: ArmSpec
    waves: list[WaveResult] = field(default_factory=list)
    requests: list[RequestResult] = field(default_factory=list)
    startup_s: float = 0.0
    serve_s: float = 0.0
    learner: dict = field(default_factory=dict)  # final onlinespec_stats RPC dict (learning arms)
    # The worker's time per phase over the whole arm (serving/step_profile.py: steps, seconds
    # per phase, per_step_ms): where a learning arm's steps lose time against frozen's.
    step_profile: dict = field(default_factory=dict)
    error: str | None = None
    failed: list[str] = field(default_factory=list)  # "prompt id: error" of requests that failed
    # The mid-stream swap: {"t_s": on the windows' clock, "seconds", "request": swap_at, ...}
    swap: dict = field(default_factory=dict)

    @property
    def stats(self) -> "OnlineSpecStats":
        """The final worker stats, parsed (serving/stats.py); defaults for arms without them."""
        from vllm_onlinespec.serving.stats import OnlineSpecStats

        return OnlineSpecStats.from_dict(self.learner)

    @property
    def name(self) -> str:
        return self.spec.name

    # -- aggregates -------------------------------------------------------------------------
    def totals(self, waves: list[WaveResult] | None = None) -> dict[str, float]:
        ws = self.waves if waves is None else waves
        out_tok = sum(w.output_tokens for w in ws)
        wall = sum(w.wall_s for w in ws)
        drafts = sum(w.drafts for w in ws)
        acc = sum(w.accepted for w in ws)
        dtok = sum(w.draft_tokens for w in ws)
        return {"output_tokens": out_tok, "wall_s": wall, "tok_s": out_tok / wall if wall else 0.0,
                "acceptance_length": (acc + drafts) / drafts if drafts else 1.0,
                "draft_acceptance": acc / dtok if dtok else 0.0, "drafts": drafts,
                "tpot_ms": _mean([w.tpot_ms for w in ws if w.tpot_ms == w.tpot_ms])}

    def halves(self) -> tuple[dict, dict]:
        """Totals over the first and the second half of the stream: the split between waves
        (or time windows) that comes nearest half the output tokens, the later split on a tie.
        Not by wave count: a continuous protocol's last window is often a short tail (a few
        steps after the last full window), which would then be all of the "second half"."""
        h = self._half()
        return self.totals(self.waves[:h]), self.totals(self.waves[h:])

    def _half(self) -> int:
        if len(self.waves) < 2:
            return len(self.waves)
        total, cum, best = sum(w.output_tokens for w in self.waves), 0, (float("inf"), 1)
        for h, w in enumerate(self.waves[:-1], start=1):
            cum += w.output_tokens
            best = min(best, (abs(2 * cum - total), -h))
        return -best[1]

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        for w, wd in zip(self.waves, d["waves"]):
            wd.update(acceptance_length=w.acceptance_length, tok_s=w.tok_s)
        d["totals"] = self.totals()
        d["early"], d["late"] = self.halves()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ArmResult":
        return cls(spec=_build(ArmSpec, d["spec"]),
                   waves=[_build(WaveResult, w) for w in d.get("waves", [])],
                   requests=[_build(RequestResult, r) for r in d.get("requests", [])],
                   startup_s=d.get("startup_s", 0.0), serve_s=d.get("serve_s", 0.0),
                   learner=d.get("learner", {}), step_profile=d.get("step_profile", {}),
                   error=d.get("error"),
                   failed=d.get("failed", []), swap=d.get("swap", {}))

    def save(self, path: str | os.PathLike | None = None) -> Path:
        p = Path(path or self.spec.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, default=_jsonable))
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ArmResult":
        return cls.from_json(json.loads(Path(path).read_text()))


def _build(cls, d: dict):
    """Dataclass from a dict, ignoring derived keys (tok_s, acceptance_length) written by to_json."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _jsonable(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def percentile(xs: Sequence[float | None], q: float) -> float | None:
    """Nearest-rank q-quantile of the values given (None ignored); None when there are none."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def write_result_files(out: str | os.PathLike, name: str, md_lines: list[str], data: Any,
                       publish_dir: str | os.PathLike | None = None) -> None:
    """<out>/<name>.md and <name>.json (a benchmark's report), also copied into `publish_dir`
    (docs/results) when given."""
    import shutil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(md_lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    if publish_dir is not None:
        for ext in ("md", "json"):
            shutil.copy(out / f"{name}.{ext}", Path(publish_dir) / f"{name}.{ext}")
