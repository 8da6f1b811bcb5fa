"""The online learner's memory on its device, allocated and stated before vLLM profiles memory.

vLLM sizes its KV cache from what is free after the model loads (on a GPU, 90 % of the device by
default). The learner is built inside that load (serving/session.py), but an update rule's state
(Adam moments, undo copies), gradients and a second published snapshot would otherwise appear
at the first update, after the KV cache took the memory: an OOM on the learner thread that
leaves the drafter frozen while serving goes on. So the steady state is allocated up front
(`OnlineAlgorithm.reserve`), the rest (gradients, snapshots, a step's transients, the loss's
logits) is computed from the drafter's shapes, and a learner that cannot fit is refused before
serving starts, with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

GIB = 1024 ** 3
# The loss keeps about this many [rows, vocab] float32 tensors alive at its peak: the logits, the
# log-softmax and the gradient flowing back (training/blocks.py; the Triton loss needs fewer).
LOSS_LOGIT_COPIES = 3


@dataclass(frozen=True)
class LearnerFootprint:
    """Bytes the learner holds on its device."""

    weights: int  # trainable parameters
    optimizer: int  # the update rule's state and undo buffers (allocated by reserve())
    grads: int  # one gradient per trainable parameter, alive during an update
    snapshots: int  # two published snapshots: one being read by serving, one being written
    step_transient: int  # tensors a step allocates anew (rebound slots), old and new together
    loss_logits: int  # the loss's [batch rows, vocab] logits at its peak
    reference: int = 0  # frozen start weights the gain score compares with (pacing 'gain')

    @property
    def steady(self) -> int:
        """Held between updates."""
        return self.weights + self.optimizer + self.snapshots + self.reference

    @property
    def peak(self) -> int:
        """Held at the peak of an update."""
        return self.steady + self.grads + self.step_transient + self.loss_logits

    def describe(self, device: torch.device | str) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GIB:.2f}" for f in fields(self))
        return (f"learner memory on {device}: {self.steady / GIB:.2f} GiB held, "
                f"{self.peak / GIB:.2f} GiB at an update's peak ({parts}; GiB)")


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of distinct storages among `tensors` (a view of another counts once)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def learner_footprint(params: Sequence[torch.Tensor], algo, *, rows: int, vocab: int,
                      snapshot_dtype: torch.dtype | None = None,
                      reference: Sequence[torch.Tensor] = ()) -> LearnerFootprint:
    """The footprint of a learner whose rule `algo` already reserved its state. rows: draft
    rows per update (blocks x K); vocab: the loss's vocabulary (the served draft vocabulary or
    the target's)."""
    weights = tensor_bytes(params)
    elems = sum(p.numel() for p in params)
    snap_item = (torch.empty((), dtype=snapshot_dtype).element_size() if snapshot_dtype
                 else max((p.element_size() for p in params), default=4))
    return LearnerFootprint(
        weights=weights, optimizer=tensor_bytes(algo.held_tensors()), grads=weights,
        snapshots=2 * elems * snap_item, step_transient=algo.transient_slots() * weights,
        loss_logits=LOSS_LOGIT_COPIES * rows * vocab * 4, reference=tensor_bytes(reference))


def check_fits(fp: LearnerFootprint, device: torch.device, utilization: float) -> None:
    """Raise MemoryError (one line, with the numbers) when the learner cannot fit beside vLLM:
    what it holds must be free now (it is allocated before vLLM profiles, so vLLM's KV cache
    shrinks by it), and what an update adds on top (gradients, transients, the loss's logits,
    allocated after the KV cache exists) must fit in the share vLLM leaves unused,
    1 - gpu_memory_utilization of the device. Off CUDA nothing is checked: vLLM's CPU KV cache
    is a fixed size, not a share of what is free."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    headroom = (1.0 - utilization) * total
    update = fp.peak - fp.steady
    if fp.steady > free or update > headroom:
        raise MemoryError(
            f"onlinespec: the learner holds {fp.steady / GIB:.2f} GiB ({free / GIB:.2f} GiB free "
            f"now) and adds {update / GIB:.2f} GiB during an update, outside vLLM's share "
            f"({headroom / GIB:.2f} GiB at gpu_memory_utilization {utilization:g} of "
            f"{total / GIB:.2f} GiB): use learner_dtype 'bfloat16', a smaller batch_blocks or "
            f"draft vocabulary, a lower gpu_memory_utilization, or learner_device 'cpu'")
