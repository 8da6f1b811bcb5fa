"""Arm names -> ArmSpec.

    nospec                       plain vLLM, no speculation
    ngram                        vLLM's prompt-lookup speculation, same K as the drafter
    vllm-suffix, vllm-suffix<K>  vLLM's suffix decoding (`method: "suffix"`, arctic-inference's
                                 trees, no drafter) at its own default K (24), or at K
    vllm-dflash                  vLLM's own DFlash worker with our drafter, fixed K, no onlinespec
    vllm-dynamic                 the same with vLLM's per-batch-size K (`k_per_batch_size`, a list
                                 of [first_bs, last_bs, K] applied by vLLM's scheduler; K >= 0)
    frozen                       our DFlash drafter, onlinespec enabled=false (start weights only)
    k0                           our worker drafting nothing in every step (context-only K = 0):
                                 the price of the plugin and drafter with no speculation
    online-<algorithm>           learning on: ogd | optimistic | optimistic_momentum | ensemble
    shadow                       the ogd learner runs but never publishes: serving keeps the start
                                 weights, so shadow vs frozen is the learner's cost to serving
    fixed | adaflash | budget    learning on (ogd) with that verify-length policy
    frozen-adaflash, ...         a policy without learning
    <arm>+lookup                 any of our DFlash arms with prompt lookup where the request's own
                                 text predicts what follows (config `prompt_lookup`), the drafter
                                 elsewhere: frozen+lookup, online-ogd+lookup, ...
    <arm>+tree                   the same with the suffix tree as lookup source and K = 16 (the
                                 drafter drafts its own block): frozen+tree, budget+tree, ...
    <arm>+nolookup               the drafter alone where the base settings would look up
    <arm>+confidence             the budget with vLLM-style acceptance estimates (an online
                                 logistic model on the drafter's top-1 probability) instead of
                                 the length head: frozen+confidence, ...
    <arm>+unpriced               the budget verifying suffix-tree drafts whole (vLLM's suffix
                                 decoding's rule) instead of pricing them
    <arm>+gateonly               the budget's cost-model gate alone, without the choice among
                                 plain / tree / drafter by measured cycles
    <arm>+slowest                that choice priced by the request furthest from its end
                                 (option_objective 'slowest': a closed batch, RL rollouts)
    <arm>+auto                   priced so while the batch takes no new request, by every
                                 token otherwise (option_objective 'auto')
    <arm>+tokens                 priced by every token produced, whatever the batch
                                 (option_objective 'tokens', the cpu preset's)
    <arm>+coldgate               a batch bucket not measured yet runs the gate's pick instead
                                 of the nearest measured bucket's winner (option_cold_pick)
    <arm>+nomargin               the tree or the drafter chosen over plain at any measured
                                 gain, not only at 5 % (option_margin 0)
    <arm>+contextnow             a step that drafts nothing writes the drafter's context K/V
                                 at once (k0_step 'context_only') instead of deferring it
    <arm>+coupled                sampled requests verified drafter-invariantly get drafts drawn
                                 with the verifier's noise (sampling.coupled_drafts)
    <arm>+vllmgreedy             all-greedy steps verified by vLLM's rejection sampler as
                                 shipped (a float32 argmax of every draft row) instead of on
                                 each row's first maximum (serving/compat/greedy_verify.py)

Every arm of ours starts from the same drafter weights and the same base settings (`online`
below: by default the `cpu` preset, vllm_onlinespec/presets.py, so `frozen` is the recommended
recipe with learning off and `online-ogd` with it on), so arms differ only in what their name
says. Learning arms checkpoint into
`<out>/checkpoints/<arm>` at shutdown (the runner empties it first: an arm never resumes).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from vllm_onlinespec.bench.results import ArmSpec
from vllm_onlinespec.presets import LEARNER, PRESET_K, SERVING_CPU, merge, preset

ALGORITHMS = ("ogd", "optimistic", "optimistic_momentum", "ensemble")
POLICIES = ("fixed", "adaflash", "budget")
NEVER = 10**12  # publish.every_n_updates that no run reaches

# Online settings of every learning arm and the CPU serving recipe: the `cpu` preset's two halves
# (vllm_onlinespec/presets.py says what chose each value). `bench`, `bench-serve` and the demo
# serve the whole preset by default (--preset cpu); an arm's name says where it departs from it.
DEFAULT_ONLINE: dict = LEARNER
SERVING_RECIPE: dict = SERVING_CPU


def base_settings(preset_name: str | None) -> dict:
    """The settings every arm of ours starts from: the named preset, or (None / "none") the
    learner's settings alone, with the config's defaults for serving (fixed K, no lookup)."""
    if preset_name in (None, "none"):
        return copy.deepcopy(LEARNER)
    return preset(preset_name)


def drafter_k(drafter: str | Path) -> int:
    """num_speculative_tokens for a drafter folder: its block_size - 1 (DFlash blocks include
    the last committed token)."""
    from vllm_onlinespec.drafter.checkpoint import load_drafter_config

    return load_drafter_config(drafter).num_draft_tokens


def needs_drafter(name: str) -> bool:
    """Whether the arm serves a DFlash drafter (vLLM's ngram and suffix decoding do not)."""
    return _parse(name)[0] == "dflash"


def known_arm(name: str) -> bool:
    try:
        _parse(name)
        return True
    except ValueError:
        return False


def _policy(name: str) -> dict:
    # The budget may verify nothing for a request (k_min 0): that, and its step gate,
    # are what let it fall back to plain decoding where a draft does not pay.
    return {"policy": name, "k_min": 0} if name == "budget" else {"policy": name}


LOOKUP_SUFFIX = "+lookup"
# <our arm>+tree: the suffix tree as the lookup source with vLLM's K = TREE_K: the drafter drafts
# its own block, a confident tree match up to TREE_K tokens (vLLM's suffix decoding's own K);
# docs/results/suffix_hybrid.md measured it against K = 4 and vLLM's suffix decoding.
TREE_SUFFIX = "+tree"
NO_LOOKUP_SUFFIX = "+nolookup"  # the drafter alone, where the base settings would look up
TREE_K = PRESET_K["cpu"]


VLLM_SUFFIX = "vllm-suffix"
VLLM_SUFFIX_DEFAULT_K = 24  # vLLM's suffix_decoding_max_tree_depth, its K when none is given


def suffix_k(name: str) -> int | None:
    """K of a vLLM suffix-decoding arm name (`vllm-suffix` = vLLM's default), else None."""
    if not name.startswith(VLLM_SUFFIX):
        return None
    tail = name[len(VLLM_SUFFIX):]
    if not tail:
        return VLLM_SUFFIX_DEFAULT_K
    return int(tail) if tail.isdigit() and int(tail) > 0 else None


# <our arm><suffix>: one config section's settings merged over the arm's own.
ARM_SUFFIXES: dict[str, tuple[str, dict]] = {
    TREE_SUFFIX: ("prompt_lookup", {"enabled": True, "source": "suffix_tree"}),
    LOOKUP_SUFFIX: ("prompt_lookup", {"enabled": True, "source": "ngram"}),
    NO_LOOKUP_SUFFIX: ("prompt_lookup", {"enabled": False}),
    "+confidence": ("length_head", {"estimator": "confidence"}),
    "+unpriced": ("length_head", {"price_lookup": False}),
    "+gateonly": ("length_head", {"options": ["drafter"]}),
    # the budget held to one option: what each of the preset's options serves on its own
    "+plainonly": ("length_head", {"options": ["plain"]}),
    "+treeonly": ("length_head", {"options": ["tree"]}),
    "+slowest": ("length_head", {"option_objective": "slowest"}),
    "+auto": ("length_head", {"option_objective": "auto"}),
    "+tokens": ("length_head", {"option_objective": "tokens"}),
    "+coldgate": ("length_head", {"option_cold_pick": "gate"}),
    "+nomargin": ("length_head", {"option_margin": 0.0}),
    "+contextnow": ("length_head", {"k0_step": "context_only"}),
    # sampled requests: drafts drawn with the invariant verifier's own noise
    "+coupled": ("sampling", {"coupled_drafts": True}),
}


# <arm><suffix>: the arm's engine process started with these environment variables.
# +iomp: Intel OpenMP preloaded for this project's engines (serving/openmp.py); +gomp: torch's
# libgomp, as vLLM's own arms run (the default). +vllmgreedy: all-greedy steps verified by
# vLLM's own rejection sampler instead of compat/greedy_verify.py.
ENV_SUFFIXES: dict[str, dict[str, str]] = {"+iomp": {"VLLM_ONLINESPEC_IOMP": "1"},
                                           "+gomp": {"VLLM_ONLINESPEC_IOMP": "0"},
                                           "+vllmgreedy": {"VLLM_ONLINESPEC_GREEDY_VERIFY": "0"}}


def _split_env(name: str) -> tuple[str, dict[str, str]]:
    """(the arm name without environment suffixes, the environment they set)."""
    env: dict[str, str] = {}
    again = True
    while again:
        again = False
        for sfx, setting in ENV_SUFFIXES.items():
            if name.endswith(sfx):
                name, env, again = name[: -len(sfx)], {**setting, **env}, True
    return name, env


def _parse(name: str) -> tuple[str, dict | None]:
    """(method, onlinespec overrides or None) for an arm name."""
    name = _split_env(name)[0]
    for sfx, (section, setting) in ARM_SUFFIXES.items():
        if name.endswith(sfx):
            base = name[: -len(sfx)]
            method, over = _parse(base)
            if over is None:  # only our worker has these parts (vLLM's own arms have no hook)
                raise ValueError(f"arm {name!r}: {sfx} goes with this project's DFlash arms "
                                 f"(frozen, online-<algorithm>, shadow, a policy), not {base!r}")
            return method, {**over, section: {**over.get(section, {}), **setting}}
    if name == "nospec":
        return "none", None
    if name == "ngram":
        return "ngram", None
    if suffix_k(name) is not None:
        return "suffix", None
    if name in ("vllm-dflash", "vllm-dynamic"):
        return "dflash", None
    if name == "frozen":
        return "dflash", {"enabled": False}
    if name == "k0":  # the floor: every step drafts nothing (the drafter's context K/V only)
        return "dflash", {"enabled": False, "features": {"plain": True}}
    if name == "shadow":
        return "dflash", {"update": {"algorithm": "ogd"}, "publish": {"every_n_updates": NEVER}}
    if name.startswith("online-") and name[7:] in ALGORITHMS:
        return "dflash", {"update": {"algorithm": name[7:]}}
    if name in POLICIES:
        return "dflash", {"length_head": _policy(name)}
    if name.startswith("frozen-") and name[7:] in POLICIES:
        return "dflash", {"enabled": False, "length_head": _policy(name[7:])}
    raise ValueError(f"unknown arm {name!r}; known: nospec, ngram, vllm-suffix[K], vllm-dflash, "
                     "vllm-dynamic, "
                     "frozen, k0, shadow, "
                     + ", ".join(f"online-{a}" for a in ALGORITHMS) + ", "
                     + ", ".join(POLICIES) + ", frozen-<policy>, and <our arm>+lookup, +tree, "
                     "+nolookup, +confidence, +unpriced, +gateonly, +slowest, +auto, +tokens, +coldgate, "
                     "+nomargin, "
                     "+contextnow or "
                     "+coupled; "
                     "any arm +iomp or +gomp")


def merge_sections(base: dict, over: dict) -> dict:
    """`over` on a copy of `base`, config sections (dicts) merged key by key (an old flat key
    such as `lr` is left at the top level, where validation refuses it naming its section)."""
    return merge(base, over)


def _check_k_table(table) -> None:
    """The shape vLLM's scheduler accepts (v1/spec_decode/dynamic/utils.py), checked before a
    server starts so that a typo is one line here, not a failed start-up in a log."""
    ok = (isinstance(table, list) and table and all(
        isinstance(e, list | tuple) and len(e) == 3 and all(isinstance(x, int) for x in e)
        and 1 <= e[0] <= e[1] and e[2] >= 0 for e in table))
    starts = sorted(e[0] for e in table) if ok else []
    if not ok or starts[0] != 1:
        raise ValueError(f"k_per_batch_size must be a list of [first_bs, last_bs, K] with "
                         f"1 <= first_bs <= last_bs, K >= 0 and the first range starting at "
                         f"batch size 1; got {table!r}")


def checkpoint_dir(out_dir: str | Path, arm: str) -> Path:
    return Path(out_dir) / "checkpoints" / arm


def clear_own_checkpoints(spec: ArmSpec) -> None:
    """Empty the checkpoint folder make_arm chose for this arm (never one a user passed): a
    rerun into the same output folder must start from the drafter, not resume."""
    ckpt = (spec.onlinespec or {}).get("checkpoint", {}).get("dir")
    if ckpt and Path(ckpt) == checkpoint_dir(Path(spec.out).parent.parent, spec.name):
        shutil.rmtree(ckpt, ignore_errors=True)


def make_arm(name: str, *, target: str, prompts: str, out_dir: str | Path,
             drafter: str | None = None, num_speculative_tokens: int | None = None,
             online: dict | None = None, k_per_batch_size: list[list[int]] | None = None,
             **spec_kw) -> ArmSpec:
    method, over = _parse(name)
    if (name == "vllm-dynamic") != (k_per_batch_size is not None):
        raise ValueError("k_per_batch_size (--k-per-batch-size) goes with the vllm-dynamic arm, "
                         f"and that arm needs it; got arm {name!r} with "
                         f"k_per_batch_size={k_per_batch_size!r}")
    if k_per_batch_size is not None:
        _check_k_table(k_per_batch_size)
    onlinespec = None
    if over is not None:
        base = online if online is not None else DEFAULT_ONLINE
        onlinespec = merge_sections(base, over) if over.get("enabled", True) else merge_sections(
            {k2: v for k2, v in base.items() if k2 in ("length_head", "prompt_lookup")}, over)
        if onlinespec.get("enabled", True) and "dir" not in onlinespec.get("checkpoint", {}):
            onlinespec.setdefault("checkpoint", {})["dir"] = str(checkpoint_dir(out_dir, name))
    k = 0
    if method != "none":
        if drafter is None and method == "dflash":
            raise ValueError(f"arm {name!r} needs a drafter (--drafter or training)")
        lookup = (onlinespec or {}).get("prompt_lookup", {})
        tree = lookup.get("enabled") and lookup.get("source") == "suffix_tree"
        if method == "suffix":
            from vllm_onlinespec.drafter.suffix_tree import require_suffix_decoding

            require_suffix_decoding(f"arm {name!r}")  # one line here, not a failed server start
            k = suffix_k(name)
        else:
            k = num_speculative_tokens or (TREE_K if tree else drafter_k(drafter) if drafter else 4)
    env = _split_env(name)[1]
    if env:
        spec_kw["env"] = {**spec_kw.get("env", {}), **env}
    return ArmSpec(name=name, target=target, prompts=str(prompts),
                   out=str(Path(out_dir) / "arms" / f"{name}.json"), method=method,
                   drafter=drafter if method == "dflash" else None,
                   num_speculative_tokens=k, k_per_batch_size=k_per_batch_size,
                   onlinespec=onlinespec, **spec_kw)
