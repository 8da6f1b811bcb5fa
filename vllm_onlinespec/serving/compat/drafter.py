"""vLLM's DFlash drafter: finding it, loading it republishable, writing and reading its weights,
and the hook on its final hidden states (vLLM 0.32.0, qwen3_dflash.py / llm_base_proposer.py)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

_drafter_loading = threading.local()


def drafter_module(runner: Any) -> torch.nn.Module | None:
    """vLLM's DFlashQwen3ForCausalLM instance (or None when the runner has no DFlash drafter)."""
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    return model if model is not None and hasattr(model, "load_weights") else None


def target_embed_and_head(runner: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] weights (shared by the drafter)."""
    model = runner.model
    inner = getattr(model, "model", model)
    embed = inner.embed_tokens.weight
    lm_head = getattr(model, "lm_head", None)
    lm_w = lm_head.weight if lm_head is not None and getattr(lm_head, "weight", None) is not None else embed
    return embed, lm_w


def repack_drafter_linears(runner: Any) -> int:
    """Pack the drafter's (plain, republishable) Linear weights for vLLM's CPU GEMM path again,
    keeping the plain weights for the next publish. Returns the number of layers packed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = drafter_module(runner)
    n = 0
    for layer in model.modules() if model is not None else ():
        if getattr(layer, "_cpu_skip_gemm_dispatch", False) and hasattr(layer, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            n += 1
    return n


def load_draft_weights(runner: Any, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write checkpoint-named tensors into vLLM's drafter in place. Its load_weights maps names,
    fills the stacked qkv/gate_up parameters and rebuilds the fused context-KV buffers that
    hold copies of k/v projections, k_norm weights and the RoPE cache (qwen3_dflash.py:886)."""
    model = drafter_module(runner)
    if model is None:
        raise RuntimeError("the engine has no DFlash drafter to publish into")
    with torch.inference_mode():
        model.load_weights(iter(list(named)))


def read_draft_weights(runner: Any) -> dict[str, torch.Tensor]:
    """vLLM's drafter weights as loaded, under checkpoint names (float32 CPU copies): the
    stacked qkv_proj / gate_up_proj parameters are split back into q/k/v and gate/up, so the
    result compares with `drafter.state_dict()` of the plain-PyTorch twin. The target's shared
    embedding (and anything else that is not a drafter weight of ours) is left out."""
    model = drafter_module(runner)
    if model is None:
        raise RuntimeError("the engine has no DFlash drafter")
    inner = model.model
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in inner.named_parameters():
            if name.startswith(("embed_tokens.", "mask_embedding")):
                continue
            w = p.detach().to("cpu", torch.float32).clone()
            if name.endswith("qkv_proj.weight"):
                attn = inner.get_submodule(name.rsplit(".", 2)[0])
                q, kv = int(attn.q_size), int(attn.kv_size)
                base = name.removesuffix("qkv_proj.weight")
                out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = (
                    w.split([q, kv, kv], dim=0))
            elif name.endswith("gate_up_proj.weight"):
                base = name.removesuffix("gate_up_proj.weight")
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w.chunk(2, dim=0)
            else:
                out[name] = w
    return out


def _keep_plain_weights_while_drafter_loads() -> None:
    """On CPU, UnquantizedLinearMethod.process_weights_after_loading (layers/linear.py:206) packs
    each weight for oneDNN and replaces the parameter with an empty tensor, so publishing new
    draft weights later fails. vLLM's own `_cpu_skip_gemm_dispatch` keeps plain weights; we set
    it on the drafter's layers only (the target keeps oneDNN). Installed by our runner only:
    engines that never republish draft weights keep vLLM's behaviour everywhere."""
    from vllm.model_executor.layers import linear

    cls = linear.UnquantizedLinearMethod
    if getattr(cls, "_onlinespec_wrapped", False):
        return
    orig = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(_drafter_loading, "on", False):
            layer._cpu_skip_gemm_dispatch = True
        return orig(self, layer)

    cls.process_weights_after_loading = process_weights_after_loading
    cls._onlinespec_wrapped = True


@contextlib.contextmanager
def drafter_loading() -> Iterator[None]:
    _drafter_loading.on = True
    try:
        yield
    finally:
        _drafter_loading.on = False


def wrap_drafter_load(runner: Any) -> None:
    """Make the drafter load with plain (unpacked) Linear weights so it can be republished."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or getattr(drafter, "_onlinespec_wrapped", False):
        return
    _keep_plain_weights_while_drafter_loads()
    orig = drafter.load_model

    def load_model(target_model):
        with drafter_loading():
            return orig(target_model)

    drafter.load_model = load_model
    drafter._onlinespec_wrapped = True


def wrap_draft_sampler(runner: Any, on_hidden: Callable[[torch.Tensor], None]) -> bool:
    """Call `on_hidden(hidden [B*K, H])` with the drafter's final hidden states at the mask rows
    before it samples draft tokens (llm_base_proposer.py:478). False when this runner's drafter
    has no such method (another vLLM version, another method): the caller must say so.
    `on_hidden` must not raise (the caller guards it): vLLM's sampling runs right after."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "_sample_draft_tokens"):
        return False
    orig = drafter._sample_draft_tokens

    def _sample_draft_tokens(hidden_states, sampling_metadata):
        on_hidden(hidden_states)
        return orig(hidden_states, sampling_metadata)

    drafter._sample_draft_tokens = _sample_draft_tokens
    return True
