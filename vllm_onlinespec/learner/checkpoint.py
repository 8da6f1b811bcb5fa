"""Atomic, self-verifying learner checkpoints.

Layout of one checkpoint, `<dir>/v00000042/`:
    model.safetensors   trainable weights of the learner's model (exact, for resuming)
    algo.pt             update-rule state (torch.save; loaded with weights_only=True)
    extra.json          counters, config, anything JSON-serialisable
    model/              optional: whatever the caller's save_model(path) wrote there, e.g. an
                        HF DFlash folder vLLM can load as a drafter
    COMPLETE            written last: {"version", "files": {relative path: sha256}}

Everything is written into `<dir>/v00000042.tmp-XXXX/`, each file fsynced, the marker written
and fsynced, the folder fsynced, then renamed onto the final name with os.replace and the parent
fsynced. A crash leaves either a `.tmp-` folder (ignored, removed later) or a complete
checkpoint. A final-named folder without a valid marker (copied by hand, disk corruption) is
skipped by `latest_complete` with a warning, never loaded.

One writer per directory is assumed (the learner thread).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..drafter.checkpoint import fsync_path as _fsync_dir

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
MODEL_FILE = "model.safetensors"
ALGO_FILE = "algo.pt"
EXTRA_FILE = "extra.json"
MODEL_DIR = "model"
FORMAT = 1
_FINAL = re.compile(r"^v(\d{8,})$")
_STALE_TMP_S = 3600.0  # a .tmp- folder this old belongs to a crashed save


class CheckpointError(ValueError):
    """A checkpoint is torn, corrupt or unreadable; the message says which file and why."""


@dataclass
class Checkpoint:
    path: Path
    version: int
    model_state: dict[str, torch.Tensor] | None
    algo_state: Any
    extra: dict[str, Any]
    model_dir: Path | None  # the save_model(path) folder, if one was written


def checkpoint_name(version: int) -> str:
    return f"v{version:08d}"


# -- writing --------------------------------------------------------------------------------------




def _write_bytes(path: Path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sync_tree(root: Path) -> dict[str, str]:
    """fsync every file and folder the caller's writer left under root; hash the files."""
    hashes = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            hashes[p.relative_to(root.parent).as_posix()] = _sha256(p)
        _fsync_dir(Path(dirpath))
    return hashes


def save(directory: str | Path, version: int,
         model_state: Mapping[str, torch.Tensor] | None = None, algo_state: Any = None,
         extra: Mapping[str, Any] | None = None, *,
         save_model: Callable[[Path], None] | None = None,
         keep_last: int | None = None) -> Path:
    """Write checkpoint `version` atomically and return its final path.

    save_model(path) may write any files into the (new, empty) folder `path` = `<ckpt>/model/`;
    they are hashed into the marker like the others. keep_last prunes older checkpoints after
    a successful save. Saving a version that already exists replaces it atomically.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(version)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=directory))
    try:
        files: dict[str, str] = {}
        if model_state is not None:
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()}
            files[MODEL_FILE] = _write_bytes(tmp / MODEL_FILE, st_save(tensors))
        if algo_state is not None:
            buf = io.BytesIO()
            torch.save(algo_state, buf)
            files[ALGO_FILE] = _write_bytes(tmp / ALGO_FILE, buf.getvalue())
        meta = json.dumps(dict(extra or {}), indent=1, sort_keys=True, default=str)
        files[EXTRA_FILE] = _write_bytes(tmp / EXTRA_FILE, meta.encode())
        if save_model is not None:
            (tmp / MODEL_DIR).mkdir()
            save_model(tmp / MODEL_DIR)
            files.update(_sync_tree(tmp / MODEL_DIR))
        marker = {"format": FORMAT, "version": version, "time": time.time(), "files": files}
        _write_bytes(tmp / MARKER, json.dumps(marker, indent=1, sort_keys=True).encode())
        _fsync_dir(tmp)
        _install(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        prune(directory, keep_last)
    return final


def _install(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # os.replace cannot replace a non-empty folder: move it aside first
        old = final.with_name(f"{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- finding and verifying ------------------------------------------------------------------------


def _candidates(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = _FINAL.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def verify(path: str | Path) -> dict[str, Any]:
    """The checkpoint's marker if every listed file is present with its recorded hash; else
    raises CheckpointError saying what is wrong."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MARKER} marker (torn write)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {MARKER} marker: {e}") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{path}: malformed {MARKER} marker")
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {marker.get('format')!r}, this "
                              f"version of vllm-onlinespec reads format {FORMAT}")
    m = _FINAL.match(path.name)
    if m and int(m.group(1)) != marker.get("version"):
        raise CheckpointError(f"{path}: marker says version {marker.get('version')}")
    for rel, want in marker["files"].items():
        try:
            got = _sha256(path / rel)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {rel}: {e.strerror or e}") from None
        if got != want:
            raise CheckpointError(f"{path}: {rel} sha256 mismatch (corrupt)")
    return marker


