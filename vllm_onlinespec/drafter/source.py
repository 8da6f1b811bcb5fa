"""Where a drafter's files are: a local folder, or the local snapshot of a Hugging Face hub id.

vLLM accepts `"model": "z-lab/Qwen3-8B-DFlash-b16"` in --speculative-config and downloads it
with `huggingface_hub.snapshot_download(id, revision=..., cache_dir=load_config.download_dir)`
(model_loader/weight_utils.py: download_weights_from_hf) when it loads the drafter. The learner
must read the very same files, so it resolves the id the same way, from the local cache only:
by the time our session starts, vLLM has already fetched them. A drafter that is neither a
folder nor in the cache is one line naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name as the hub spells repository ids (huggingface_hub.utils.validate_repo_id).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
_PATTERNS = ["*.json", "*.safetensors"]  # what load_drafter reads (config, index, weights)


class DrafterNotFound(FileNotFoundError):
    """One line: the drafter named neither a folder nor a resolvable hub snapshot."""


def looks_like_hub_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def resolve_drafter_dir(name: str | os.PathLike, revision: str | None = None,
                        cache_dir: str | None = None, allow_download: bool = False) -> Path:
    """The folder holding the drafter's config.json and weights.

    name: a local folder, or a hub id (vLLM's speculative `model`).
    revision, cache_dir: as vLLM used them (draft model config's revision, --download-dir).
    allow_download: fetch a missing snapshot (only for callers that run before vLLM would have
    downloaded it, and only where vLLM itself would go online)."""
    path = Path(os.path.expanduser(str(name)))
    if path.is_dir():
        return path
    text = str(name)
    if not looks_like_hub_id(text):
        raise DrafterNotFound(f"onlinespec: drafter {text!r} is not a folder (and not a "
                              f"Hugging Face repository id)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        raise DrafterNotFound(f"onlinespec: drafter {text!r} is a hub id but huggingface_hub "
                              f"is not installed to resolve it") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        found = snapshot_download(text, revision=revision, cache_dir=cache_dir,
                                  allow_patterns=_PATTERNS,
                                  local_files_only=not allow_download or offline)
    except Exception as e:  # noqa: BLE001 - every hub failure becomes the same one line
        where = "the local Hugging Face cache" + (f" ({cache_dir})" if cache_dir else "")
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DrafterNotFound(f"onlinespec: drafter {text!r} (revision {revision or 'main'}) "
                              f"is not a folder and not in {where}: {reason}") from None
    folder = Path(found)
    if not (folder / "config.json").is_file():
        raise DrafterNotFound(f"onlinespec: drafter {text!r} resolved to {folder}, which has no "
                              f"config.json")
    return folder
