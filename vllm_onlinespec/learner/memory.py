"""The online learner's memory on its device, allocated and stated before vLLM profiles memory.

vLLM sizes its KV cache from what is free after the model loads (on a GPU, 90 % of the device by
default). The learner is built inside that load (serving/session.py), but an update rule's state
(Adam moments, undo copies), gradients and a second published snapshot would otherwise appear
at the first update, after the KV cache took the memory: an OOM on the learner thread that
leaves the drafter frozen while serving goes on. So the steady state is allocated up front
(`OnlineAlgorithm.reserve`), the rest (gradients, snapshots, a step's transients, the loss's
logits) is computed from the drafter's shapes, and a learner that cannot fit is refused before
serving starts, with the numbers.

What the build leaves allocated (`LearnerFootprint.built`: the weights, the rule's state, the
frozen start weights and the first published snapshot) already shows in `mem_get_info` when
`check_fits` runs; vLLM counts it as its own (its profile measures the device's free memory), so
it only has to leave vLLM room for a KV cache. What comes later, after the KV cache took its
share, must fit in the share vLLM leaves: an update's gradients, transients and logits, and the
second snapshot (copied after the update's gradients are freed, on the same stream, so it reuses
their memory: the larger of the two counts).
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

    @property
    def built(self) -> int:
        """Allocated by build_learner: all it holds but the second published snapshot (the
        first is the learner's version 0)."""
        return self.steady - self.snapshots // 2

    @property
    def later(self) -> int:
        """Allocated after start-up, outside vLLM's profile: an update's additions, or the
        second snapshot (copied once the update's gradients are freed), whichever is larger."""
        return max(self.peak - self.steady, self.steady - self.built)

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
    """Raise MemoryError (one line, with the numbers) when the learner cannot fit beside vLLM.
    Call it after build_learner: what the build allocated (`fp.built`) is in use now and comes
    out of vLLM's share (gpu_memory_utilization of the device), which must keep room for a KV
    cache; what comes later (`fp.later`) must fit in the rest of the device. Off CUDA nothing
    is checked: vLLM's CPU KV cache is a fixed size, not a share of what is free."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    share = utilization * total
    in_use = total - free  # the target, vLLM's drafter and the learner's build among it
    headroom = total - share
    device_is = f"gpu_memory_utilization {utilization:g} of {total / GIB:.2f} GiB"
    if in_use >= share:
        raise MemoryError(
            f"onlinespec: the learner holds {fp.steady / GIB:.2f} GiB ({free / GIB:.2f} GiB free "
            f"now): {in_use / GIB:.2f} GiB of the device is in use, over vLLM's share "
            f"({share / GIB:.2f} GiB at {device_is}), which leaves it no KV cache: use "
            f"learner_dtype 'bfloat16', a higher gpu_memory_utilization, or learner_device 'cpu'")
    if fp.later > headroom:
        raise MemoryError(
            f"onlinespec: the learner adds {fp.later / GIB:.2f} GiB after start-up (an update's "
            f"gradients and logits, or its second snapshot), outside vLLM's share "
            f"({headroom / GIB:.2f} GiB at {device_is}): use learner_dtype 'bfloat16', a smaller "
            f"batch_blocks or draft vocabulary, a lower gpu_memory_utilization, or "
            f"learner_device 'cpu'")
