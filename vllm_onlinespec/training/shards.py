"""Feature shards: the target's features for training samples, on disk, resumable.

    DIR/manifest.json         what the shards hold (target, layers, dtypes) and the finished shards
    DIR/shard-00000.safetensors
        ids [N] int32, aux [N, n*H], final [N, H] (feature dtype), offsets [S+1] int64,
        starts [S] int64 - S samples concatenated; metadata: the same header as the manifest
        plus the samples' keys (JSON). With feature dtype float8_e4m3fn also aux_scale [N, n]
        and final_scale [N, 1] float32: each token's features per layer stored as
        fp8(x / scale), scale = max|x| / 448 (FP8), half of bf16's bytes

Why this layout: one safetensors file per shard is read with one mmap and no pickle; the
manifest is rewritten atomically after each shard is complete, so a killed run leaves either a
shard listed in the manifest (complete, fsynced) or a stray file that the next run overwrites.
Resuming skips every sample whose key a listed shard holds: no sample is stored twice.

Every shard carries the header (target fingerprint, layer ids, sizes, dtype) it was written
with; reading checks it against the manifest and against what the trainer expects, and a
mismatch (another target, other layers) or a corrupt file stops with one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

FORMAT = "vllm-onlinespec-features/1"
MANIFEST = "manifest.json"
FP8 = "float8_e4m3fn"
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
FEATURE_DTYPES = ("bfloat16", "float16", "float32", FP8)


def row_dtype(feature_dtype: str) -> torch.dtype:
    """The dtype rows are handed to a ShardWriter in: the stored dtype, or bfloat16 where the
    writer quantizes (fp8 needs the scale it computes per row)."""
    if feature_dtype not in FEATURE_DTYPES:
        raise ShardError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)}, not "
                         f"{feature_dtype!r}")
    return torch.bfloat16 if feature_dtype == FP8 else getattr(torch, feature_dtype)


def fp8_encode(x: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """[N, F] -> (fp8 [N, F], float32 scales [N, groups]): each row's `groups` equal column
    groups (one per target layer) scaled to FP8's range by their own max |x|."""
    n, f = x.shape
    g = x.float().view(n, groups, f // groups)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / _FP8_MAX
    return (g / scale).to(torch.float8_e4m3fn).view(n, f), scale.squeeze(-1)


class ScaledFeatures:
    """fp8 features with their per-row, per-group scales, read as a float tensor when used:
    rows slice lazily, so a memory-mapped shard is never decoded whole. Quacks like the
    [T, F] tensor it stands for where training reads features (shape, rows, float(), to())."""

    def __init__(self, data: Tensor, scale: Tensor) -> None:
        self.data, self.scale = data, scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, rows) -> "ScaledFeatures":
        if not isinstance(rows, slice):
            raise TypeError("fp8 features slice by rows only")
        return ScaledFeatures(self.data[rows], self.scale[rows])

    def float(self) -> Tensor:
        n, f = self.data.shape
        g = self.scale.shape[1]
        return (self.data.float().view(n, g, f // g) * self.scale.unsqueeze(-1)).view(n, f)

    def to(self, dtype: torch.dtype) -> Tensor:
        return self.float().to(dtype)


class ShardError(ValueError):
    """A shard folder or file cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class ShardHeader:
    """What every shard of a folder must agree on."""

    target: str  # a short fingerprint of the target's weights and config
    layer_ids: tuple[int, ...]
    hidden_size: int
    feature_dtype: str = "bfloat16"
    format: str = FORMAT

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict, where: str) -> "ShardHeader":
        try:
            return cls(target=str(d["target"]), layer_ids=tuple(int(i) for i in d["layer_ids"]),
                       hidden_size=int(d["hidden_size"]), feature_dtype=str(d["feature_dtype"]),
                       format=str(d["format"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{where}: not a feature-shard header ({e!r})") from None

    def mismatch(self, other: "ShardHeader") -> str | None:
        """A short description of the first difference, or None."""
        for k in ("format", "target", "layer_ids", "hidden_size", "feature_dtype"):
            a, b = getattr(self, k), getattr(other, k)
            if a != b:
                return f"{k} {list(b) if k == 'layer_ids' else b} != expected " \
                       f"{list(a) if k == 'layer_ids' else a}"
        return None


def target_fingerprint(fingerprint: dict) -> str:
    """A short, stable id of a target from generate.model_fingerprint() (path excluded, so a
    moved cache folder keeps its shards)."""
    key = {k: v for k, v in fingerprint.items() if k != "path"}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class FeatureRow:
    """One sample with its features (what the trainer's Example holds)."""

    key: str
    ids: Tensor  # [T] int64
    start: int
    aux: Tensor | ScaledFeatures  # [T, n*H]
    final: Tensor | ScaledFeatures  # [T, H]


@dataclass
class ShardInfo:
    file: str
    samples: int
    tokens: int
    response_tokens: int
    keys: list[str] = field(default_factory=list)


@dataclass
class Manifest:
    header: ShardHeader
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return {k for s in self.shards for k in s.keys}

    @property
    def response_tokens(self) -> int:
        return sum(s.response_tokens for s in self.shards)

    def to_json(self) -> dict:
        return {"header": self.header.to_json(), "shards": [asdict(s) for s in self.shards]}


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_manifest(folder: str | os.PathLike) -> Manifest:
    path = Path(folder) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path}: no feature-shard manifest") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(raw, dict) or "header" not in raw or not isinstance(raw.get("shards"), list):
        raise ShardError(f"{path}: not a feature-shard manifest")
    header = ShardHeader.from_json(raw["header"], str(path))
    try:
        shards = [ShardInfo(**s) for s in raw["shards"]]
    except TypeError as e:
        raise ShardError(f"{path}: bad shard entry ({e})") from None
    return Manifest(header=header, shards=shards)


class ShardWriter:
    """Appends samples to a shard folder; `done` says which sample keys it already holds.

    Opening a folder written for another header (target, layers, dtype) raises ShardError:
    mixing features of two targets would silently train on garbage.
    """

    def __init__(self, folder: str | os.PathLike, header: ShardHeader,
                 samples_per_shard: int = 256) -> None:
        row_dtype(header.feature_dtype)  # an unknown dtype fails here, in one line
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.samples_per_shard = samples_per_shard
        if (self.folder / MANIFEST).is_file():
            self.manifest = read_manifest(self.folder)
            why = header.mismatch(self.manifest.header)
            if why:
                hint = ("; convert it: python -m vllm_onlinespec.training.shards convert SRC DST "
                        f"{header.feature_dtype}" if why.startswith("feature_dtype") else "")
                raise ShardError(f"{self.folder / MANIFEST}: written for other features ({why}); "
                                 f"use another folder or delete it{hint}")
        else:
            self.manifest = Manifest(header=header)
            self._save_manifest()
        self.done = self.manifest.keys
        self._pending: list[FeatureRow] = []

    def _save_manifest(self) -> None:
        _atomic_write_text(self.folder / MANIFEST, json.dumps(self.manifest.to_json()) + "\n")

    def add(self, row: FeatureRow) -> None:
        if row.key in self.done:
            return
        self._pending.append(row)
        self.done.add(row.key)
        if len(self._pending) >= self.samples_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        name = f"shard-{len(self.manifest.shards):05d}.safetensors"
        h = self.manifest.header
        lengths = [len(r.ids) for r in rows]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        tensors = {
            "ids": torch.cat([r.ids for r in rows]).to(torch.int32),
            "offsets": offsets,
            "starts": torch.tensor([r.start for r in rows], dtype=torch.int64),
        }
        aux = torch.cat([_dense(r.aux) for r in rows])
        final = torch.cat([_dense(r.final) for r in rows])
        if h.feature_dtype == FP8:
            tensors["aux"], tensors["aux_scale"] = fp8_encode(aux, len(h.layer_ids))
            tensors["final"], tensors["final_scale"] = fp8_encode(final, 1)
        else:
            dtype = getattr(torch, h.feature_dtype)
            tensors["aux"], tensors["final"] = aux.to(dtype).contiguous(), final.to(dtype).contiguous()
        keys = [r.key for r in rows]
        meta = {"header": json.dumps(h.to_json()), "keys": json.dumps(keys)}
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.folder)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.folder / name)  # a stray file of a killed run is overwritten
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        resp = sum(len(r.ids) - r.start for r in rows)
        self.manifest.shards.append(ShardInfo(file=name, samples=len(rows), tokens=sum(lengths),
                                              response_tokens=resp, keys=keys))
        self._save_manifest()  # the shard counts only from here on

    def close(self) -> None:
        self.flush()


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn}


