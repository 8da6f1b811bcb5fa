"""Swapping the target's weights in a running engine, as RL frameworks do between rollouts.

    from vllm_onlinespec import swap_target
    swap_target(llm, "/path/to/new/hf/folder")      # one call; the engine keeps its requests

vLLM 0.32's supported path is the worker's `reload_weights(weights_path=...)` (vLLM's
layerwise in-place reload, model_loader/reload/inplace.py): the target's parameters are
rewritten in place from a safetensors folder, on CPU and GPU workers alike. The onlinespec
worker wraps it (`onlinespec_swap_target`) so that the online learner follows the change:

* the folder is checked first (same architecture, vocabulary and shapes as the served model;
  anything else is one line naming the field, and the engine keeps serving the old weights);
* the learner is paused for the swap (an update in flight finishes first);
* it reads the target's embedding and LM head again, and its feedback buffer is emptied:
  hidden states and labels logged from the old target would train the drafter towards it;
* the duty cycle (learner/duty_cycle.py) sees the drafter's acceptance drop and trains at full
  share until the gain levels off.

Output stays lossless across the swap: every token is verified by the target as it is at that
step (test: float32 greedy equality against the matching HF model before and after).

With `vllm serve`, start the server with VLLM_SERVER_DEV_MODE=1 and POST
{"method": "onlinespec_swap_target", "args": ["/path"]} to /collective_rpc.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

logger = logging.getLogger("vllm_onlinespec")

# Fields that must match for a checkpoint to load into the served model's parameters.
MUST_MATCH = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "tie_word_embeddings")


class SwapError(ValueError):
    """A target folder that cannot replace the served weights; one line saying why."""


def check_swap(current: Mapping[str, Any], folder: str | Path) -> Path:
    """`folder` if it can replace a model whose HF config is `current` (a dict), else SwapError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SwapError(f"target folder {folder} does not exist")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise SwapError(f"target folder {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise SwapError(f"target folder {folder} has no .safetensors weights")
    try:
        new = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise SwapError(f"{cfg_file} is not valid JSON: {e}") from None
    for key in MUST_MATCH:
        if key in current and new.get(key, current[key]) != current[key]:
            raise SwapError(f"target folder {folder} has {key} = {new.get(key)!r}; the served "
                            f"model has {current[key]!r}")
    return folder


def swap_target(llm: Any, folder: str | Path) -> dict:
    """Replace the target's weights of a running `LLM` (onlinespec worker) by `folder`'s.
    Returns the first worker's report ({"seconds", "dropped_tokens", "swaps"}). The folder is
    checked here first, so a bad one raises SwapError in the caller with its one line (the
    worker checks again: it may see another filesystem)."""
    from vllm_onlinespec.serving import compat

    check_swap(compat.served_hf_config(llm.llm_engine.vllm_config), folder)
    return llm.collective_rpc("onlinespec_swap_target", args=(str(folder),))[0]


def follow_swap(session: Any, runner: Any, reload: Callable[[], None]) -> dict:
    """In the worker: run `reload` (vLLM's in-place reload of the target's weights) with the
    session's learner paused, then make the learner follow: the new embedding and LM head, the
    old target's untrained feedback dropped. Not guarded: a failed reload reaches the caller."""
    from vllm_onlinespec.serving import compat

    t0, dropped, learner = time.perf_counter(), 0, session.learner
    with learner.paused() if learner is not None else contextlib.nullcontext():
        reload()
        if session.cfg.enabled:
            # Every rank: under TP the gather is a collective (only rank 0 has a learner).
            embed, lm_head = compat.target_embed_and_head(runner)
            if learner is not None:
                learner.loss_fn.retarget(embed, lm_head)
                session.feedback.pipe.drop()  # the old target's features
                dropped = session.buffer.clear()
    session.target_swaps += 1
    sec = time.perf_counter() - t0
    logger.info("onlinespec: target weights swapped in %.2f s (%d untrained feedback tokens "
                "from the old target dropped)", sec, dropped)
    return {"seconds": sec, "dropped_tokens": dropped, "swaps": session.target_swaps}
