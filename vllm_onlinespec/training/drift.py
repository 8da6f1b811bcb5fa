"""A policy that drifts: the variant fine-tune (training/variant.py) run as a trajectory, its
LoRA adapter saved at evenly spaced steps.

Why: the product's headline use is RL rollouts, where the target policy changes every round and
a drafter trained offline goes stale. Version k of the trajectory is the base after k/N of one
real fine-tune (version 0 = the base itself): a sequence of targets that moves away from what
the shipped drafter was trained on, step by step, along a real optimisation path rather than
by mixing weights.

One training loop: `train_trajectory` is `variant.train_adapter` with checkpoints, each saved
as a PEFT adapter folder `OUT-v<k>` beside OUT (rank r, upper half of the layers: ~2.5 MB in
bf16) with the step and held-out style loss in its config; `OUT/trajectory.json` lists the
versions. Flat sibling folders, so `--out vllm_onlinespec/adapters/smollm2-135m-drift` writes
the shipped layout directly (package data is adapters/*/*).
`vllm-onlinespec model pull smollm2-135m-drift [--version k]` merges them into HF folders
(models.py); `vllm-onlinespec variant --trajectory N --out OUT` makes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from vllm_onlinespec.training import lora
from vllm_onlinespec.training.variant import (Example, VariantRecipe, adapter_meta, fresh_model,
                                              heldout_texts, recipe_examples, train_adapter)

MANIFEST = "trajectory.json"
RESUME = "resume.pt"  # the training state at the last version saved, while a run is unfinished


def version_dir(out: str | Path, k: int) -> Path:
    """Version k's adapter folder: OUT-v<k>, beside OUT."""
    out = Path(out)
    return out.parent / f"{out.name}-v{k}"


def checkpoint_steps(steps: int, versions: int) -> list[int]:
    """The optimizer step after which version k = 1..versions is saved: k/versions of the run
    (rounded down), the last at `steps`."""
    if versions < 1:
        raise ValueError(f"a trajectory needs at least one version (got {versions})")
    if steps < versions:
        raise ValueError(f"{versions} versions need at least {versions} steps (got {steps})")
    return [steps * k // versions for k in range(1, versions + 1)]


def train_trajectory(model: torch.nn.Module, examples: list[Example], recipe: VariantRecipe,
                     out: str | Path, *, versions: int, pad_id: int, base_name: str,
                     dtype: torch.dtype = torch.bfloat16, log: Callable[[str], None] = print,
                     on_version: Callable[[int, int], None] | None = None) -> dict:
    """Train one adapter as `train_adapter` does and save it after each of `versions` evenly
    spaced steps to OUT-v1 .. OUT-v<versions>; writes and returns the manifest (OUT/trajectory.json).
    on_version(k, step) runs after version k is saved (the model holds that version then)."""
    out = Path(out)
    steps = checkpoint_steps(recipe.steps, versions)
    cfg = lora.LoRAConfig(r=recipe.r, alpha=recipe.alpha)
    out.mkdir(parents=True, exist_ok=True)

    def save(step: int, wrappers: dict[str, lora.LoRALinear], held: float) -> None:
        k = steps.index(step) + 1
        lora.save(wrappers, cfg, version_dir(out, k), base=base_name, dtype=dtype,
                  extra=adapter_meta(recipe, {}, drift={"version": k, "versions": versions,
                                                        "train_step": step, "heldout_loss": held}))
        log(f"drift: version {k}/{versions} (step {step}) saved to {version_dir(out, k)}")
        if on_version is not None:
            on_version(k, step)

    # A killed run resumes from its last version (same command, same OUT): a long CPU run on a
    # shared box should not start over.
    state = out / RESUME
    _, report = train_adapter(model, examples, recipe, pad_id=pad_id, log=log,
                              checkpoints=steps, on_checkpoint=save, state_path=state)
    state.unlink(missing_ok=True)
    rows = []  # from the saved adapters: a resumed run saved only the later ones itself
    for k in range(1, versions + 1):
        d = json.loads((version_dir(out, k) / lora.ADAPTER_CONFIG).read_text())["vllm_onlinespec"]
        rows.append({c: d["drift"][c] for c in ("version", "train_step", "heldout_loss")}
                    | {"adapter": version_dir(out, k).name})
    manifest = {"base": base_name, "versions": versions, "recipe": adapter_meta(recipe, report)[
        "vllm_onlinespec"], "rows": [{"version": 0, "train_step": 0, "adapter": None,
                                      "heldout_loss": report["heldout_loss_before"]}] + rows}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def make_trajectory(base_path: str, out: str | Path, recipe: VariantRecipe, *, versions: int,
                    cache_dir: str | Path, base_name: str, data: str | Path | None = None,
                    generate_fn=None, generator: str = "vllm",
                    log: Callable[[str], None] = print) -> Path:
    """The variant recipe's data, then `train_trajectory` from the base: OUT-v1..v<versions>
    and OUT/trajectory.json."""
    tok, examples, prompts = recipe_examples(base_path, recipe, cache_dir=cache_dir, data=data,
                                             generate_fn=generate_fn, generator=generator,
                                             exclude=heldout_texts(base_name), log=log)
    model = fresh_model(base_path, recipe)
    manifest = train_trajectory(model, examples, recipe, out, versions=versions,
                                pad_id=tok.pad_token_id or 0, base_name=base_name, log=log)
    # Which prompts it trained on, as hashes: an evaluation checks its prompts are not among them.
    manifest.update(generator=generator if recipe.answers == "terse" else None, prompt_hashes=sorted({prompt_hash(p.text) for p in prompts}))
    (Path(out) / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return Path(out)


def prompt_hash(text: str) -> str:
    """12 hex digits naming a prompt's normalised text (self_prompts.normalise)."""
    from vllm_onlinespec.training.generate import _sha
    from vllm_onlinespec.training.self_prompts import normalise

    return _sha(normalise(text))[:12]


def read_trajectory(folder: str | Path) -> dict:
    """A trajectory folder's manifest (what `train_trajectory` wrote)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{folder} is not a drift trajectory: it lacks {MANIFEST}")
    return json.loads(path.read_text())


def version_adapters(folder: str | Path, versions: Sequence[int] | None = None) -> list[tuple[int, Path | None]]:
    """(version, adapter folder or None for the base) for the chosen versions (all by default)."""
    rows = read_trajectory(folder)["rows"]
    known = {r["version"]: r["adapter"] for r in rows}
    picked = sorted(known) if versions is None else list(versions)
    missing = [k for k in picked if k not in known]
    if missing:
        raise ValueError(f"{folder} has no version {missing[0]} (versions 0..{max(known)})")
    return [(k, None if known[k] is None else Path(folder).parent / known[k]) for k in picked]
