"""The feature log: target features vLLM computed while serving, as training data.

A data-generation engine with `onlinespec.features.dir` set (serving/session.py) appends, per
engine step, every request's committed rows: token ids, positions, the drafter's aux layers and
the final hidden state, exactly what the learner's feedback holds. Files:

    DIR/log-<run>-<seq:06d>.safetensors
        ids [N] int32, aux [N, n*H], final [N, H] (the serving dtype); metadata: format,
        layer_ids, hidden_size, and `records`, a JSON list of [req_id, start_pos, rows]
        in row order

written atomically (temporary name, then rename), so a reader never sees half a file. `run`
is unique per engine process, so two engines may share a folder.

Reading (`read_feature_log`) reassembles each request from its records, by position, later
records overwriting earlier ones (a preempted request is recomputed from an earlier position).
A request whose rows do not cover positions 0..T-1 without a gap (prefix-cache hits are never
computed; a log cut off mid-request) is dropped and counted. What comes back is keyed by the
token ids: vLLM never feeds the last sampled token, so a generated sample `ids` is found under
`ids[:-1]`, and that is the sequence a training row holds (its last token has no features).

Core module: torch and safetensors only, no vLLM import (the worker and the trainer share it).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

FORMAT = "vllm-onlinespec-feature-log/1"


class FeatureLogError(ValueError):
    """A log file cannot be used; the message is one line naming the file."""


def ids_key(ids) -> str:
    """Key of a token sequence (a list or a 1-D tensor of ints)."""
    data = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return hashlib.sha256(json.dumps([int(t) for t in data]).encode()).hexdigest()[:24]


class FeatureLogWriter:
    """Appends rows; writes a file every `flush_tokens` rows and on flush()/close()."""

    def __init__(self, directory: str | os.PathLike, layer_ids: list[int], hidden_size: int,
                 flush_tokens: int = 16384) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = [int(i) for i in layer_ids]
        self.hidden_size = int(hidden_size)
        self.flush_tokens = flush_tokens
        self.run = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.seq = 0
        self.files = 0
        self.rows_written = 0
        self._pending: list[tuple[str, int, Tensor, Tensor, Tensor]] = []
        self._rows = 0

    def add(self, req_id: str, start_pos: int, ids: Tensor, aux: Tensor, final: Tensor) -> None:
        """Rows of one request from one step; the tensors must be CPU copies (kept as given)."""
        n = int(ids.shape[0])
        if aux.shape[0] != n or final.shape[0] != n:
            raise ValueError(f"feature log: {n} ids but {aux.shape[0]} aux / {final.shape[0]} "
                             "final rows")
        self._pending.append((str(req_id), int(start_pos), ids, aux, final))
        self._rows += n
        if self._rows >= self.flush_tokens:
            self.flush()

    def flush(self) -> Path | None:
        if not self._pending:
            return None
        recs = self._pending
        self._pending, self._rows = [], 0
        tensors = {"ids": torch.cat([r[2] for r in recs]).to(torch.int32),
                   "aux": torch.cat([r[3] for r in recs]).contiguous(),
                   "final": torch.cat([r[4] for r in recs]).contiguous()}
        meta = {"format": FORMAT, "layer_ids": json.dumps(self.layer_ids),
                "hidden_size": str(self.hidden_size),
                "records": json.dumps([[r[0], r[1], int(r[2].shape[0])] for r in recs])}
        path = self.dir / f"log-{self.run}-{self.seq:06d}.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none of it
        self.seq += 1
        self.files += 1
        self.rows_written += int(tensors["ids"].shape[0])
        return path

    def close(self) -> None:
        self.flush()


@dataclass
class LoggedSequence:
    ids: Tensor  # [T] int64: every token the target computed features for, positions 0..T-1
    aux: Tensor  # [T, n*H]
    final: Tensor  # [T, H]


@dataclass
class FeatureLogContents:
    sequences: dict[str, LoggedSequence] = field(default_factory=dict)  # ids_key(ids) -> seq
    files: int = 0
    requests: int = 0
    dropped: int = 0  # requests with a gap (prefix-cache hits, a log cut off mid-request)


def _run_of(path: Path) -> str:
    return path.stem.removeprefix("log-").rsplit("-", 1)[0]


def read_feature_log(folder: str | os.PathLike, layer_ids: list[int], hidden_size: int,
                     dtype: torch.dtype | None = None) -> FeatureLogContents:
    """Every complete request in the folder, keyed by its token ids. Files written for other
    target layers or another hidden size stop the read with one line naming the file."""
    folder = Path(folder)
    out = FeatureLogContents()
    # (run, req_id) -> list of (start_pos, ids, aux, final), in the order they were written
    parts: dict[tuple[str, str], list[tuple[int, Tensor, Tensor, Tensor]]] = {}
    for path in sorted(folder.glob("log-*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise FeatureLogError(f"{path}: not a feature-log file (format "
                                          f"{meta.get('format')!r}, want {FORMAT!r})")
                got_layers = json.loads(meta["layer_ids"])
                if got_layers != list(layer_ids) or int(meta["hidden_size"]) != hidden_size:
                    raise FeatureLogError(
                        f"{path}: logged for target layers {got_layers} (hidden size "
                        f"{meta['hidden_size']}), expected {list(layer_ids)} ({hidden_size})")
                ids, aux, final = (f.get_tensor(k) for k in ("ids", "aux", "final"))
                records = json.loads(meta["records"])
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
            raise FeatureLogError(f"{path}: unreadable feature-log file ({e})") from None
        if sum(r[2] for r in records) != ids.shape[0]:
            raise FeatureLogError(f"{path}: records cover {sum(r[2] for r in records)} rows, "
                                  f"the file holds {ids.shape[0]}")
        out.files += 1
        run, off = _run_of(path), 0
        for req_id, start, n in records:
            parts.setdefault((run, req_id), []).append(
                (int(start), ids[off:off + n], aux[off:off + n], final[off:off + n]))
            off += n
    for chunks in parts.values():
        out.requests += 1
        seq = _assemble(chunks, dtype)
        if seq is None:
            out.dropped += 1
        else:
            out.sequences[ids_key(seq.ids)] = seq
    return out


def _assemble(chunks, dtype) -> LoggedSequence | None:
    # A recomputed request (preemption) starts again from an earlier position: the newest
    # chunk for a position wins, and the sequence ends where the newest chunk ends.
    T = 0
    for start, ids, _, _ in chunks:
        T = start + int(ids.shape[0]) if start <= T else -1
        if T < 0:
            return None  # a gap: positions before `start` were never computed
    first = chunks[0]
    ids = torch.empty(T, dtype=torch.int64)
    aux = torch.empty(T, first[2].shape[1], dtype=dtype or first[2].dtype)
    final = torch.empty(T, first[3].shape[1], dtype=dtype or first[3].dtype)
    for start, i, a, f in chunks:
        end = min(T, start + int(i.shape[0]))
        ids[start:end], aux[start:end], final[start:end] = i[:end - start], a[:end - start], \
            f[:end - start]
    return LoggedSequence(ids=ids, aux=aux, final=final)
