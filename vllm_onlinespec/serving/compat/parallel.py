"""vLLM's tensor-parallel group, as the online session uses it (vLLM 0.32.0,
distributed/parallel_state.py: GroupCoordinator).

Under TP every rank runs our runner and session; only rank 0 learns. What crosses ranks:
  - once at start-up: the target's vocabulary-sharded embedding / LM head, gathered (rank 0's
    learner needs whole rows; an all-gather is a collective, so every rank takes part)
  - every step: rank 0's newest drafter version (one small broadcast), and on a new version
    its snapshot (broadcast_tensor_dict), which each rank loads through vLLM's own weight loader
    (each keeps its shard), so all ranks switch between the same two steps
  - on request: each rank's drafter shards, gathered back to whole checkpoint tensors (digest)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


def tp_group() -> Any | None:
    """vLLM's TP GroupCoordinator when the engine runs TP > 1, else None."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # noqa: BLE001 - no distributed state (unit tests, single process)
        return None
    return group if getattr(group, "world_size", 1) > 1 else None


def tp_rank(group: Any | None) -> int:
    return int(group.rank_in_group) if group is not None else 0


def broadcast_version(group: Any, version: int) -> int:
    return int(group.broadcast_object(int(version) if tp_rank(group) == 0 else None, src=0))


def broadcast_snapshot(group: Any, snapshot: Mapping[str, torch.Tensor] | None
                       ) -> dict[str, torch.Tensor]:
    """Rank 0's snapshot (CPU or device tensors) on every rank."""
    data = dict(snapshot) if tp_rank(group) == 0 else None
    out = group.broadcast_tensor_dict(data, src=0)
    return dict(out if out is not None else data)


def gather_vocab(layer: torch.nn.Module, weight: torch.Tensor, group: Any | None) -> torch.Tensor:
    """A VocabParallelEmbedding / ParallelLMHead weight with every rank's rows, padding cut."""
    if group is None:
        return weight
    full = group.all_gather(weight.detach().contiguous(), dim=0)
    return full[: int(getattr(layer, "org_vocab_size", full.shape[0]))]


def gather_linear(module: torch.nn.Module, name: str, w: torch.Tensor, group: Any | None,
                  parts: list[int] | None = None) -> list[torch.Tensor]:
    """A TP-sharded Linear weight back whole: column-parallel along dim 0 (each of `parts`, the
    local q/k/v or gate/up sizes, gathered on its own: a rank's shard is [q_r; k_r; v_r]),
    row-parallel along dim 1, anything else as is. Returns the parts (one if `parts` is None)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    local = list(w.split(parts, dim=0)) if parts else [w]
    if group is None:
        return local
    if isinstance(module, ColumnParallelLinear):
        return [group.all_gather(p.contiguous(), dim=0) for p in local]
    if isinstance(module, RowParallelLinear) and name.endswith("weight"):
        return [group.all_gather(p.contiguous(), dim=1) for p in local]
    return local
