"""`vllm-onlinespec bench-rl`: speculative decoding for RL rollouts, a new policy every round.

    flock /tmp/onlinespec-engine.lock vllm-onlinespec bench-rl --prompts gsm8k/train.jsonl \\
        --versions smollm2-135m,smollm2-135m-terse --gap-s 0,20 --out results/rl

An RL loop alternates rollouts and training: the rollout engine samples n answers per prompt
(temperature 1, top-p 1, seeded), then idles while the trainer updates the policy (the gap),
then the new weights are pushed into the engine in place and the next round samples again.
Every arm (each in its own process and engine, as `bench` runs them) starts on version 0 and, for
round r = 0..R-1: pushes version r's weights (r > 0; `push_target` with the version's state
dict, or `--push folder`: `swap_target`; vLLM's own arms reload the folder through vLLM's
`reload_weights`), samples the round's prompts x n (one `llm.chat` call; the wall time is that
call, everything in it counted), then idles for the gap, in which a learning arm's learner trains
at full share (worker RPC `onlinespec_idle`: back early once it has caught up; the other arms
have nothing to do there and skip it). Every arm sees the same prompts, seeds and versions;
arms run in two orders (as given, then reversed) so that the box's drift weighs on all alike.
Arms that do not learn are the same whatever the gap, so they run once per order; the learning
arms run once per order and gap.

Arms (bench/arm_catalog.py): nospec, vllm-suffix, vllm-ngram (vLLM's prompt lookup, the
catalog's `ngram`), frozen (the `cpu` preset with learning off), online (the `cpu` preset,
learning: the catalog's `online-ogd`), or any other catalog arm. The same seeds give the same
tokens in every arm of ours (drafter-invariant verification: the text depends on the seed and
the policy only), but not in vLLM's arms (vLLM's seeded sampler and rejection sampling draw other
tokens), so their rounds serve other text with other tails; `k0` (this worker drafting nothing)
is plain decoding on our arms' text.

Per round and arm: wall_s, tok_s (output tokens / wall_s), accept_len ((accepted + drafts) /
drafts from vLLM's counters), drafter_accept (accepted tokens per request-step that verified the
drafter's block: vLLM's counters less the prompt lookup's rows; null for vLLM's arms),
gate_shut_share (share of the budget's gated steps it shut), option_shares (share of the round's
steps the budget ran plain / tree / drafter on) and option_ms_per_token (what each option's
measured cycles cost per produced token, by batch bucket, at the round's end), step_ms (the
round's engine steps and ms per step of each worker phase, serving/step_profile.py), learner
updates during the round and the gap, gap_s_used, push_s, learner_gain (the learner's own
paired estimate after the gap: accepted draft tokens per block, current minus start weights on
the same fresh verified text, scored before the learner trains on it) and learner_gain_t (its
t-statistic). The report (<out>/rl_rollouts.{json,md,png}) gives per arm the median over orders
of the last half of the rounds, and online / frozen and online / vllm-suffix; its plot, accept
len and tok/s per round, and the learner's gain per round where a learning arm reports it.

Prompts: `--prompts FILE` (JSONL, 'prompt', 'question' (GSM8K) or 'messages'), taken in file
order from its last `--tail` rows (default 1000: GSM8K train's served-only slice, which no
drafter trains on, training/prompt_sets.py GSM8K_SERVED; 0 = the whole file), after `--skip`.
Expected wall time on a 2-vCPU box (defaults: 8 prompts x n=4 x 64 tokens, 2 versions): 85-160 s
per arm run (engine start ~40 s, 22-36 s per round, a push 1-5 s, the gaps), so ~20 min for the
default 5 arms x 2 orders (measured: 4 arms with gaps 0,20 = 5 runs x 2 orders, 20 min); each
further gap adds the learning arms again plus R x gap seconds each; `--quick` (2 prompts x n=2
x 16 tokens, arms nospec,online, both orders) ~5 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from vllm_onlinespec.bench.arm_process import PROGRESS_TAG, progress
from vllm_onlinespec.bench.report import STEP_PHASES
from vllm_onlinespec.training.prompt_sets import GSM8K_SERVED

DEFAULT_ARMS = "nospec,vllm-suffix,vllm-ngram,frozen,online"
# RL names -> the arm catalog's (bench/arm_catalog.py)
ALIASES = {"vllm-ngram": "ngram", "online": "online-ogd"}
RESULT_NAME = "rl_rollouts"
ROW_METRICS = ("tok_s", "accept_len", "drafter_accept", "gate_shut_share")


# -- the schedule: the same for every arm ---------------------------------------------------

@dataclass
class Round:
    index: int
    version: int  # index into the versions' folders
    prompts: list[list[dict]]  # chat messages per prompt
    seeds: list[int]  # per prompt; vLLM gives sample j of a prompt seed + j


def read_prompts(path: str | Path, count: int, skip: int = 0, tail: int = 0) -> list[list[dict]]:
    """`count` prompts (chat messages) from a JSONL file, in file order after `skip`, from its
    last `tail` rows only (0 = all): rows with 'prompt', 'question' (GSM8K) or 'messages'."""
    from vllm_onlinespec.bench.prompts import PromptFileError, prompt_from_row
    from vllm_onlinespec.jsonl import iter_jsonl

    rows = list(iter_jsonl(Path(path), PromptFileError))
    out: list[list[dict]] = []
    for n, row in rows[max(0, len(rows) - tail) if tail else 0:][skip:]:
        if isinstance(row, dict) and "prompt" not in row and "question" in row:
            row = {**row, "prompt": row["question"]}
        try:
            out.append(prompt_from_row(row, str(n)).messages)
        except ValueError as e:
            raise PromptFileError(f"{path}:{n}: {e}") from None
        if len(out) == count:
            return out
    raise ValueError(f"{path}: {len(out)} prompts after skipping {skip}"
                     f"{f' of the last {tail} rows' if tail else ''}; the schedule needs {count}")


def schedule(prompts: Sequence[list[dict]], *, rounds: int, versions: int, per_round: int, n: int,
             seed: int = 0) -> list[Round]:
    """Round r serves prompts [r * per_round, (r + 1) * per_round) on version min(r, versions - 1)
    (RL samples fresh prompts every round); prompt i of round r has seed
    seed + (r * per_round + i) * n, so no two samples of the run share one."""
    if len(prompts) < rounds * per_round:
        raise ValueError(f"{rounds} rounds x {per_round} prompts need {rounds * per_round} "
                         f"prompts, got {len(prompts)}")
    return [Round(index=r, version=min(r, versions - 1),
                  prompts=list(prompts[r * per_round:(r + 1) * per_round]),
                  seeds=[seed + (r * per_round + i) * n for i in range(per_round)])
            for r in range(rounds)]


@dataclass
class Unit:
    """One arm run: an arm, the gap it idles for after each round (0 for arms without a
    learner: nothing happens in their gap)."""

    arm: str
    gap_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.arm} gap {self.gap_s:g}s" if self.gap_s else self.arm


def units(arms: Sequence[str], gaps: Sequence[float], learns) -> list[Unit]:
    """Each learning arm once per gap, every other arm once (gap 0)."""
    out: list[Unit] = []
    for a in arms:
        out += [Unit(a, g) for g in gaps] if learns(a) else [Unit(a, 0.0)]
    return out


def run_order(n: int, order: int) -> list[int]:
    """Forward on order 0, reversed on order 1 (launch.counterbalanced)."""
    from vllm_onlinespec.bench.launch import counterbalanced

    return counterbalanced(n, order)


# -- one arm run, in its own process ---------------------------------------------------------

@dataclass
class RLArmSpec:
    arm: dict  # ArmSpec as a dict (the engine, speculative and onlinespec settings)
    label: str
    order: int
    gap_s: float
    versions: list[str]  # HF folders, version 0 first
    rounds: list[dict]  # Round as dicts
    n: int
    max_tokens: int
    push: str  # "state_dict" | "folder"
    out: str
    arm_name: str = ""  # as the user named it (online, vllm-ngram), "" = the catalog's


def load_state_dict(folder: str | Path) -> dict:
    from safetensors.torch import load_file

    sd: dict = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def push_version(llm, arm, folder: str, mode: str) -> float:
    """Replace the served target by `folder`'s weights in place; seconds taken."""
    from vllm_onlinespec.bench.arm_process import swap_weights

    if arm.onlinespec is not None and mode == "state_dict":
        from vllm_onlinespec.serving.target_swap import push_target

        t0 = time.perf_counter()
        push_target(llm, load_state_dict(folder))
        return time.perf_counter() - t0
    # swap_target for our worker, vLLM's reload_weights(weights_path=) for its own workers
    return swap_weights(llm, dataclasses.replace(arm, swap_to=folder))["seconds"]


