"""Where the DFlash drafter's blocks are used when it serves beside the suffix tree.

The hybrid proposer (serving/lookup.py, source 'suffix_tree') takes the tree's draft wherever
its score reaches `suffix_min_score` and the drafter's block everywhere else. A drafter that
serves that way is only ever asked at the positions where the tree is not confident; training
it only there (`train --anchors tree-miss`) spends its capacity on those positions.

`mark_tree_misses` walks the training answers in order through one SuffixTreeLookup as serving
would (each answer's own text so far, plus every earlier answer's output in the global tree)
and marks each response position where the tree's score stays below the threshold.

Core module: torch and the suffix tree (arctic-inference); no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_onlinespec.drafter.suffix_tree import SuffixTreeLookup

ANCHOR_MODES = ("all", "tree-miss")


def mark_tree_misses(examples: Sequence[Any], min_score: float, k: int) -> float:
    """Set each example's `anchor_ok` [T] bool: True at response positions (anchors: the last
    committed token, the block drafts what follows) where the tree's draft of up to k tokens
    scores below `min_score`. Returns the share of response positions marked."""
    tree = SuffixTreeLookup()
    marked = total = 0
    for i, e in enumerate(examples):
        ids = e.ids.tolist()
        ok = torch.zeros(len(ids), dtype=torch.bool)
        rid = f"train-{i}"
        for a in range(max(0, e.start - 1), len(ids) - 1):
            ok[a] = tree.propose(rid, ids[: a + 1], k).score < min_score
        tree.finish([rid])
        e.anchor_ok = ok
        n = max(0, len(ids) - 1 - max(0, e.start - 1))
        marked += int(ok.sum())
        total += n
    return marked / max(total, 1)
