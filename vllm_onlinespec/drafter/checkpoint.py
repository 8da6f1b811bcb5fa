"""Drafter checkpoints in the folder layout vLLM loads with `method: "dflash"`.

    config.json                    DFlashConfig.to_hf_dict()
    model.safetensors              drafter tensors only (no embed_tokens/lm_head: the target's);
                                   with a reduced draft vocabulary also `lm_head.weight` [Vd, H]
                                   and `d2t` [Vd] int64, vLLM's names (drafter/vocab.py)
    model.safetensors.index.json   weight_map of exactly those tensors, so vLLM's loader skips
                                   every other *.safetensors file in the folder
    length_head.safetensors        optional, keys `length_head.*`: vLLM's AutoWeightsLoader raises
                                   on unknown names, so the head must stay out of model.safetensors
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from .config import DFlashConfig
from .length_head import LengthHead
from .model import DFlashDrafter
from .vocab import DraftVocab

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
LENGTH_HEAD = "length_head.safetensors"
LENGTH_PREFIX = "length_head."
_TARGET_OWNED = ("embed_tokens.", "lm_head.")  # shipped by some foreign checkpoints; not ours
_VOCAB_KEYS = ("lm_head.weight", "d2t")  # a reduced draft vocabulary (load_draft_vocab)
_IGNORED = ("t2d",)  # EAGLE-3's reverse map: vLLM ignores it too


def state_dict_for_vllm(drafter: DFlashDrafter, dtype: torch.dtype | None = None) -> list[tuple[str, Tensor]]:
    """(name, tensor) pairs for `drafter.model.load_weights(...)`: our names are vLLM's names."""
    return [(name, t.detach().to(dtype or t.dtype)) for name, t in drafter.state_dict().items()]


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _tensors(pairs: Iterator[tuple[str, Tensor]] | list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    # safetensors refuses shared or strided storage; own contiguous CPU copies are always safe.
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in pairs}


def save_drafter(path: str | os.PathLike, config: DFlashConfig, drafter: DFlashDrafter,
                 length_head: LengthHead | None = None, dtype: torch.dtype | None = None,
                 draft_vocab: DraftVocab | None = None) -> Path:
    """Write the checkpoint folder atomically: readers see the old folder or the new one, never a
    half-written one. dtype defaults to config.torch_dtype (training may run in fp32).
    draft_vocab: a reduced draft vocabulary (sets config.draft_vocab_size)."""
    dst = Path(path)
    dtype = dtype or getattr(torch, config.torch_dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    if config.draft_vocab_size is not None and draft_vocab is None:
        raise ValueError("save_drafter: the config has draft_vocab_size "
                         f"{config.draft_vocab_size} but no draft_vocab was given")
    cfg = dataclasses.replace(config, torch_dtype=dtype_name, draft_vocab_size=(
        len(draft_vocab) if draft_vocab is not None else None))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        weights = _tensors(state_dict_for_vllm(drafter, dtype))
        if draft_vocab is not None:
            weights.update(_tensors([("lm_head.weight", draft_vocab.weight.to(dtype)),
                                     ("d2t", draft_vocab.d2t())]))
        save_file(weights, tmp / WEIGHTS, metadata={"format": "pt"})
        total = sum(t.numel() * t.element_size() for t in weights.values())
        _write_json(tmp / INDEX, {"metadata": {"total_size": total},
                                  "weight_map": {name: WEIGHTS for name in weights}})
        _write_json(tmp / CONFIG, cfg.to_hf_dict())
        if length_head is not None:
            head = _tensors((LENGTH_PREFIX + k, v) for k, v in length_head.state_dict().items())
            save_file(head, tmp / LENGTH_HEAD, metadata={
                "format": "pt", "hidden_size": str(length_head.hidden_size),
                "width": str(length_head.width)})
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        # os.replace cannot overwrite a non-empty folder: move the old one aside first.
        old = None
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / dst.name)
        os.replace(tmp, dst)
        fsync_path(dst.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def load_drafter_config(path: str | os.PathLike) -> DFlashConfig:
    """A drafter folder's config.json (ours or a public z-lab one), without its weights."""
    src = Path(path)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such drafter checkpoint folder")
    try:
        raw = json.loads((src / CONFIG).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{src}: missing {CONFIG}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{src / CONFIG}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{src / CONFIG}: expected a JSON object")
    return DFlashConfig.from_hf_dict(raw)


def load_drafter(path: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> tuple[DFlashConfig, DFlashDrafter, LengthHead | None]:
    """Load our checkpoints and public z-lab DFlash ones (sharded or not). dtype defaults to the
    checkpoint's torch_dtype."""
    src = Path(path)
    config = load_drafter_config(src)

    files = [WEIGHTS]
    if (src / INDEX).is_file():
        try:
            files = sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{src / INDEX}: invalid index ({e!r})") from None
    weights: dict[str, Tensor] = {}
    for name in files:
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src}: missing weight file {name}")
        weights.update(_read_safetensors(src / name))
    weights = {k: v for k, v in weights.items()
               if not k.startswith(_TARGET_OWNED) and k not in _VOCAB_KEYS + _IGNORED}

    drafter = DFlashDrafter(config)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{src}: weights do not match the config: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise ValueError(f"{src}: {k} has shape {list(v.shape)}, config needs {list(expected[k].shape)}")
    dtype = dtype or getattr(torch, config.torch_dtype)
    drafter.load_state_dict(weights)
    drafter.to(device=device, dtype=dtype)

    head = None
    if (src / LENGTH_HEAD).is_file():
        sd = {k.removeprefix(LENGTH_PREFIX): v for k, v in _read_safetensors(src / LENGTH_HEAD).items()}
        if "inp.weight" not in sd:
            raise ValueError(f"{src / LENGTH_HEAD}: no {LENGTH_PREFIX}inp.weight")
        width, two_h = sd["inp.weight"].shape
        head = LengthHead(two_h // 2, width)
        try:
            head.load_state_dict(sd)
        except RuntimeError as e:
            raise ValueError(f"{src / LENGTH_HEAD}: {str(e).splitlines()[0]}") from None
        head.to(device=device, dtype=dtype)
    return config, drafter, head


def load_draft_vocab(path: str | os.PathLike, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> DraftVocab | None:
    """The checkpoint's reduced draft vocabulary (its own lm_head rows and d2t), or None when
    it drafts over the target's whole vocabulary. A missing or inconsistent tensor fails in
    one line naming it."""
    src = Path(path)
    config = load_drafter_config(src)
    if config.draft_vocab_size is None:
        return None
    files = [WEIGHTS]
    if (src / INDEX).is_file():
        files = sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    found: dict[str, Tensor] = {}
    for name in files:
        found.update({k: v for k, v in _read_safetensors(src / name).items() if k in _VOCAB_KEYS})
    for key in _VOCAB_KEYS:
        if key not in found:
            raise ValueError(f"{src}: draft_vocab_size is {config.draft_vocab_size} but the "
                             f"checkpoint has no {key!r}")
    w = found["lm_head.weight"]
    if list(w.shape) != [config.draft_vocab_size, config.hidden_size]:
        raise ValueError(f"{src}: lm_head.weight has shape {list(w.shape)}, config needs "
                         f"[{config.draft_vocab_size}, {config.hidden_size}]")
    vocab = DraftVocab.from_d2t(found["d2t"], w, config.vocab_size, where=str(src))
    return vocab.to(device=device, dtype=dtype or getattr(torch, config.torch_dtype))