def _delta_ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def learner_gain(st, field: str = "gain_mean") -> float | None:
    """The learner's own paired estimate (accepted draft tokens per block, current minus start
    weights on the same fresh verified text, mean over its scoring window; `gain_t`: its
    t-statistic against 0), or None."""
    g = getattr(st.learner, field) if st is not None and st.learner is not None else math.nan
    return None if g is None or not math.isfinite(g) else round(float(g), 4)


def step_ms(p0: dict, p1: dict, wall: float) -> dict[str, float] | None:
    """The round's engine steps: their count and mean ms per step of each worker phase
    (serving/step_profile.py), `engine` = the round's wall time per step less the worker's
    phases (scheduler, hand-offs, output processing); None for arms on vLLM's own worker."""
    from dataclasses import fields

    from vllm_onlinespec.serving.step_profile import StepProfile

    if not p0 or not p1:
        return None
    d = StepProfile(**{f.name: p1[f.name] - p0[f.name] for f in fields(StepProfile)
                       if isinstance(p1.get(f.name), int | float)})
    if d.steps <= 0:
        return None
    ms = d.per_step_ms()
    ms["engine"] = max(0.0, 1e3 * wall / d.steps - sum(ms.values()))
    return {"steps": d.steps, **{k: round(v, 3) for k, v in ms.items()}}


