"""Draft traces: what vLLM's drafter computed at each step, for parity checks against the
plain-PyTorch twin. Off unless `trace_dir` is set; one small .pt file per engine step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving import guard as G


class DraftTracer:
    def __init__(self, runner: Any, directory: str, K: int, guard: Any) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.K = K
        self.step = 0
        self.guard = guard
        self._hidden: torch.Tensor | None = None
        if not compat.wrap_draft_sampler(runner, self._on_hidden):
            guard.skip(G.NO_DRAFT_SAMPLER)

    @classmethod
    def maybe(cls, cfg: Any, runner: Any, guard: Any) -> "DraftTracer | None":
        directory = getattr(cfg, "trace_dir", None)
        if not directory:
            return None
        return cls(runner, directory, compat.num_speculative_tokens(runner.vllm_config), guard)

    def _on_hidden(self, hidden: torch.Tensor) -> None:
        with self.guard(G.DRAFT_HIDDEN):  # inside vLLM's drafter: never raise
            self._hidden = hidden.detach().to("cpu", torch.float32).clone()

    def record(self, view: compat.StepView, accepted: list[int], sampled: Any) -> None:
        hidden, self._hidden = self._hidden, None
        B = len(view.req_ids)
        if hidden is None or hidden.shape[0] != B * self.K:
            return
        rows, start = [], 0
        for i, n in enumerate(view.num_scheduled):
            drafted = view.num_draft_tokens[i] if view.num_draft_tokens is not None else 0
            keep = n if drafted == 0 else 1 + accepted[i]
            last_pos = int(view.positions[start + keep - 1])
            row = sampled[i].tolist() if isinstance(sampled, torch.Tensor) else list(sampled[i])
            rows.append({"req_id": view.req_ids[i], "block_pos": last_pos + 1,
                         "first_token": int(row[accepted[i] if drafted else 0]),
                         "hidden": hidden[i * self.K:(i + 1) * self.K],
                         **self._features(view, start, keep)})
            start += n
        torch.save(rows, self.dir / f"step-{os.getpid()}-{self.step:06d}.pt")
        self.step += 1

    @staticmethod
    def _features(view: compat.StepView, start: int, keep: int) -> dict[str, torch.Tensor]:
        """The committed rows' target features as vLLM captured them (what the drafter's context
        and the learner's feedback are built from), for checks against an HF pass."""
        if not view.aux_hidden_states:
            return {}
        rows = slice(start, start + keep)
        cpu = lambda t: t[rows].detach().to("cpu", torch.float32).clone()  # noqa: E731
        return {"positions": view.positions[rows].detach().to("cpu").clone(),
                "aux": torch.cat([cpu(h) for h in view.aux_hidden_states], dim=-1),
                "final": cpu(view.hidden_states)}