def _dense(x: Tensor | ScaledFeatures) -> Tensor:
    return x.float() if isinstance(x, ScaledFeatures) else x


def _mapped(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """(metadata, tensors) of a safetensors file, the tensors views of a copy-on-write memory
    map: nothing is read until used, so ten million tokens of features (~46 GB in bf16) train
    from disk through the page cache instead of from memory."""
    import numpy as np

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    meta = head.pop("__metadata__", None) or {}
    mm = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n)
    out = {}
    for k, info in head.items():
        a, b = info["data_offsets"]
        if info["dtype"] not in _DTYPES or b > mm.shape[0]:
            raise ValueError(f"tensor {k}: dtype {info['dtype']} or offsets {a}..{b} unusable")
        out[k] = torch.from_numpy(mm[a:b]).view(_DTYPES[info["dtype"]]).view(info["shape"])
    return meta, out


def read_shard(path: str | os.PathLike, expected: ShardHeader) -> list[FeatureRow]:
    """All samples of one shard file, checked against `expected`; the features are views of
    the file mapped into memory (read when used)."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: missing shard file")
    try:
        meta, t = _mapped(path)
    except (OSError, ValueError, RuntimeError, KeyError, json.JSONDecodeError,
            UnicodeDecodeError) as e:
        raise ShardError(f"{path}: corrupt shard ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if "header" not in meta or "keys" not in meta:
        raise ShardError(f"{path}: not a feature shard (no header)")
    try:
        header = ShardHeader.from_json(json.loads(meta["header"]), str(path))
        keys = json.loads(meta["keys"])
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: corrupt shard header ({e})") from None
    why = expected.mismatch(header)
    if why:
        raise ShardError(f"{path}: shard of other features ({why})")
    need = ("ids", "aux", "final", "offsets", "starts") + (
        ("aux_scale", "final_scale") if header.feature_dtype == FP8 else ())
    if any(k not in t for k in need):
        raise ShardError(f"{path}: corrupt shard (no {next(k for k in need if k not in t)} tensor)")
    n_feat = len(header.layer_ids) * header.hidden_size
    off, n = t["offsets"], len(keys)
    total = int(off[-1]) if len(off) else 0
    if (len(off) != n + 1 or len(t["starts"]) != n or t["ids"].shape != (total,)
            or t["aux"].shape != (total, n_feat) or t["final"].shape != (total, header.hidden_size)
            or ("aux_scale" in t and (t["aux_scale"].shape != (total, len(header.layer_ids))
                                      or t["final_scale"].shape != (total, 1)))):
        raise ShardError(f"{path}: tensor shapes do not match its header and offsets")
    aux, final = t["aux"], t["final"]
    if header.feature_dtype == FP8:
        aux, final = ScaledFeatures(aux, t["aux_scale"]), ScaledFeatures(final, t["final_scale"])
    rows = []
    for i, key in enumerate(keys):
        a, b = int(off[i]), int(off[i + 1])
        rows.append(FeatureRow(key=key, ids=t["ids"][a:b].long(), start=int(t["starts"][i]),
                               aux=aux[a:b], final=final[a:b]))
    return rows


def iter_shards(folder: str | os.PathLike, expected: ShardHeader,
                keys: Iterable[str] | None = None) -> Iterator[FeatureRow]:
    """Stream the folder's samples shard by shard (only `keys` when given): at most one shard
    in memory beyond what the caller keeps."""
    folder = Path(folder)
    man = read_manifest(folder)
    why = expected.mismatch(man.header)
    if why:
        raise ShardError(f"{folder / MANIFEST}: written for other features ({why})")
    wanted = set(keys) if keys is not None else None
    for info in man.shards:
        if wanted is not None and not wanted.intersection(info.keys):
            continue
        for row in read_shard(folder / info.file, expected):
            if wanted is None or row.key in wanted:
                yield row


def load_rows(folder: str | os.PathLike, expected: ShardHeader,
              keys: Sequence[str]) -> list[FeatureRow]:
    """Rows for `keys`, in that order; a key no shard holds is an error naming the folder."""
    got = {r.key: r for r in iter_shards(folder, expected, keys)}
    missing = [k for k in keys if k not in got]
    if missing:
        raise ShardError(f"{Path(folder) / MANIFEST}: {len(missing)} samples have no features "
                         f"(first key {missing[0]})")
    return [got[k] for k in keys]


def convert(src: str | os.PathLike, dst: str | os.PathLike, feature_dtype: str) -> Manifest:
    """A copy of shard folder `src` at `dst` with the features stored as `feature_dtype` (e.g.
    a bf16 run moved to fp8 without generating again), shard by shard: the same keys in the same
    shards. A killed conversion resumes: shards `dst` already lists are skipped."""
    from dataclasses import replace

    src = Path(src)
    man = read_manifest(src)
    writer = ShardWriter(dst, replace(man.header, feature_dtype=feature_dtype),
                         samples_per_shard=1 << 30)  # flushed at each source shard's end
    for info in man.shards:
        if writer.done.issuperset(info.keys):
            continue
        for row in read_shard(src / info.file, man.header):
            writer.add(row)
        writer.flush()
    return writer.manifest


if __name__ == "__main__":  # python -m vllm_onlinespec.training.shards convert SRC DST DTYPE
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_onlinespec.training.shards")
    ap.add_argument("action", choices=["convert"])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("feature_dtype", choices=FEATURE_DTYPES)
    a = ap.parse_args()
    m = convert(a.src, a.dst, a.feature_dtype)
    print(f"{a.dst}: {len(m.shards)} shards, {m.response_tokens} response tokens, "
          f"{a.feature_dtype}")