def option_shares(st0, st1) -> dict[str, float] | None:
    """Share of the round's steps the budget ran each option on (policy/option_choice.py), or
    None where the budget chose no option."""
    a, b = st0.cutter.option_steps, st1.cutter.option_steps
    d = {o: b.get(o, 0) - a.get(o, 0) for o in b}
    n = sum(d.values())
    return {o: round(v / n, 4) for o, v in d.items()} if n > 0 else None


def round_row(*, spec: RLArmSpec, rd: Round, wall: float, out_tokens: int, c0: dict, c1: dict,
              st0, st1, ours: bool, gap: dict, push_s: float) -> dict:
    """One round's record from vLLM's counters and the worker's stats before and after."""
    d = {k: c1[k] - c0[k] for k in c0}
    lk_rows = st1.lookup_rows - st0.lookup_rows
    lk_acc = st1.lookup_accepted - st0.lookup_accepted
    gates = st1.cutter.gate_steps - st0.cutter.gate_steps
    upd = (st1.learner.updates if st1.learner else 0) - (st0.learner.updates if st0.learner else 0)
    return {"arm": spec.arm_name or spec.arm["name"], "label": spec.label, "order": spec.order,
            "gap_s": spec.gap_s,
            "round": rd.index, "version": rd.version, "requests": len(rd.prompts) * spec.n,
            "output_tokens": out_tokens, "wall_s": wall,
            "tok_s": out_tokens / wall if wall > 0 else 0.0,
            "accept_len": (d["accepted"] + d["drafts"]) / d["drafts"] if d["drafts"] else None,
            "drafts": d["drafts"], "draft_tokens": d["draft_tokens"], "accepted": d["accepted"],
            "drafter_accept": _delta_ratio(d["accepted"] - lk_acc, d["drafts"] - lk_rows)
            if ours else None,
            "lookup_rows": lk_rows if ours else None, "lookup_accepted": lk_acc if ours else None,
            "gate_shut_share": _delta_ratio(st1.cutter.gate_shut_steps - st0.cutter.gate_shut_steps,
                                            gates) if ours else None,
            "option_shares": option_shares(st0, st1) if ours else None,
            "option_ms_per_token": dict(st1.cutter.option_ms_per_token) if ours else None,
            "learner_updates_round": upd, "learner_updates_gap": int(gap["updates"]),
            "gap_s_used": gap["seconds"], "push_s": push_s,
            "drafter_version": st1.published_version}


