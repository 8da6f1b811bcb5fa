"""The domain-shift benchmark's prompt files (lab/domain_shift.sh), written once per run.

    python lab/shift_streams.py --spec-bench question.jsonl --heldout DRAFTER/heldout_prompts.jsonl --out DIR

    DIR/tune.jsonl          40 math word problems (Spec-Bench math_reasoning): settings are
                            chosen on this stream only
    DIR/shifted.jsonl       the other 40: the reported shifted-domain stream (never tuned on)
    DIR/own.jsonl           the drafter's own domain: its recipe's held-out prompts (Spec-Bench
                            without math_reasoning + HumanEval, never trained on)
    DIR/aba-seed-S.jsonl    A -> B -> A: half of own, all of shifted, the other half of own,
                            each part in a seeded order; categories carry the part ("A1:...",
                            "B:...", "A2:...") so a report can find the return to A

The split of math_reasoning is a fixed seeded shuffle (seed 1234), the same in every run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vllm_onlinespec.bench.prompts import from_file
from vllm_onlinespec.training.data import load_spec_bench

SPLIT_SEED = 1234


def rows(prompts, part: str | None = None) -> list[dict]:
    out = []
    for p in prompts:
        d = p.to_json()
        if part:
            d["category"] = f"{part}:{p.category}"
        out.append(d)
    return out


def write(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def shuffled(xs: list, seed: int) -> list:
    xs = list(xs)
    random.Random(seed).shuffle(xs)
    return xs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec-bench", required=True)
    ap.add_argument("--heldout", required=True, help="the drafter's heldout_prompts.jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1", help="A -> B -> A orders (default 0,1)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    math = shuffled(load_spec_bench(a.spec_bench, ["math_reasoning"]), SPLIT_SEED)
    half = len(math) // 2
    tune, shifted = math[:half], math[half:]
    own = from_file(a.heldout)
    write(out / "tune.jsonl", rows(tune))
    write(out / "shifted.jsonl", rows(shifted))
    write(out / "own.jsonl", rows(own))
    for s in (int(x) for x in a.seeds.split(",")):
        aa = shuffled(own, s)
        h = len(aa) // 2
        write(out / f"aba-seed-{s}.jsonl",
              rows(aa[:h], "A1") + rows(shuffled(shifted, s), "B") + rows(aa[h:], "A2"))
    print(f"{out}: tune {len(tune)}, shifted {len(shifted)}, own {len(own)}, "
          f"aba {len(own) + len(shifted)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
