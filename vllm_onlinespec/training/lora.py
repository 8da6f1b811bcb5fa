"""Low-rank adapters for a target model, in plain PyTorch and PEFT's file format.

What the changed-target recipe (training/variant.py) fine-tunes: `attach` wraps chosen Linear
layers of an HF causal LM so that y = W x + (alpha / r) * B(A(x)), with W frozen and A, B
trained; `save` writes `adapter_model.safetensors` + `adapter_config.json` with PEFT's key
names (so `peft` can load the adapter too), `load` reads them back, and `merge` folds B A into W
for an ordinary HF folder vLLM serves. No dependency on `peft`: the math is five lines.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# PEFT names a wrapped module's factors "<module path>.lora_A.weight" under this prefix.
PEFT_PREFIX = "base_model.model."
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter folder that cannot be applied; the message is one line saying why."""


@dataclass(frozen=True)
class LoRAConfig:
    r: int = 8  # rank of each update
    alpha: float = 16.0  # the update is scaled by alpha / r
    targets: tuple[str, ...] = DEFAULT_TARGETS  # Linear module names (last path component)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise AdapterError(f"LoRA rank r must be >= 1 (got {self.r})")
        if not self.targets:
            raise AdapterError("LoRA targets must name at least one module")

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def to_peft(self, base: str) -> dict:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r,
                "lora_alpha": self.alpha, "target_modules": list(self.targets),
                "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base}

    @classmethod
    def from_peft(cls, d: dict) -> "LoRAConfig":
        if d.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"adapter peft_type is {d.get('peft_type')!r}, not 'LORA'")
        try:
            return cls(r=int(d["r"]), alpha=float(d["lora_alpha"]),
                       targets=tuple(d["target_modules"]))
        except KeyError as e:
            raise AdapterError(f"{ADAPTER_CONFIG} lacks the field {e.args[0]!r}") from None


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable rank-r update. B starts at zero: attached, the model
    computes exactly what it did before."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.scale = cfg.scale
        self.lora_A = nn.Linear(base.in_features, cfg.r, bias=False, dtype=torch.float32)
        self.lora_B = nn.Linear(cfg.r, base.out_features, bias=False, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.to(base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scale
        return self.base(x) + update.to(x.dtype)

    def delta(self) -> torch.Tensor:
        """The dense update B A * scale, float32 [out, in]."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scale


def attach(model: nn.Module, cfg: LoRAConfig, under: list[str] | None = None
           ) -> dict[str, LoRALinear]:
    """Wrap every Linear whose name is in cfg.targets (inside one of the module paths `under`,
    when given); freezes everything else. Returns the wrappers by module path."""
    for p in model.parameters():
        p.requires_grad_(False)
    found: dict[str, LoRALinear] = {}
    for path, module in list(model.named_modules()):
        if under is not None and not any(path == u or path.startswith(u + ".") for u in under):
            continue
        for name, child in list(module.named_children()):
            if name in cfg.targets and isinstance(child, nn.Linear):
                wrapped = LoRALinear(child, cfg)
                setattr(module, name, wrapped)
                found[f"{path}.{name}" if path else name] = wrapped
    if not found:
        raise AdapterError(f"no Linear module named any of {', '.join(cfg.targets)} in the model")
    return found


def state_dict(wrappers: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """PEFT-named factors: base_model.model.<path>.lora_{A,B}.weight."""
    out = {}
    for path, w in wrappers.items():
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = w.lora_A.weight.detach().cpu().contiguous()
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = w.lora_B.weight.detach().cpu().contiguous()
    return out


def save(wrappers: dict[str, LoRALinear], cfg: LoRAConfig, out: str | Path, *, base: str,
         dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in state_dict(wrappers).items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps({**cfg.to_peft(base), **(extra or {})}, indent=2))
    return out


def load(folder: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(config, {module path: (A, B) factors as 'path.lora_A' / 'path.lora_B'}) of an adapter
    folder; a missing file or a malformed key is one line."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / f).is_file():
            raise AdapterError(f"adapter folder {folder} lacks {f}")
    cfg = LoRAConfig.from_peft(json.loads((folder / ADAPTER_CONFIG).read_text()))
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    bad = [k for k in tensors if not (k.startswith(PEFT_PREFIX)
                                      and k.endswith((".lora_A.weight", ".lora_B.weight")))]
    if bad:
        raise AdapterError(f"adapter weight {bad[0]!r} is not a PEFT LoRA factor name")
    return cfg, {k[len(PEFT_PREFIX):-len(".weight")]: v for k, v in tensors.items()}


def merge(model: nn.Module, cfg: LoRAConfig, factors: dict[str, torch.Tensor]) -> int:
    """W += scale * B A for every adapted Linear of a plain (unwrapped) model, in float32 then
    back to W's dtype. Returns the number of merged modules; a factor naming a module the model
    lacks, or of the wrong shape, is one line."""
    modules = dict(model.named_modules())
    paths = sorted({k.rsplit(".", 1)[0] for k in factors})
    for path in paths:
        lin = modules.get(path)
        if not isinstance(lin, nn.Linear):
            raise AdapterError(f"adapter names module {path!r}, which the model does not have")
        A, B = factors.get(f"{path}.lora_A"), factors.get(f"{path}.lora_B")
        if A is None or B is None:
            raise AdapterError(f"adapter has only one factor for {path!r}")
        if A.shape != (cfg.r, lin.in_features) or B.shape != (lin.out_features, cfg.r):
            raise AdapterError(f"adapter factors for {path!r} are {tuple(A.shape)} / "
                               f"{tuple(B.shape)}; the model needs ({cfg.r}, {lin.in_features}) / "
                               f"({lin.out_features}, {cfg.r})")
        with torch.no_grad():
            w = lin.weight.float() + (B.float() @ A.float()) * cfg.scale
            lin.weight.copy_(w.to(lin.weight.dtype))
    return len(paths)
