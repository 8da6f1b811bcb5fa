"""What a DFlash drafter plus vLLM's prompt lookup (ngram) could accept, offline, held out.

    python benchmarks/hybrid_ceiling.py --data runs/drafter/r4/data \
        --drafter vllm_onlinespec/drafters/smollm2-135m [--drafter ...] --out docs/results

Walks each held-out greedy answer of a training run's feature shards as serving does
(training.blocks.walk_steps: a step commits its accepted drafts + 1) with four proposers:
  dflash       the drafter alone (training.trainer.block_accepts: a block at every position)
  ngram        prompt lookup alone, vLLM's rule (drafter/prompt_lookup.propose, what
               serving's `prompt_lookup` runs): the longest suffix n-gram
               of the context (prompt_lookup_min..max = 2..4, as drafter_served.py serves it)
               at its earliest earlier occurrence, and the K tokens after it
  ngram-first  prompt lookup where it proposes K tokens, the drafter elsewhere (a rule a
               proposer can apply before drafting)
  oracle       the better of the two at every step: the ceiling of any per-step choice
Figures: tokens per verify step over all steps (what speed follows; a step without an ngram
match still costs a target step), and for ngram also per drafted step (vLLM's "mean acceptance
length" counts only steps that drafted), to check the offline walk against served figures.
Writes OUT/hybrid_ceiling.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_onlinespec.drafter.prompt_lookup import propose
from vllm_onlinespec.training.blocks import walk_steps

POLICIES = ("dflash", "ngram", "ngram-first", "oracle")


def accepted_run(proposal: Sequence[int], truth: Sequence[int]) -> int:
    """Greedy verification: proposed tokens that match the answer before the first miss."""
    a = 0
    for p, y in zip(proposal, truth):
        if p != y:
            break
        a += 1
    return a


def choose(policy: str, dflash: int, ngram: int, ngram_len: int, k: int) -> int:
    """Drafts accepted at one step under `policy` (POLICIES)."""
    if policy == "dflash":
        return dflash
    if policy == "ngram":
        return ngram
    if policy == "ngram-first":
        return ngram if ngram_len == k else dflash
    if policy == "oracle":
        return max(dflash, ngram)
    raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")


@dataclass
class WalkTotals:
    steps: int = 0
    tokens: int = 0
    drafted_steps: int = 0  # steps whose proposer proposed anything (vLLM's denominator)
    drafted_tokens: int = 0

    @property
    def per_step(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    @property
    def per_drafted_step(self) -> float:
        return self.drafted_tokens / self.drafted_steps if self.drafted_steps else float("nan")


def walk_policies(ids: Sequence[int], start: int, dflash: Sequence[int], k: int,
                  n_min: int = 2, n_max: int = 4) -> dict[str, WalkTotals]:
    """Each policy's walk through one answer; dflash[i]: the drafter's accepts at start + i."""
    ids = list(ids)
    ng, ng_len = [], []
    for i in range(len(dflash)):
        p = start + i  # the block's known token; drafts are p+1 .. p+k
        prop = propose(ids[:p + 1], k, n_min, n_max)
        ng.append(accepted_run(prop, ids[p + 1:p + 1 + k]))
        ng_len.append(len(prop))
    out = {}
    for policy in POLICIES:
        walked = walk_steps([choose(policy, dflash[i], ng[i], ng_len[i], k)
                             for i in range(len(dflash))], k)
        tot, i = WalkTotals(steps=len(walked), tokens=sum(walked) + len(walked)), 0
        for a in walked:  # the positions the walk visited: which of its steps drafted
            if policy != "ngram" or ng_len[i]:
                tot.drafted_steps, tot.drafted_tokens = tot.drafted_steps + 1, tot.drafted_tokens + a + 1
            i += a + 1
        out[policy] = tot
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a training run's feature-shard folder")
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for hybrid_ceiling.{json,md}")
    args = ap.parse_args()

    import torch

    from vllm_onlinespec.models import resolve
    from vllm_onlinespec.training.trainer import block_accepts, heldout_inputs

    torch.set_num_threads(args.threads)
    inp = heldout_inputs(args.data, resolve(args.target))
    held, embed, lm = inp.examples, inp.embed_w, inp.lm_head_w
    rows = []
    for path in args.drafter:
        _, drafter = inp.drafter(path)
        k = drafter.config.num_draft_tokens
        totals = {p: WalkTotals() for p in POLICIES}
        for e in held:
            walks = walk_policies(e.ids.tolist(), e.start,
                                  block_accepts(drafter, e, embed, lm), k)
            for p, w in walks.items():
                t = totals[p]
                t.steps, t.tokens = t.steps + w.steps, t.tokens + w.tokens
                t.drafted_steps += w.drafted_steps
                t.drafted_tokens += w.drafted_tokens
        row = {"drafter": path, "K": k, "sequences": len(held),
               **{p: {**asdict(t), "tokens_per_step": round(t.per_step, 3),
                      "tokens_per_drafted_step": round(t.per_drafted_step, 3)}
                  for p, t in totals.items()}}
        rows.append(row)
        print(json.dumps({"drafter": path, **{p: row[p]["tokens_per_step"] for p in POLICIES},
                          "ngram_per_drafted_step": row["ngram"]["tokens_per_drafted_step"]}))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "hybrid_ceiling.json").write_text(json.dumps(rows, indent=1) + "\n")
        lines = ["# DFlash drafter + prompt lookup: offline held-out walk (tokens per verify step)",
                 "", f"Held-out greedy answers of `{args.data}` ({len(held)} sequences), the walk "
                 "of benchmarks/hybrid_ceiling.py (its docstring defines the four proposers).", "",
                 "```bash", "python benchmarks/hybrid_ceiling.py --data " + args.data + " "
                 + " ".join(f"--drafter {p}" for p in args.drafter) + f" --out {args.out}", "```", "",
                 "| drafter | K | dflash | ngram (all steps) | ngram (drafted steps) | "
                 "ngram-first | oracle |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['drafter']} | {r['K']} | {r['dflash']['tokens_per_step']:.3f} | "
                         f"{r['ngram']['tokens_per_step']:.3f} | "
                         f"{r['ngram']['tokens_per_drafted_step']:.3f} | "
                         f"{r['ngram-first']['tokens_per_step']:.3f} | "
                         f"{r['oracle']['tokens_per_step']:.3f} |")
        (out / "hybrid_ceiling.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ValueError as e:  # a drafter that does not fit the shards: one line, not a trace
        raise SystemExit(f"error: {e}")
