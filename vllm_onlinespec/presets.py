"""Named `onlinespec` settings: what was measured, under one name a user can copy. Start from
`cpu` (docs/configuration.md), overriding only what you need:

    --additional-config '{"onlinespec": {"preset": "cpu"}}'
    --additional-config '{"onlinespec": {"preset": "cpu", "enabled": false}}'   # drafter frozen

A preset fills the keys a config does not give; a key given explicitly wins
(`OnlineSpecConfig.from_any`). The demo, `vllm-onlinespec bench`, `bench-serve`, the examples
and the README serve the `cpu` preset, so what a user copies is what was measured. A GPU preset
is added when a GPU run has measured one; until then a GPU config starts from the defaults
(docs/gpu.md).
"""

from __future__ import annotations

import copy

# The learner's settings, chosen on the domain-shift benchmark's tuning stream (40 Spec-Bench
# math word problems the shipped drafter never saw; reported on other streams,
# docs/results/domain_shift.md and online_replay.md):
LEARNER: dict = {
    # lr 3e-4 over 1e-3 / 3e-3; ensemble_lrs bracket it for the ensemble rule.
    "update": {"algorithm": "ogd", "lr": 3e-4, "ensemble_lrs": [1e-4, 3e-4, 1e-3]},
    # The learner slows the serving core while it updates (13-25 % of a decode step as the
    # worker's thread, docs/results/learner_contention.md): 0.25 of a core at SCHED_IDLE served
    # 1.02-1.08x the 0.8 share's speed with the same acceptance (docs/results/learner_share.md).
    "pacing": {"learner_cpu_share": 0.25, "learner_priority": "idle"},
    # Replay fills each update from the same requests' recent tokens: the learner beside serving
    # gets ~20 fresh tokens between updates (1.85 vs 1.79-1.83 tokens per step).
    "replay": True,
    # Dense anchors: every fresh token anchors a block (1.031x the frozen acceptance against
    # 1.015x for tiling, by the deterministic replay).
    "anchor_stride": 1, "batch_blocks": 32, "anchors_per_request": 16,
    "min_new_tokens_per_update": 16,
    "buffer": {"window_tokens": 512, "max_tokens": 16384, "max_requests": 64},
    # Each publish re-packs vLLM's drafter on the engine thread (~10 ms on 2 cores): every 4th
    # update.
    "publish": {"every_n_updates": 4},
}

# How serving spends verify tokens on a CPU: the budget verifies the drafter's tokens only where
# they pay (k_min 0: a request may verify nothing, and its gate drafts nothing in steps that
# would not pay), and SuffixDecoding's tree drafts where the request's own text or earlier
# answers predict what follows (up to vLLM's num_speculative_tokens, PRESET_K; the drafter
# drafts its own block). On 80 unseen prompts, three passes: 1.01x / 1.21x the ngram-lookup
# recipe's tok/s at batch 1 / 8 and 1.02x / 1.07x vLLM's own suffix decoding
# (docs/results/suffix_hybrid.md). The budget also prices the tree's drafts
# (`length_head.price_lookup`, on by default): 1.12x / 1.23x the unpriced recipe at 4 / 32
# concurrent requests under `vllm serve` (docs/results/priced_lookup.md).
# Its choice among plain / tree / drafter prices every token a cycle produced. Pricing a closed
# batch by the request furthest from its end (`option_objective: "auto"`) served 1.08x / 1.03x
# that on sampled RL rollouts at 32 sequences (docs/results/rl_closed_batch.md) and 1.10-1.16x
# at 4 and 16 served requests in one or two waves, but 0.90-1.03x at 64 and 0.86x / 0.98x at
# batch 8 greedy offline, where the tree pays on most requests (docs/results/dominance.md): not
# the default until a whole comparison says so; set it for RL rollouts.
SERVING_CPU: dict = {"length_head": {"policy": "budget", "k_min": 0},
                     "prompt_lookup": {"enabled": True, "source": "suffix_tree"}}


def merge(base: dict, over: dict) -> dict:
    """`over` on a copy of `base`, sections (dicts) merged key by key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        nested = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = merge(out[k], v) if nested else copy.deepcopy(v)
    return out


PRESETS: dict[str, dict] = {"cpu": merge(LEARNER, SERVING_CPU)}
# vLLM's num_speculative_tokens each preset was measured with (a speculative_config key, outside
# `onlinespec`): the tree's matches draft up to 16 tokens, the drafter its trained block.
PRESET_K: dict[str, int] = {"cpu": 16}


def preset(name: str) -> dict:
    """A copy of the named preset's settings; ValueError naming the known ones."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])
