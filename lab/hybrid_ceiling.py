"""What a DFlash drafter plus vLLM's prompt lookup (ngram) could accept, offline, held out.

    python lab/hybrid_ceiling.py --data runs/drafter/r4/data \
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
# With --suffix-tree: SuffixDecoding's trees (drafter/suffix_tree.py) fed the held-out answers
# one after another as serving would (each answer's output joins the global tree when it ends).
TREE_POLICIES = ("tree", "tree-first")


def accepted_run(proposal: Sequence[int], truth: Sequence[int]) -> int:
    """Greedy verification: proposed tokens that match the answer before the first miss."""
    a = 0
    for p, y in zip(proposal, truth):
        if p != y:
            break
        a += 1
    return a


def choose(policy: str, dflash: int, ngram: int, ngram_len: int, k: int, tree: int = 0,
           tree_ok: bool = False) -> int:
    """Drafts accepted at one step under `policy` (POLICIES, TREE_POLICIES); tree: the tree
    draft's accepted tokens, tree_ok: its score reached the threshold."""
    if policy == "tree":
        return tree if tree_ok else 0
    if policy == "tree-first":
        return tree if tree_ok else dflash
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


@dataclass
class FirstToken:
    """First-draft-token accuracy at every answer position, split by whether prompt lookup has
    a K-token match there (does the drafter copy where copying pays?)."""

    hit: int = 0  # positions where lookup proposes K tokens
    hit_dflash: int = 0  # ... and the drafter's first token is the target's
    hit_lookup: int = 0  # ... and lookup's first token is
    miss: int = 0
    miss_dflash: int = 0

    def add(self, other: "FirstToken") -> None:
        for f in ("hit", "hit_dflash", "hit_lookup", "miss", "miss_dflash"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def as_dict(self) -> dict:
        r = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
        return {"lookup_hit_share": r(self.hit, self.hit + self.miss),
                "dflash_first_on_hit": r(self.hit_dflash, self.hit),
                "lookup_first_on_hit": r(self.hit_lookup, self.hit),
                "dflash_first_on_miss": r(self.miss_dflash, self.miss)}


def lookup_accepts(ids: Sequence[int], start: int, n: int, k: int, n_min: int = 2,
                   n_max: int = 4) -> tuple[list[int], list[int]]:
    """(accepted, proposal length) of prompt lookup at answer positions start .. start+n-1."""
    ids = list(ids)
    ng, ng_len = [], []
    for i in range(n):
        p = start + i  # the block's known token; drafts are p+1 .. p+k
        prop = propose(ids[:p + 1], k, n_min, n_max)
        ng.append(accepted_run(prop, ids[p + 1:p + 1 + k]))
        ng_len.append(len(prop))
    return ng, ng_len


def first_token(dflash: Sequence[int], ng: Sequence[int], ng_len: Sequence[int], k: int
                ) -> FirstToken:
    out = FirstToken()
    for d, a, n in zip(dflash, ng, ng_len):
        if d < 0:
            continue
        if n == k:
            out.hit, out.hit_dflash, out.hit_lookup = out.hit + 1, out.hit_dflash + (d >= 1), out.hit_lookup + (a >= 1)
        else:
            out.miss, out.miss_dflash = out.miss + 1, out.miss_dflash + (d >= 1)
    return out


def ratio_se(steps: Sequence[int], tokens: Sequence[int], resamples: int = 2000,
             seed: int = 0) -> float:
    """Bootstrap standard error (over sequences) of sum(tokens) / sum(steps)."""
    import random

    rng = random.Random(seed)
    n, vals = len(steps), []
    if n < 2:
        return float("nan")
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        st = sum(steps[i] for i in idx)
        vals.append(sum(tokens[i] for i in idx) / st if st else float("nan"))
    m = sum(vals) / len(vals)
    return (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5


def tree_accepts(tree, req_id: str, ids: Sequence[int], start: int, n: int, k: int,
                 min_score: float) -> tuple[list[int], list[bool]]:
    """(accepted, score reached min_score) of the suffix tree's draft at answer positions
    start .. start+n-1 (the tree fed the text up to each position), then the request ends."""
    ids = list(ids)
    acc, ok = [], []
    tree.propose(req_id, ids[:start], 0)  # the prompt: its own tree, as serving starts it
    for i in range(n):
        p = start + i
        d = tree.propose(req_id, ids[:p + 1], k)
        acc.append(accepted_run(d.tokens, ids[p + 1:p + 1 + k]))
        ok.append(d.score >= min_score and len(d.tokens) > 0)
    tree.finish([req_id])
    return acc, ok


def walk_policies(ids: Sequence[int], start: int, dflash: Sequence[int], k: int,
                  n_min: int = 2, n_max: int = 4,
                  lookup: tuple[list[int], list[int]] | None = None,
                  tree: tuple[list[int], list[bool]] | None = None) -> dict[str, WalkTotals]:
    """Each policy's walk through one answer; dflash[i]: the drafter's accepts at start + i;
    tree (tree_accepts): adds the TREE_POLICIES."""
    ng, ng_len = lookup or lookup_accepts(ids, start, len(dflash), k, n_min, n_max)
    tr, tr_ok = tree or ([0] * len(dflash), [False] * len(dflash))
    out = {}
    for policy in POLICIES + (TREE_POLICIES if tree is not None else ()):
        walked = walk_steps([choose(policy, dflash[i], ng[i], ng_len[i], k, tr[i], tr_ok[i])
                             for i in range(len(dflash))], k)
        tot, i = WalkTotals(steps=len(walked), tokens=sum(walked) + len(walked)), 0
        for a in walked:  # the positions the walk visited: which of its steps drafted
            if (policy != "ngram" or ng_len[i]) and (policy != "tree" or tr_ok[i]):
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
    ap.add_argument("--suffix-tree", type=float, nargs="*", default=None, metavar="MIN_SCORE",
                    help="also walk SuffixDecoding's trees alone and tree-first (the drafter "
                    "where the tree's score is below MIN_SCORE); one walk per MIN_SCORE")
    args = ap.parse_args()

    import torch

    from vllm_onlinespec.config import LossConfig
    from vllm_onlinespec.drafter import load_draft_vocab
    from vllm_onlinespec.drafter.suffix_tree import SuffixTreeLookup
    from vllm_onlinespec.models import resolve
    from vllm_onlinespec.training.trainer import add_target_labels, block_accepts, heldout_inputs

    torch.set_num_threads(args.threads)
    inp = heldout_inputs(args.data, resolve(args.target))
    held, embed, lm = inp.examples, inp.embed_w, inp.lm_head_w
    rows = []
    for path in args.drafter:
        _, drafter = inp.drafter(path)
        k = drafter.config.num_draft_tokens
        # A reduced draft vocabulary drafts as vLLM serves it: its argmax inside the subset,
        # the target's over the whole vocabulary (cached labels).
        vocab = load_draft_vocab(path, dtype=torch.float32)
        if vocab is not None:
            add_target_labels(held, lm)
        scores = args.suffix_tree or []
        names = list(POLICIES) + [f"{p}@{m:g}" for m in scores for p in TREE_POLICIES]
        totals = {p: WalkTotals() for p in names}
        per_seq: dict[str, tuple[list[int], list[int]]] = {p: ([], []) for p in names}
        first = FirstToken()
        trees = {m: SuffixTreeLookup() for m in scores}
        for n, e in enumerate(held):
            acc = block_accepts(drafter, e, embed, lm, LossConfig(mode="ce"), draft_vocab=vocab)
            look = lookup_accepts(e.ids.tolist(), e.start, len(acc), k)
            first.add(first_token(acc, *look, k))
            walks = walk_policies(e.ids.tolist(), e.start, acc, k, lookup=look)
            for m, tree in trees.items():
                tw = walk_policies(e.ids.tolist(), e.start, acc, k, lookup=look, tree=tree_accepts(
                    tree, f"h{n}", e.ids.tolist(), e.start, len(acc), k, m))
                walks.update({f"{p}@{m:g}": tw[p] for p in TREE_POLICIES})
            for p, w in walks.items():
                t = totals[p]
                t.steps, t.tokens = t.steps + w.steps, t.tokens + w.tokens
                t.drafted_steps += w.drafted_steps
                t.drafted_tokens += w.drafted_tokens
                per_seq[p][0].append(w.steps)
                per_seq[p][1].append(w.tokens)
        row = {"drafter": path, "K": k, "sequences": len(held),
               "draft_vocab_size": len(vocab) if vocab is not None else None,
               "first_token": first.as_dict(),
               **{p: {**asdict(t), "tokens_per_step": round(t.per_step, 3),
                      "tokens_per_step_se": round(ratio_se(*per_seq[p]), 3),
                      "tokens_per_drafted_step": round(t.per_drafted_step, 3)}
                  for p, t in totals.items()}}
        rows.append(row)
        print(json.dumps({"drafter": path, **{p: row[p]["tokens_per_step"] for p in names},
                          "dflash_se": row["dflash"]["tokens_per_step_se"],
                          "ngram_per_drafted_step": row["ngram"]["tokens_per_drafted_step"],
                          **row["first_token"]}))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "hybrid_ceiling.json").write_text(json.dumps(rows, indent=1) + "\n")
        lines = ["# DFlash drafter + prompt lookup: offline held-out walk (tokens per verify step)",
                 "", f"Held-out greedy answers of `{args.data}` ({len(held)} sequences), the walk "
                 "of lab/hybrid_ceiling.py (its docstring defines the four proposers).", "",
                 "```bash", "python lab/hybrid_ceiling.py --data " + args.data + " "
                 + " ".join(f"--drafter {p}" for p in args.drafter) + f" --out {args.out}", "```", "",
                 "Tokens per verify step (± bootstrap standard error over sequences); first-token "
                 "accuracy split by whether prompt lookup has a K-token match at the position.", "",
                 "| drafter | K | dflash | ngram (all steps) | ngram (drafted steps) | "
                 "ngram-first | oracle | lookup-hit share | first token on hit: dflash / lookup "
                 "| first token on miss: dflash |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ft = r["first_token"]
            lines.append(f"| {r['drafter']} | {r['K']} | {r['dflash']['tokens_per_step']:.3f} "
                         f"± {r['dflash']['tokens_per_step_se']:.3f} | "
                         f"{r['ngram']['tokens_per_step']:.3f} | "
                         f"{r['ngram']['tokens_per_drafted_step']:.3f} | "
                         f"{r['ngram-first']['tokens_per_step']:.3f} "
                         f"± {r['ngram-first']['tokens_per_step_se']:.3f} | "
                         f"{r['oracle']['tokens_per_step']:.3f} | {ft['lookup_hit_share']} | "
                         f"{ft['dflash_first_on_hit']} / {ft['lookup_first_on_hit']} | "
                         f"{ft['dflash_first_on_miss']} |")
        tree_cols = [k for k in rows[0] if "@" in k] if rows else []
        if tree_cols:
            lines += ["", "SuffixDecoding's trees (`--suffix-tree MIN_SCORE ...`), tokens per verify "
                      "step: the tree alone, and tree-first (the drafter where the tree's score "
                      "is below MIN_SCORE):", "", "| drafter | " + " | ".join(tree_cols) + " |",
                      "|---|" + "---|" * len(tree_cols)]
            for r in rows:
                lines.append(f"| {r['drafter']} | " + " | ".join(
                    f"{r[c]['tokens_per_step']:.3f} ± {r[c]['tokens_per_step_se']:.3f}"
                    for c in tree_cols) + " |")
        (out / "hybrid_ceiling.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ValueError as e:  # a drafter that does not fit the shards: one line, not a trace
        raise SystemExit(f"error: {e}")