def run_rounds(spec: RLArmSpec) -> dict:
    from vllm import SamplingParams

    from vllm_onlinespec.bench.arm_process import (make_llm, onlinespec_stats, spec_counters,
                                                   step_profile)
    from vllm_onlinespec.bench.results import ArmSpec

    arm = ArmSpec(**spec.arm)
    ours = arm.onlinespec is not None
    res: dict[str, Any] = {"label": spec.label, "order": spec.order, "rows": [], "tokens": []}
    t0 = time.perf_counter()
    llm = make_llm(arm)
    res["startup_s"] = time.perf_counter() - t0
    progress("started", startup_s=res["startup_s"], prompts=len(spec.rounds))
    served = 0  # the version index the engine serves
    try:
        for rdd in spec.rounds:
            rd = Round(**rdd)
            push_s = 0.0
            if rd.version != served:
                push_s = push_version(llm, arm, spec.versions[rd.version], spec.push)
                served = rd.version
            params = [SamplingParams(temperature=1.0, top_p=1.0, n=spec.n, seed=s,
                                     max_tokens=spec.max_tokens) for s in rd.seeds]
            st0, c0, p0 = onlinespec_stats(llm, arm), spec_counters(llm), step_profile(llm, arm)
            t = time.perf_counter()
            outs = llm.chat(rd.prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            c1, st1, p1 = spec_counters(llm), onlinespec_stats(llm, arm), step_profile(llm, arm)
            toks = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)]
                    for o in outs]
            gap = {"seconds": 0.0, "updates": 0}
            if spec.gap_s > 0 and arm.learning:
                gap = llm.collective_rpc("onlinespec_idle", args=(spec.gap_s,))[0]
            st2 = onlinespec_stats(llm, arm) if arm.learning else None  # after the gap's updates
            row = round_row(spec=spec, rd=rd, wall=wall, c0=c0, c1=c1, st0=st0, st1=st1,
                            out_tokens=sum(len(x) for p in toks for x in p), ours=ours, gap=gap,
                            push_s=push_s)
            row["learner_gain"] = learner_gain(st2)
            row["learner_gain_t"] = learner_gain(st2, "gain_t")
            row["step_ms"] = step_ms(p0, p1, wall)
            res["rows"].append(row)
            res["tokens"].append(toks)
            _save(res, spec.out)
            progress("wave", index=rd.index, prompts=1, acceptance_length=row["accept_len"] or 1.0,
                     tok_s=row["tok_s"], version=rd.version)
    finally:
        _save(res, spec.out)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - the result is saved; exiting cleans up the rest
            pass
    return res


def _save(res: dict, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(res))
    os.replace(tmp, p)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = RLArmSpec(**json.loads(Path(argv[0]).read_text()))
    try:
        run_rounds(spec)
    except Exception as e:  # noqa: BLE001 - the runner reads the error from the result file
        import traceback

        traceback.print_exc()
        p = Path(spec.out)
        res = json.loads(p.read_text()) if p.is_file() else {"rows": []}
        res["error"] = f"{type(e).__name__}: {e}"
        _save(res, spec.out)
        return 1
    progress("done")
    return 0