def list_complete(directory: str | Path, check_hashes: bool = False) -> list[Path]:
    """Final-named checkpoints with a marker, newest first (hashes checked only on request)."""
    out = []
    for _, p in _candidates(Path(directory)):
        if check_hashes:
            try:
                verify(p)
            except CheckpointError:
                continue
        elif not (p / MARKER).is_file():
            continue
        out.append(p)
    return out


def latest_complete(directory: str | Path) -> Path | None:
    """Newest checkpoint that verifies; torn or corrupt ones are skipped with a warning."""
    for _, p in _candidates(Path(directory)):
        try:
            verify(p)
            return p
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
    return None


# -- loading --------------------------------------------------------------------------------------


def load(path: str | Path, *, check: bool = True,
         map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint folder (verifying its hashes first unless check=False)."""
    path = Path(path)
    marker = verify(path) if check else json.loads((path / MARKER).read_text())
    files = marker["files"]
    try:
        model_state = None
        if MODEL_FILE in files:
            model_state = st_load((path / MODEL_FILE).read_bytes())
            if str(map_location) != "cpu":
                model_state = {k: v.to(map_location) for k, v in model_state.items()}
        algo_state = None
        if ALGO_FILE in files:
            algo_state = torch.load(path / ALGO_FILE, map_location=map_location,
                                    weights_only=True)
        extra = json.loads((path / EXTRA_FILE).read_text()) if EXTRA_FILE in files else {}
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load: {type(e).__name__}: {e}") from None
    model_dir = path / MODEL_DIR
    return Checkpoint(path=path, version=int(marker["version"]), model_state=model_state,
                      algo_state=algo_state, extra=extra,
                      model_dir=model_dir if model_dir.is_dir() else None)


def load_latest(directory: str | Path, **kw: Any) -> Checkpoint | None:
    p = latest_complete(directory)
    return None if p is None else load(p, **kw)


# -- retention ------------------------------------------------------------------------------------


def prune(directory: str | Path, keep_last: int) -> list[Path]:
    """Keep the newest `keep_last` checkpoints that have a marker; delete older checkpoints
    (complete or torn) and leftovers of crashed saves. Returns what was deleted."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    directory = Path(directory)
    cands = _candidates(directory)
    kept = [p for _, p in cands if (p / MARKER).is_file()][:keep_last]
    removed = []
    if kept:
        oldest_kept = int(_FINAL.match(kept[-1].name).group(1))
        for v, p in cands:
            if p not in kept and v < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    now = time.time()
    for p in directory.iterdir():
        if (".tmp-" in p.name or ".old-" in p.name) and _FINAL.match(p.name.split(".")[0]):
            try:
                stale = now - p.stat().st_mtime > _STALE_TMP_S
            except OSError:
                continue
            if stale:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names and float32 bytes: equal digests mean equal weights (resume checks)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
