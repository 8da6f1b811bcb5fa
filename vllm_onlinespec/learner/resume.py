"""Resuming a learner from its checkpoint directory, or starting fresh — never failing.

A restarted server must come up whatever the directory holds. Checkpoints are tried newest
first; the first that loads wins. One that cannot be used (torn or truncated files, another
checkpoint format, another architecture, another algorithm) is skipped; if none can be used the
learner keeps its fresh weights. Either way ONE warning names what was skipped and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import checkpoint as ckpt

logger = logging.getLogger("vllm_onlinespec")


@dataclass
class ResumeResult:
    path: Path | None = None  # the checkpoint resumed, None = fresh start
    version: int = 0
    skipped: list[str] = field(default_factory=list)  # one reason per unusable checkpoint


def resume_or_fresh(learner: Any, directory: str | Path) -> ResumeResult:
    """learner: an OnlineLearner (its load_checkpoint(path) is all-or-nothing)."""
    out = ResumeResult()
    for _, path in ckpt._candidates(Path(directory)):
        try:
            ckpt.verify(path)  # a torn folder says so, rather than 'no checkpoint under'
            out.version = learner.load_checkpoint(path)
            out.path = path
            break
        except Exception as e:  # noqa: BLE001 - any unusable checkpoint: try the next, then fresh
            out.skipped.append(str(e) if isinstance(e, ckpt.CheckpointError)
                               else f"{path}: {type(e).__name__}: {e}")
    if out.skipped:
        what = (f"resumed older version {out.version} from {out.path}" if out.path is not None
                else "starting fresh from the configured drafter")
        logger.warning("onlinespec: %d unusable checkpoint(s) under %s (%s); %s",
                       len(out.skipped), directory, "; ".join(out.skipped[:3]), what)
    return out
