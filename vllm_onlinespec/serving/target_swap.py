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
step (test: float32 greedy equality against the matching HF model before and after). vLLM's
prefix cache holds K/V the old weights computed, which a later request with the same prefix
would reuse (a served soak measured 31 of 345 greedy answers off the new target's after a swap
with the cache kept): `swap_target` and `push_target` reset it after the reload, preempting
requests in flight so that they recompute their K/V with the new weights
(`LLM.reset_prefix_cache(reset_running_requests=True)`; RL frameworks reset it after each
weight sync the same way).

RL frameworks also push the new policy's tensors without a folder (a worker call with the
weights, vLLM's `reload_weights(weights_iterator=...)`):

    from vllm_onlinespec import push_target
    push_target(llm, policy.state_dict())           # HF checkpoint names, every weight

A push is checked like a folder first: every name must be one of the served architecture's
checkpoint weights, every shape the served one (another vocabulary is named as such), and no
weight may be missing (vLLM's in-place reload rebuilds each layer from what it is given);
anything else is one line and the engine keeps serving the old weights. The learner follows a
push exactly as it follows a folder swap.

With `vllm serve`, start the server with VLLM_SERVER_DEV_MODE=1, POST
{"method": "onlinespec_swap_target", "args": ["/path"]} to /collective_rpc, then POST
/reset_prefix_cache?reset_running_requests=true (vLLM's dev endpoint: the engine's prefix cache
lives in its scheduler, which a worker call cannot reach).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

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
    report = llm.collective_rpc("onlinespec_swap_target", args=(str(folder),))[0]
    return {**report, "prefix_cache_reset": reset_prefix_cache(llm)}


def reset_prefix_cache(llm: Any) -> bool:
    """Drop the K/V vLLM's prefix cache holds from the old weights; running requests are
    preempted and recompute theirs. Whether vLLM reset it."""
    return bool(llm.reset_prefix_cache(reset_running_requests=True))


@functools.lru_cache(maxsize=4)
def _checkpoint_shapes(hf_config_json: str) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """HF checkpoint weight names -> shapes of the architecture `hf_config_json` describes
    (built on the meta device: no memory), and the names a checkpoint may leave out (a tied
    LM head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(hf_config_json)
    cfg = AutoConfig.for_model(**data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    optional = frozenset({"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else ())
    return shapes, optional


def check_push(current: Mapping[str, Any],
               weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`weights` as (name, tensor) pairs if they can replace every weight of a model whose HF
    config is `current` (a dict), else SwapError with one line naming the first problem."""
    import torch

    items = list(weights.items() if isinstance(weights, Mapping) else weights)
    if not items:
        raise SwapError("pushed weights are empty: a push replaces every weight of the target")
    shapes, optional = _checkpoint_shapes(json.dumps(dict(current), sort_keys=True, default=str))
    vocab = current.get("vocab_size")
    seen = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise SwapError(f"pushed weights must be (name, tensor) pairs (got {type(item).__name__})")
        name, t = item
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise SwapError(f"pushed {name} is not a floating-point tensor "
                            f"({getattr(t, 'dtype', type(t).__name__)})")
        if name not in shapes:
            raise SwapError(f"pushed {name} is not a weight of the served "
                            f"{'/'.join(current.get('architectures') or [current.get('model_type', 'model')])}")
        want = shapes[name]
        if tuple(t.shape) != want:
            if len(want) == 2 and want[0] == vocab and t.dim() == 2 and t.shape[0] != vocab:
                raise SwapError(f"pushed {name} has {t.shape[0]} rows: another vocabulary "
                                f"(the served model has vocab_size = {vocab})")
            raise SwapError(f"pushed {name} has shape {tuple(t.shape)}; the served model's is {want}")
        seen.add(name)
    missing = sorted(set(shapes) - optional - seen)
    if missing:
        raise SwapError(f"push misses {len(missing)} of the served model's {len(shapes)} weights "
                        f"(first: {missing[0]}): a push replaces every weight")
    return items


def push_target(llm: Any, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict:
    """Replace the target's weights of a running `LLM` (onlinespec worker) by `weights`, HF
    checkpoint names to tensors (a policy's `state_dict()`), through vLLM's in-place reload.
    Checked here first: a push that does not fit raises SwapError in the caller with its one
    line, and nothing is sent. Returns the first worker's report, as swap_target does."""
    from vllm_onlinespec.serving import compat

    from safetensors.torch import save

    items = check_push(compat.served_hf_config(llm.llm_engine.vllm_config), weights)
    # vLLM's RPC encoder (msgpack, no pickle) turns an untyped tensor into a bare list: the
    # weights travel as one safetensors buffer, bytes msgpack carries as they are.
    # Tied weights share storage, which safetensors refuses: those are copied once.
    tensors, seen = {}, set()
    for n, t in items:
        t = t.detach().to("cpu").contiguous()
        tensors[n] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    payload = save(tensors)
    report = llm.collective_rpc("onlinespec_push_target", args=(payload,))[0]
    return {**report, "prefix_cache_reset": reset_prefix_cache(llm)}


def unpack_push(payload: Any) -> Any:
    """The worker's side of push_target: a safetensors buffer back into {name: tensor}; anything
    else is passed on for check_push to judge."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        try:
            return load(bytes(payload))
        except Exception as e:  # noqa: BLE001 - a corrupt buffer is the caller's error
            raise SwapError(f"pushed weights are not a safetensors buffer: {e}") from None
    return payload


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
