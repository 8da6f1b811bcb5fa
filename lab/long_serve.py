"""A long-running server, frozen drafter vs learning: TPOT and tok/s per window.

Reads the output folders of `vllm-onlinespec bench --arrivals ...` runs (one per protocol, each
with the same arms) and writes NAME.{json,md,png}: per protocol, arm and window (an eighth of
the stream by finish time) the requests finished, output tok/s, TPOT p50 / p90 and accept length;
per protocol and arm the whole stream and its last quarter, the learner's updates and publishes,
and what a busy learner cost the steps it overlapped (serving/step_profile.py's split).

    python lab/long_serve.py --run poisson=runs/long/poisson --run saturation=runs/long/sat \
        --out runs/long --publish docs/results

`--keep docs/results/long_serve.json` carries the runs of an earlier page (a protocol run again
in the other arm order, PROTOCOL-reversed, sits beside its first order). Per run the page gives
online / frozen on the same arrivals: the ratio that run measured, never one across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_onlinespec.bench.results import percentile as pct  # noqa: E402
from vllm_onlinespec.bench.results import write_result_files  # noqa: E402

WINDOWS = 8


def window_rows(protocol: str, arm: dict, windows: int = WINDOWS) -> list[dict]:
    """Requests grouped by finish time into `windows` equal spans of the stream."""
    reqs = [r for r in arm["requests"] if r.get("finish_s") is not None]
    end = max(r["finish_s"] for r in reqs)
    rows = []
    for w in range(windows):
        lo, hi = end * w / windows, end * (w + 1) / windows
        mine = [r for r in reqs if lo <= r["finish_s"] < hi or (w == windows - 1 and r["finish_s"] == end)]
        acc = [r["acceptance_length"] for r in mine if r.get("acceptance_length")]
        rows.append({"protocol": protocol, "arm": arm["spec"]["name"], "window": w,
                     "t_start_s": lo, "t_end_s": hi, "requests": len(mine),
                     "tok_s": sum(r["output_tokens"] for r in mine) / (hi - lo) if hi > lo else None,
                     "tpot_p50_ms": pct([r["tpot_ms"] for r in mine], 0.5),
                     "tpot_p90_ms": pct([r["tpot_ms"] for r in mine], 0.9),
                     "accept_len": statistics.mean(acc) if acc else None})
    return rows


def summary(protocol: str, arm: dict) -> dict:
    reqs = [r for r in arm["requests"] if r.get("finish_s") is not None]
    end = max(r["finish_s"] for r in reqs)
    last = [r for r in reqs if r["finish_s"] >= 0.75 * end]
    learner = arm.get("learner") or {}
    ln = learner.get("learner") if isinstance(learner, dict) else None
    prof = arm.get("step_profile") or {}
    acc = [r["acceptance_length"] for r in reqs if r.get("acceptance_length")]
    acc_last = [r["acceptance_length"] for r in last if r.get("acceptance_length")]
    return {"protocol": protocol, "arm": arm["spec"]["name"], "requests": len(reqs),
            "arrivals": arm["spec"].get("arrivals"), "serve_s": arm.get("serve_s"),
            "tok_s": arm["totals"]["tok_s"],
            "tpot_p50_ms": pct([r["tpot_ms"] for r in reqs], 0.5),
            "tpot_p90_ms": pct([r["tpot_ms"] for r in reqs], 0.9),
            "last_quarter_tpot_p50_ms": pct([r["tpot_ms"] for r in last], 0.5),
            "last_quarter_tpot_p90_ms": pct([r["tpot_ms"] for r in last], 0.9),
            "last_quarter_tok_s": sum(r["output_tokens"] for r in last) / (0.25 * end),
            "accept_len": statistics.mean(acc) if acc else None,
            "last_quarter_accept_len": statistics.mean(acc_last) if acc_last else None,
            "learner_updates": ln.get("updates") if ln else None,
            "publishes": learner.get("publishes") if isinstance(learner, dict) else None,
            "learner_busy_s": ln.get("busy_s") if ln else None,
            "steps": prof.get("steps"),
            "steps_begun_in_an_update": int(sum(v[0] for k, v in (prof.get("learner") or {}).items()
                                                if k.startswith("busy"))) if prof else None,
            "learner_step_cost": (prof.get("learner_cost") or {}).get("all") if prof else None,
            "option_steps": (prof.get("options") or None) if prof else None,
            "learner_step_cost_by_bucket": {k: v for k, v in (prof.get("learner_cost") or {}).items()
                                            if k != "all"} if prof else None}


def ratios(summary: list[dict]) -> list[dict]:
    """Per protocol run: the learning arm over the frozen one on the same arrivals."""
    out = []
    for proto in dict.fromkeys(s["protocol"] for s in summary):
        arms = {s["arm"]: s for s in summary if s["protocol"] == proto}
        on = next((s for a, s in arms.items() if a.startswith("online")), None)
        fr = arms.get("frozen")
        if not (on and fr):
            continue

        def r(key):
            return on[key] / fr[key] if on.get(key) and fr.get(key) else None

        out.append({"protocol": proto, "arms": f"{on['arm']} / frozen",
                    "tok_s": r("tok_s"), "tpot_p50": r("tpot_p50_ms"),
                    "last_quarter_tpot_p50": r("last_quarter_tpot_p50_ms"),
                    "last_quarter_tok_s": r("last_quarter_tok_s"),
                    "last_quarter_accept_len": r("last_quarter_accept_len")})
    return out


def _f(x, fmt=".1f"):
    return "-" if x is None else format(x, fmt)


def markdown(data: dict, command: str) -> list[str]:
    lines = ["# A long-running server: the drafter frozen vs learning", "",
             "![TPOT p50 and tok/s per window, one line per arm](long_serve.png)", "",
             f"Commands: {command}", "",
             "| protocol | arm | requests | serve s | tok/s | TPOT p50 / p90 ms | last quarter: "
             "TPOT p50 / p90 ms | tok/s | accept len (all / last quarter) | learner updates / "
             "publishes | steps begun in an update | their target ms per token vs the rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in data["summary"]:
        lines.append(
            f"| {s['protocol']} ({s['arrivals']}) | {s['arm']} | {s['requests']} | "
            f"{_f(s['serve_s'], '.0f')} | {_f(s['tok_s'])} | {_f(s['tpot_p50_ms'])} / "
            f"{_f(s['tpot_p90_ms'])} | {_f(s['last_quarter_tpot_p50_ms'])} / "
            f"{_f(s['last_quarter_tpot_p90_ms'])} | {_f(s['last_quarter_tok_s'])} | "
            f"{_f(s['accept_len'], '.2f')} / {_f(s['last_quarter_accept_len'], '.2f')} | "
            f"{_f(s['learner_updates'], 'd') if s['learner_updates'] is not None else '-'} / "
            f"{_f(s['publishes'], 'd') if s['publishes'] is not None else '-'} | "
            f"{_f(s['steps_begun_in_an_update'], 'd') if s['steps_begun_in_an_update'] is not None else '-'}"
            f" of {_f(s['steps'], 'd') if s['steps'] else '-'} | "
            + (f"{s['learner_step_cost']:.3f}x |" if s["learner_step_cost"] is not None else "- |"))
    if data.get("ratios"):
        lines += ["", "## Online over frozen, per run (same arrivals)", "",
                  "| protocol | arms | tok/s | TPOT p50 | last quarter TPOT p50 | last quarter "
                  "tok/s | last quarter accept len |", "|---|---|---|---|---|---|---|"]
        for r in data["ratios"]:
            lines.append(f"| {r['protocol']} | {r['arms']} | {_f(r['tok_s'], '.3f')} | "
                         f"{_f(r['tpot_p50'], '.3f')} | {_f(r['last_quarter_tpot_p50'], '.3f')} | "
                         f"{_f(r['last_quarter_tok_s'], '.3f')} | "
                         f"{_f(r['last_quarter_accept_len'], '.3f')} |")
    opt = [s for s in data["summary"] if s.get("option_steps")]
    if opt:
        lines += ["", "## What each of the budget's options cost (the target's forward)", "",
                  "Steps by the option they verified, batch bucket and whether prefill shared "
                  "the step (serving/step_profile.py):", "",
                  "| protocol | arm | option | steps | target ms per step | tokens per step |",
                  "|---|---|---|---|---|---|"]
        for s in opt:
            for key, (n, sec, tok) in sorted(s["option_steps"].items(), key=lambda kv: -kv[1][0]):
                # A run before the label fix recorded steps without an option as true / false.
                key = key if "@" in key else "(no option: the gate's own exploring or warm-up)"
                lines.append(f"| {s['protocol']} | {s['arm']} | {key} | {n} | "
                             f"{1e3 * sec / n:.1f} | {tok / n:.1f} |")
    lines += ["", "## Windows (an eighth of each stream by finish time)", "",
              "| protocol | arm | window | requests | tok/s | TPOT p50 / p90 ms | accept len |",
              "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['protocol']} | {r['arm']} | {r['window']} | {r['requests']} | "
                     f"{_f(r['tok_s'])} | {_f(r['tpot_p50_ms'])} / {_f(r['tpot_p90_ms'])} | "
                     f"{_f(r['accept_len'], '.2f')} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    # One colour per arm on every panel, whatever order a run served the arms in.
    colour = {a: f"C{i}" for i, a in enumerate(dict.fromkeys(r["arm"] for r in rows))}
    fig, axes = plt.subplots(2, len(protocols), figsize=(5.5 * len(protocols), 6.5), squeeze=False)
    for j, proto in enumerate(protocols):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["protocol"] == proto):
            mine = [r for r in rows if r["protocol"] == proto and r["arm"] == arm]
            x = [(r["t_start_s"] + r["t_end_s"]) / 120 for r in mine]
            axes[0][j].plot(x, [r["tpot_p50_ms"] for r in mine], marker="o", label=arm,
                            color=colour[arm])
            axes[1][j].plot(x, [r["tok_s"] for r in mine], marker="o", label=arm, color=colour[arm])
        axes[0][j].set_title(f"{proto}: TPOT p50 (ms)", fontsize=10)
        axes[1][j].set_title(f"{proto}: output tok/s", fontsize=10)
        axes[1][j].set_xlabel("minutes into the stream")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True,
                    help="PROTOCOL=FOLDER: a bench output folder (its arms/*.json)")
    ap.add_argument("--command", action="append", default=[],
                    help="the bench command of each run, for the page")
    ap.add_argument("--out", required=True)
    ap.add_argument("--publish", help="also copy long_serve.{md,json,png} here")
    ap.add_argument("--keep", help="an earlier long_serve.json whose runs the page keeps")
    a = ap.parse_args(argv)
    rows, summ = [], []
    if a.keep:
        old = json.loads(Path(a.keep).read_text())
        rows, summ = list(old["rows"]), list(old["summary"])
    for spec in a.run:
        proto, _, folder = spec.partition("=")
        if any(x["protocol"] == proto for x in summ):
            raise SystemExit(f"long_serve: protocol {proto!r} is already on the page (--keep)")
        arms = sorted(Path(folder, "arms").glob("*.json"), key=lambda p: p.stat().st_mtime)
        if not arms:
            raise SystemExit(f"long_serve: no arms/*.json in {folder}")
        for p in arms:
            arm = json.loads(p.read_text())
            if arm.get("error") or not arm.get("requests"):
                raise SystemExit(f"long_serve: {p} failed or served nothing: {arm.get('error')}")
            rows += window_rows(proto, arm)
            summ.append(summary(proto, arm))
    data = {"summary": summ, "rows": rows, "ratios": ratios(summ)}
    out = Path(a.out)
    command = "; ".join(f"`{c}`" for c in a.command) or "(not given)"
    write_result_files(out, "long_serve", markdown(data, command), data, a.publish)
    plot(rows, out / "long_serve.png")
    if a.publish:
        import shutil

        shutil.copy(out / "long_serve.png", Path(a.publish) / "long_serve.png")
    print("\n".join(markdown(data, command)[6:6 + 2 + len(summ)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
