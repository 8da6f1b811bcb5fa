"""Does speculative decoding on this CPU sample from the target's distribution? Figures for
docs/results/sampling.md: no speculation, DFlash with the plugin's vLLM-CPU fixes, and DFlash
with the fixes switched off (VLLM_ONLINESPEC_CPU_FIXES=0), on the same seeded draws.

    flock /tmp/onlinespec-engine.lock .venv/bin/python lab/sampling_check.py --out runs/sampling

Each arm is one float32 engine in its own subprocess. Per sampling setting (temperature 1;
top_k 20; temperature 0.8 + top_p 0.8), 400 requests of one prompt with seeds 0..399 draw
K + 2 tokens; the first two tokens are tested against P(t1) P(t2 | t1) under the target
(vllm_onlinespec/bench/sampling.py): chi-square p-value and the z-score of the most likely pair.
A crashed engine is reported as such (the defects kill it on top_k).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
ARMS = {"nospec": ({}, False), "dflash (fixes on)": ({}, True),
        "dflash (fixes off)": ({"VLLM_ONLINESPEC_CPU_FIXES": "0"}, True)}


def child(arm: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    import test_sampled_lossless as T
    from engine_checks import make_drafter
    from vllm_onlinespec.bench.sampling import SamplingParamsSpec, goodness_of_fit, pair_probabilities
    from vllm_onlinespec.engine import engine_kwargs
    from vllm_onlinespec.models import pull

    target = str(pull("smollm2-135m"))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kw = engine_kwargs(max_model_len=1024, max_num_batched_tokens=T.MAX_BATCHED)
    if ARMS[arm][1]:
        drafter = make_drafter(target, str(out / "drafter"))
        kw.update(T.engine_config(drafter, {"enabled": False}))
    llm = LLM(model=target, dtype="float32", disable_log_stats=False, **kw)
    rows = []
    for name, spec_kw in T.SPECS.items():
        row = {"arm": arm, "setting": SamplingParamsSpec(**spec_kw).label()}
        try:
            prompt_ids, pairs = T.draw_pairs(llm, spec_kw)
            res = goodness_of_fit(pairs, pair_probabilities(hf, prompt_ids,
                                                            SamplingParamsSpec(**spec_kw), T.N_DRAWS))
            row.update(chi2=res.chi2, df=res.df, p_value=res.p_value, z_top=res.z_top,
                       top_observed=res.top_observed, top_expected=res.top_expected, n=res.n)
        except Exception as e:  # noqa: BLE001 - a dead engine is the finding
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        (out / f"{arm}.json").write_text(json.dumps(rows))
        if "error" in row:
            break
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/sampling")
    ap.add_argument("--publish", action="store_true", help="copy the report to docs/results/")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.child:
        child(args.child, out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for arm, (env, _) in ARMS.items():
        print(f"{arm} ...", flush=True)
        with open(out / f"{arm}.log", "w") as fh:
            subprocess.call([sys.executable, __file__, "--out", str(out), "--child", arm],
                            env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                            timeout=1200)
        f = out / f"{arm}.json"
        got = json.loads(f.read_text()) if f.is_file() else [{"arm": arm, "error": "no result"}]
        for r in got:
            print("  ", r, flush=True)
        rows += got
    md = [f"# Sampling through the rejection sampler on CPU ({time.strftime('%Y-%m-%d')})", "",
          "Command: `python lab/sampling_check.py --publish` (inside the engine lock); "
          f"{time.perf_counter() - t0:.0f} s.", "",
          "SmolLM2-135M-Instruct, float32, DFlash K = 4 (random 2-layer drafter, frozen), 600 "
          "requests of one prompt with seeds 0..399; the first two output tokens against "
          "P(t1) P(t2 | t1) under the target's temperature / top_k / top_p. t2 is decided by the "
          "rejection sampler in the DFlash arms. p: Pearson chi-square p-value (a correct sampler "
          "gives a uniform p); z: most likely pair's count against its expectation.", "",
          "| arm | setting | chi2 / df | p | z (most likely pair) | observed / expected |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['arm']} | {r.get('setting', '-')} | engine died: {r['error']} | | | |")
        else:
            md.append(f"| {r['arm']} | {r['setting']} | {r['chi2']:.1f} / {r['df']} | "
                      f"{r['p_value']:.3g} | {r['z_top']:+.2f} | {r['top_observed']} / "
                      f"{r['top_expected']:.1f} |")
    from vllm_onlinespec.bench.results import write_result_files

    write_result_files(out, "sampling", md, rows,
                       ROOT / "docs" / "results" if args.publish else None)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
