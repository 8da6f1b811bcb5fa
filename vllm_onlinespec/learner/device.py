"""Where the learner computes, and how its published snapshots cross to the serving stream.

`learner_device: "auto"` means the device of vLLM's drafter: the serving layer reads it off
vLLM's drafter module and passes it here, so the core never looks at vLLM itself.

On CUDA the learner runs on its own stream, beside vLLM's. A snapshot is copied on that stream
and carries an event recorded right after the copy; whoever loads it into vLLM's drafter calls
`Snapshot.wait_ready()` first, which makes the *loading* thread's current stream wait for the
copy (no host synchronisation) and tells the caching allocator that this stream uses the
snapshot's memory, so it is not recycled for the learner while a load from it is in flight.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def normalize_device(device: torch.device | str) -> torch.device:
    """"cuda" -> "cuda:<current>": tensors report an index, and `t.device == torch.device("cuda")`
    is False, which would make "in place" checks copy the target's head for nothing."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(setting: str, auto: torch.device | str | None = None) -> torch.device:
    """The learner's device for config value `setting`; "auto" = `auto` (vLLM's drafter's
    device), or cpu when that is unknown."""
    if setting == "auto":
        return normalize_device(auto) if auto is not None else torch.device("cpu")
    return normalize_device(setting)


def module_device(module: nn.Module | None) -> torch.device | None:
    """Device of a module's first parameter (None for no module or no parameters)."""
    if module is None:
        return None
    p = next(iter(module.parameters()), None)
    return p.device if p is not None else None


def learner_dtype(setting: str, device: torch.device) -> torch.dtype:
    """Training dtype: float32 on CPU whatever the setting (CPU training keeps float32
    parameters: bf16 updates lose small steps there with no memory pressure to pay for it)."""
    return torch.float32 if device.type == "cpu" else DTYPES[setting]


def compute_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the learner's forward and backward matmuls (None = no autocast:
    float32). "auto" = bfloat16 where `device` computes it in hardware (CUDA, or a CPU with
    AVX512-BF16 / AMX), float32 elsewhere: emulated bf16 would make updates slower, not faster."""
    from ..serving_dtype import cpu_native_bf16

    if setting == "float32":
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    native = device.type == "cuda" or (device.type == "cpu" and cpu_native_bf16())
    return torch.bfloat16 if native else None


def stream_for(device: torch.device) -> "torch.cuda.Stream | None":
    """A dedicated stream for the learner on a CUDA device, None elsewhere."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def on_stream(stream: "torch.cuda.Stream | None"):
    """Context that makes `stream` current (nothing without one)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


class Snapshot(Mapping):
    """A published, read-only {name: tensor} copy of the learner's weights, plus the CUDA event
    recorded after the copy (None on CPU / meta). Never modify the tensors."""

    __slots__ = ("_tensors", "ready")

    def __init__(self, tensors: dict[str, torch.Tensor],
                 ready: "torch.cuda.Event | None" = None) -> None:
        self._tensors = tensors
        self.ready = ready

    @classmethod
    @torch.no_grad()
    def copy_of(cls, named: Iterator[tuple[str, torch.Tensor]] | list,
                device: torch.device) -> "Snapshot":
        """Copy `named` tensors to `device` on the current stream (device to device when they
        are there already: no host round trip) and record the readiness event after it."""
        tensors = {n: p.detach().to(device, copy=True) for n, p in named}
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return cls(tensors, ready)

    def wait_ready(self) -> None:
        """Order the caller's current CUDA stream after the snapshot copy (no-op off CUDA).
        Call it in the thread that reads the tensors (the serving thread), before reading."""
        if self.ready is None:
            return
        dev = next((t.device for t in self._tensors.values() if t.is_cuda), None)
        if dev is None:
            return
        stream = torch.cuda.current_stream(dev)
        stream.wait_event(self.ready)
        for t in self._tensors.values():
            if t.is_cuda:
                t.record_stream(stream)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"Snapshot({len(self._tensors)} tensors, ready={self.ready is not None})"