def run_unit(spec: RLArmSpec, log_dir: Path, engine_lock: str | None) -> dict:
    """The arm run in its own process (optionally under `flock engine_lock`), its engine's log
    in log_dir; its result dict."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{spec.label.replace(' ', '_')}.order{spec.order}"
    spec_path = log_dir / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    Path(spec.out).unlink(missing_ok=True)
    from vllm_onlinespec.bench.arm_catalog import clear_own_checkpoints
    from vllm_onlinespec.bench.results import ArmSpec

    clear_own_checkpoints(ArmSpec(**spec.arm))
    cmd = [sys.executable, "-m", "vllm_onlinespec.bench.rl", str(spec_path)]
    if engine_lock:
        cmd = ["flock", engine_lock, *cmd]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(log_dir / f"{stem}.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith(PROGRESS_TAG):
                log.write(line)
                continue
            ev = json.loads(line[len(PROGRESS_TAG):])
            if ev["event"] == "wave":
                print(f"  {spec.label} (order {spec.order}) round {ev['index']}: "
                      f"{ev['tok_s']:.1f} tok/s, accept len {ev['acceptance_length']:.2f}",
                      flush=True)
        rc = proc.wait()
    p = Path(spec.out)
    res = json.loads(p.read_text()) if p.is_file() else {"rows": []}
    if rc != 0 and "error" not in res:
        res["error"] = f"arm process exited with code {rc}"
    if res.get("error"):
        print(f"  {spec.label}: FAILED ({res['error']}); log {log_dir / (stem + '.log')}")
    print(f"  {spec.label} (order {spec.order}): {time.perf_counter() - t0:.0f} s", flush=True)
    return res


# -- the report ----------------------------------------------------------------------------------

def last_half(rows: Sequence[dict]) -> list[dict]:
    """The rows of the last ceil(R / 2) rounds (R = the rounds present)."""
    rounds = sorted({r["round"] for r in rows})
    keep = set(rounds[len(rounds) // 2:])
    return [r for r in rows if r["round"] in keep]


def pooled(rows: Sequence[dict]) -> dict:
    """Totals over rows: tok/s = tokens / wall, accept len and drafter_accept over the pooled
    counters, gate_shut_share the mean of the rounds'."""
    tok, wall = sum(r["output_tokens"] for r in rows), sum(r["wall_s"] for r in rows)
    drafts, acc = sum(r["drafts"] for r in rows), sum(r["accepted"] for r in rows)
    da = [r for r in rows if r.get("drafter_accept") is not None]
    dd = sum(r["drafts"] - (r.get("lookup_rows") or 0) for r in da)
    gs = [r["gate_shut_share"] for r in rows if r.get("gate_shut_share") is not None]
    return {"tok_s": tok / wall if wall else None,
            "accept_len": (acc + drafts) / drafts if drafts else None,
            "drafter_accept": (sum(r["accepted"] for r in da)
                               - sum(r.get("lookup_accepted", 0) or 0 for r in da)) / dd
            if da and dd else None,
            "gate_shut_share": sum(gs) / len(gs) if gs else None}


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(rows: Sequence[dict]) -> dict:
    """Per label: the median over orders of each order's last-half totals (ROW_METRICS),
    learner updates in the last half (median over orders), gap used; then online / frozen and
    online / vllm-suffix for accept_len and tok_s, per learning label."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    per: dict[str, dict] = {}
    for lab in labels:
        mine = [r for r in rows if r["label"] == lab]
        orders = sorted({r["order"] for r in mine})
        tails = [last_half([r for r in mine if r["order"] == o]) for o in orders]
        totals = [pooled(t) for t in tails]
        per[lab] = {"arm": mine[0]["arm"], "gap_s": mine[0]["gap_s"], "orders": len(orders),
                    **{k: _median([t[k] for t in totals]) for k in ROW_METRICS},
                    "learner_updates": _median([sum(r["learner_updates_round"]
                                                    + r["learner_updates_gap"] for r in t)
                                                for t in tails]),
                    "gap_s_used": _median([sum(r["gap_s_used"] for r in t) / len(t)
                                           for t in tails])}
    ratios = {}
    ref = {a: next((lab for lab, s in per.items() if s["arm"] == a), None)
           for a in ("frozen", "vllm-suffix")}
    for lab, s in per.items():
        if ALIASES.get(s["arm"], s["arm"]) != ALIASES["online"]:
            continue
        for base in ("frozen", "vllm-suffix"):
            b = ref[base]
            if b is None:
                continue
            for k in ("accept_len", "tok_s"):
                ratios[f"{lab} / {base} {k}"] = _ratio(s[k], per[b][k])
    return {"arms": per, "ratios": ratios}


def by_round(rows: Sequence[dict], label: str, key: str) -> tuple[list[int], list[float]]:
    """Round -> the median over orders of `key` for one label (rounds where it is known)."""
    xs, ys = [], []
    for r in sorted({r["round"] for r in rows}):
        m = _median([x[key] for x in rows if x["label"] == label and x["round"] == r])
        if m is not None:
            xs.append(r)
            ys.append(m)
    return xs, ys


def plot(rows: Sequence[dict], path: Path, title: str) -> Path:
    """Accept len and tok/s per round, one line per arm; where a learning arm reports it, a
    third panel: the learner's paired gain over its start weights after each round's gap (what
    the demo's verdict reads where the budget seldom runs the drafter)."""
    from vllm_onlinespec.bench.report import _plt

    plt = _plt()
    panels = [("accept_len", "acceptance length (tokens / verify step)"), ("tok_s", "output tok/s")]
    if any(r.get("learner_gain") is not None for r in rows):
        panels.append(("learner_gain", "learner's gain over its start weights\n"
                                       "(accepted draft tokens / block, fresh text)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    for k, lab in enumerate(dict.fromkeys(r["label"] for r in rows)):
        for ax, (key, _) in zip(axes, panels):  # one colour per arm in every panel
            xs, ys = by_round(rows, lab, key)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=lab, color=f"C{k % 10}")
    for ax, (key, yl) in zip(axes, panels):
        ax.set_xlabel("rollout round (the policy pushed in place between rounds)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if key == "learner_gain":
            ax.axhline(0.0, color="0.5", lw=0.8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def summary_lines(s: dict) -> list[str]:
    """The summary's two tables (markdown)."""
    lines = ["| arm | accept len | tok/s | drafter accept | gate shut | learner updates "
             "| gap used s |",
             "|---|---|---|---|---|---|---|"]
    for lab, a in s["arms"].items():
        lines.append(f"| {lab} | {_f(a['accept_len'])} | {_f(a['tok_s'], '.1f')} | "
                     f"{_f(a['drafter_accept'])} | {_f(a['gate_shut_share'])} | "
                     f"{_f(a['learner_updates'], '.0f')} | {_f(a['gap_s_used'], '.1f')} |")
    if s["ratios"]:
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {_f(v, '.3f')} |" for k, v in s["ratios"].items()]
    return lines


STEP_COLUMNS = (*STEP_PHASES, "engine")


def steps_lines(rows: Sequence[dict]) -> list[str]:
    """Per arm and order over all rounds: engine steps per round, ms per step of each phase
    (step-weighted), and the share of steps the budget ran each option on; [] when no row of
    ours has a step profile."""
    keys = list(dict.fromkeys((r["label"], r["order"]) for r in rows if r.get("step_ms")))
    if not keys:
        return []
    out = ["", "## Where the engine steps went (all rounds)", "",
           "ms per engine step from the worker's timers (serving/step_profile.py; `engine` = "
           "wall time per step less the worker's phases); the budget's choice per step "
           "(policy/option_choice.py).", "",
           "| arm | order | steps per round | " + " | ".join(STEP_COLUMNS)
           + " | plain / tree / drafter steps |", "|---|---|---|" + "---|" * len(STEP_COLUMNS)
           + "---|"]
    for label, order in keys:
        mine = [r for r in rows if (r["label"], r["order"]) == (label, order) and r.get("step_ms")]
        steps = sum(r["step_ms"]["steps"] for r in mine)
        ms = {c: sum(r["step_ms"][c] * r["step_ms"]["steps"] for r in mine) / steps
              for c in STEP_COLUMNS}
        n_opt: dict[str, float] = {}
        for r in mine:
            for o, share in (r.get("option_shares") or {}).items():
                n_opt[o] = n_opt.get(o, 0.0) + share * r["step_ms"]["steps"]
        total = sum(n_opt.values())
        opts = (" / ".join(f"{n_opt.get(o, 0.0) / total:.2f}" for o in ("plain", "tree", "drafter"))
                if total else "-")
        out.append(f"| {label} | {order} | {steps / len(mine):.0f} | "
                   + " | ".join(f"{ms[c]:.2f}" for c in STEP_COLUMNS) + f" | {opts} |")
    return out


def markdown(data: dict, name: str = RESULT_NAME) -> list[str]:
    s, meta = data["summary"], data["meta"]
    lines = ["# RL rollouts: speculative decoding while the policy changes every round", "",
             f"![acceptance length and tok/s per round, one line per arm]({name}.png)", "",
             f"- date: {meta.get('date', '')}", f"- command: `{meta['command']}`",
             f"- versions: {', '.join(meta['versions'])}",
             f"- per round: {meta['prompts_per_round']} prompts x n = {meta['n']} samples x "
             f"{meta['max_tokens']} tokens max, temperature 1, top-p 1, seeded; "
             f"{meta['rounds']} rounds; orders: forward, reversed",
             f"- push: {meta['push']}; gaps: {', '.join(f'{g:g} s' for g in meta['gaps'])}",
             f"- wall time of the whole run: {meta['wall_s']:.0f} s",
             "- the same seeds give the same text in every arm of ours, other text in vLLM's "
             "arms (nospec, vllm-*: vLLM's own seeded sampling); `k0` is plain decoding on our "
             "arms' text", "",
             "## Last half of the rounds (median over orders)", "", *summary_lines(s),
             "", "## Rounds", "",
              "| arm | order | round | version | tok/s | accept len | drafter accept | gate shut "
              "| updates round+gap | gap used s | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['label']} | {r['order']} | {r['round']} | {r['version']} | "
                     f"{_f(r['tok_s'], '.1f')} | {_f(r['accept_len'])} | "
                     f"{_f(r['drafter_accept'])} | "
                     f"{_f(r['gate_shut_share'])} | {r['learner_updates_round']}+"
                     f"{r['learner_updates_gap']} | {_f(r['gap_s_used'], '.1f')} | "
                     f"{_f(r['wall_s'], '.1f')} |")
    lines += steps_lines(data["rows"])
    if meta.get("verdict"):
        lines += ["", "## Verdict", "", *meta["verdict"]]
    if meta.get("box"):
        lines += ["", "## Box", "", "```", meta["box"].rstrip(), "```"]
    if meta.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in meta["errors"]]
    return lines


def write_report(rows: list[dict], out: Path, meta: dict, publish_dir: str | Path | None = None,
                 name: str = RESULT_NAME) -> tuple[dict[str, Path], dict]:
    """<out>/NAME.{json,md,png} (copied into publish_dir when given); (paths, summary)."""
    from vllm_onlinespec.bench.results import write_result_files

    data = {"meta": meta, "summary": summarize(rows) if rows else {"arms": {}, "ratios": {}},
            "rows": rows}
    write_result_files(out, name, markdown(data, name), data, publish_dir)
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md"}
    if rows:
        title = meta.get("title") or (
            f"RL rollouts: {meta['rounds']} rounds, {meta['prompts_per_round']} prompts x "
            f"n={meta['n']} x {meta['max_tokens']} tok per round")
        paths["png"] = plot(rows, out / f"{name}.png", title)
        if publish_dir is not None:
            import shutil

            shutil.copy(paths["png"], Path(publish_dir) / f"{name}.png")
    return paths, data["summary"]


# -- the verb ------------------------------------------------------------------------------------

def add_bench_rl_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench-rl", help="RL rollouts: arms sampling n answers per prompt while "
                       "the policy changes every round (pushed in place)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a = b.add_argument
    a("--prompts", metavar="FILE", help="JSONL prompts ('prompt', 'question' or 'messages'), e.g. "
      "GSM8K's train.jsonl (required unless --quick uses the built-in chat prompts)")
    a("--tail", type=int, default=GSM8K_SERVED, help="take prompts from the last TAIL rows of "
      f"--prompts only (default {GSM8K_SERVED}: GSM8K train's served-only slice, never trained "
      "on; 0 = the whole file)")
    a("--skip", type=int, default=0, help="then skip this many rows first (default 0)")
    a("--versions", default="smollm2-135m,smollm2-135m-terse",
      help="comma-separated policy versions (known model names or HF folders), version 0 first; "
      "a series name stands for its base and every version (smollm2-135m-drift: the base, "
      "then 8 checkpoints of an SFT toward GSM8K's worked solutions)")
    a("--rounds", type=int, help="rollout rounds (default: the number of versions; round r "
      "serves version min(r, last))")
    a("--arms", default=DEFAULT_ARMS, help=f"comma-separated arms (default {DEFAULT_ARMS})")
    a("--prompts-per-round", type=int, default=8, help="default 8")
    a("--n", type=int, default=4, help="samples per prompt (default 4)")
    a("--max-tokens", type=int, default=64, help="default 64")
    a("--gap-s", default="0", help="comma-separated gaps (s) after each round in which the "
      "engine idles and the learner trains at full share, e.g. 0,20; learning arms run once "
      "per gap (default 0)")
    a("--push", choices=("state_dict", "folder"), default="state_dict",
      help="how our arms receive a version: push_target(state dict) (default) or "
      "swap_target(folder); vLLM's own arms always reload the folder")
    a("--orders", type=int, choices=(1, 2), default=2, help="2 (default): arms as given, then "
      "reversed; 1: as given only")
    a("--seed", type=int, default=0, help="base of the per-prompt seeds")
    a("--preset", default="cpu", help="the settings our arms start from (default cpu)")
    a("--learn-while-rolling", action="store_true", help="learning arms also train while the "
      "engine samples, at the preset's share (default: only in the gap and other idle time, "
      "pacing.idle_only, so a rollout step never shares the cores with an update)")
    a("--drafter", help="DFlash drafter folder (default: the shipped one for version 0's model)")
    a("--dtype", default="auto", help="auto (default), bfloat16 or float32")
    a("--engine-lock", metavar="PATH", help="run each arm's engine under `flock PATH`")
    a("--publish", metavar="DIR", help="also copy rl_rollouts.{md,json,png} here (docs/results)")
    a("--date", help="date for the report (default: today, UTC)")
    a("--quick", action="store_true", help="tiny smoke: 2 versions, 2 rounds, 2 prompts x n=2 "
      "x 16 tokens, arms nospec,online (~3 min)")
    a("--out", required=True, help="output folder")
    b.set_defaults(func=run_bench_rl)


def _gaps(text: str) -> list[float]:
    try:
        gaps = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gap-s {text!r}: expected comma-separated seconds") from None
    if not gaps or any(g < 0 for g in gaps) or len(set(gaps)) != len(gaps):
        raise ValueError(f"--gap-s {text!r}: expected distinct seconds >= 0")
    return gaps


def version_names(spec: str) -> list[str]:
    """--versions: comma-separated names, a series name expanded to its base and versions."""
    from vllm_onlinespec.models import SERIES, series_members

    return [m for x in spec.split(",") if x.strip()
            for m in (series_members(x.strip()) if x.strip() in SERIES else [x.strip()])]


def run_bench_rl(args: argparse.Namespace, msgs: list[list[dict]] | None = None) -> int:
    """The verb; `msgs` (chat messages, at least rounds x prompts_per_round) replace --prompts
    (the demo serves its own)."""
    from vllm_onlinespec.bench.arm_catalog import base_settings, make_arm
    from vllm_onlinespec.bench import prompts as P
    from vllm_onlinespec.models import resolve, shipped_drafter
    from vllm_onlinespec.serving_dtype import resolve_dtype_arg

    if args.quick:
        args.rounds, args.prompts_per_round, args.n, args.max_tokens = 2, 2, 2, 16
        if args.arms == DEFAULT_ARMS:
            args.arms = "nospec,online"
    t0 = time.perf_counter()
    out = Path(args.out)
    names = version_names(args.versions)
    versions = [resolve(v) for v in names]
    rounds_n = args.rounds or len(versions)
    gaps = _gaps(args.gap_s)
    count = rounds_n * args.prompts_per_round
    if msgs is not None:
        msgs = list(msgs)[:count]
    elif args.prompts:
        msgs = read_prompts(args.prompts, count, args.skip, args.tail)
    elif args.quick:
        msgs = [p.messages for p in P.builtin_chat()[args.skip:args.skip + count]]
    else:
        raise ValueError("give --prompts FILE (or --quick)")
    rounds = schedule(msgs, rounds=rounds_n, versions=len(versions),
                      per_round=args.prompts_per_round, n=args.n, seed=args.seed)
    drafter = args.drafter or str(shipped_drafter(names[0]))
    dtype = resolve_dtype_arg(args.dtype)
    arms = [x.strip() for x in args.arms.split(",") if x.strip()]
    specs = {a: make_arm(ALIASES.get(a, a), target=versions[0], prompts="", out_dir=out,
                         drafter=drafter,
                         online=base_settings(args.preset), dtype=dtype,
                         max_tokens=args.max_tokens) for a in arms}
    if not args.learn_while_rolling:  # the rollout engine's cores are the rollouts' own
        from vllm_onlinespec.presets import merge

        for sp in specs.values():
            if sp.learning:
                sp.onlinespec = merge(sp.onlinespec, {"pacing": {"idle_only": True}})
    plan = units(arms, gaps, lambda a: specs[a].learning)
    print(f"bench-rl: {len(plan)} arm runs x {args.orders} orders, {rounds_n} rounds of "
          f"{args.prompts_per_round} prompts x n={args.n} x {args.max_tokens} tokens; "
          f"versions {', '.join(names)}", flush=True)
    rows, errors = [], []
    for order in range(args.orders):
        for i in run_order(len(plan), order):
            u = plan[i]
            arm = specs[u.arm]  # its out names <out>/arms/: its checkpoints are emptied first
            spec = RLArmSpec(arm=asdict(arm), label=u.label, order=order, gap_s=u.gap_s,
                             versions=versions, rounds=[asdict(r) for r in rounds], n=args.n,
                             max_tokens=args.max_tokens, push=args.push, arm_name=u.arm,
                             out=str(out / "arms"
                                     / f"{u.label.replace(' ', '_')}.order{order}.json"))
            res = run_unit(spec, out / "logs", args.engine_lock)
            rows += res["rows"]
            if res.get("error"):
                errors.append(f"{u.label} (order {order}): {res['error']}")
    rows.sort(key=lambda r: ([p.label for p in plan].index(r["label"]), r["order"], r["round"]))
    box = subprocess.run("lscpu | head -15", shell=True, capture_output=True, text=True).stdout
    meta = {"date": args.date or time.strftime("%Y-%m-%d", time.gmtime()),
            "command": getattr(args, "command", None) or "vllm-onlinespec bench-rl " + " ".join(
                sys.argv[2:] if len(sys.argv) > 2 else []),
            "versions": names, "rounds": rounds_n,
            "prompts_per_round": args.prompts_per_round, "n": args.n,
            "max_tokens": args.max_tokens, "gaps": gaps, "push": args.push,
            "arms": [u.label for u in plan], "preset": args.preset,
            "drafter": args.drafter or f"the shipped drafter for {names[0]}",
            "learn_while_rolling": args.learn_while_rolling,
            "dtype": dtype, "prompts_file": args.prompts, "tail": args.tail, "skip": args.skip,
            "seed": args.seed,
            "orders": args.orders, "wall_s": time.perf_counter() - t0, "box": box,
            "errors": errors}
    paths, summary = write_report(rows, out, meta, args.publish)
    print("\n".join(summary_lines(summary)))
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
