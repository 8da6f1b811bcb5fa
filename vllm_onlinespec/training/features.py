"""Drafter inputs from a Hugging Face target (e.g. LlamaForCausalLM, Qwen3ForCausalLM).

Layer-index convention (design.md §2). DFlash's `target_layer_ids` are 0-based target layers;
vLLM captures target layer i as aux layer i+1 (eagle3_utils.py:110), the residual stream *after*
layer i. In HF terms that is `hidden_states[i + 1]` (hidden_states[0] is the embedding output),
with one exception: HF's last entry hidden_states[L] has the final norm applied, while vLLM's
aux layer L is the pre-norm stream. We read the decoder layers' outputs with forward hooks, which
gives vLLM's value for every i, including the last layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def _decoder(model: nn.Module) -> nn.Module:
    # *ForCausalLM keeps the transformer in `.model`; calling it directly skips the [B,T,V] logits.
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    if hasattr(model, "layers"):
        return model
    return model.get_decoder()


@torch.no_grad()
def target_features(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                    target_layer_ids: Sequence[int], batch_chunk: int | None = None,
                    ) -> tuple[Tensor, Tensor]:
    """(aux [B,T,n*H], final_hidden [B,T,H]) for the drafter and the distillation loss.

    aux concatenates, in target_layer_ids order, the residual stream after each listed layer
    (= HF hidden_states[i+1], = vLLM aux layer i+1). final_hidden is the post-final-norm state,
    so target logits = final_hidden @ lm_head.weight.T. Sequences are right-padded (row t is
    position t, as the drafter's train_hidden assumes). Runs under no_grad, not inference_mode:
    inference tensors could not be saved for backward when they feed the trainable fc.
    `batch_chunk` bounds peak activation memory on long batches.
    """
    decoder = _decoder(model)
    layers = decoder.layers
    if any(not 0 <= i < len(layers) for i in target_layer_ids):
        raise ValueError(f"target_layer_ids {list(target_layer_ids)} out of range for "
                         f"{len(layers)} target layers")
    chunk = batch_chunk or input_ids.shape[0]
    aux_parts, final_parts = [], []
    for s in range(0, input_ids.shape[0], chunk):
        ids = input_ids[s:s + chunk]
        am = attention_mask[s:s + chunk] if attention_mask is not None else None
        captured: dict[int, Tensor] = {}

        def hook(i: int):
            def fn(_mod: nn.Module, _inp: object, out: Tensor | tuple) -> None:
                captured[i] = out[0] if isinstance(out, tuple) else out  # 4.x returns tuples
            return fn

        handles = [layers[i].register_forward_hook(hook(i)) for i in target_layer_ids]
        try:
            out = decoder(input_ids=ids, attention_mask=am, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        aux_parts.append(torch.cat([captured[i] for i in target_layer_ids], dim=-1))
        final_parts.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])
    return torch.cat(aux_parts), torch.cat(final_parts)


@torch.no_grad()
def shared_prefix_features(model: nn.Module, prefix_ids: Sequence[int],
                           continuations: Sequence[Sequence[int]], target_layer_ids: Sequence[int],
                           ) -> list[tuple[Tensor, Tensor]]:
    """target_features of `prefix + c` for each continuation c, running the prefix once.

    Why: a prompt answered n times (greedy + sampled answers) would otherwise cost n prompt
    passes; Spec-Bench prompts are often longer than their answers. The prefix runs with a KV
    cache, the cache is repeated n times, and the continuations run right-padded on top of it
    (causal attention: a real token never sees the padding after it). Returns per continuation
    (aux [P+len(c), n*H], final [P+len(c), H]) in the model's dtype.
    """
    decoder = _decoder(model)
    layers = decoder.layers
    if any(not 0 <= i < len(layers) for i in target_layer_ids):
        raise ValueError(f"target_layer_ids {list(target_layer_ids)} out of range for "
                         f"{len(layers)} target layers")
    if not prefix_ids or not continuations or any(not c for c in continuations):
        raise ValueError("shared_prefix_features needs a non-empty prefix and continuations")
    captured: dict[int, Tensor] = {}

    def hook(i: int):
        def fn(_mod: nn.Module, _inp: object, out: Tensor | tuple) -> None:
            captured[i] = out[0] if isinstance(out, tuple) else out
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in target_layer_ids]
    try:
        pre = decoder(input_ids=torch.tensor([list(prefix_ids)]), use_cache=True)
        p_aux = torch.cat([captured[i] for i in target_layer_ids], dim=-1)[0]
        p_final = pre.last_hidden_state[0]
        cache = pre.past_key_values
        n = len(continuations)
        if n > 1:
            cache.batch_repeat_interleave(n)
        t_max = max(len(c) for c in continuations)
        ids = torch.zeros(n, t_max, dtype=torch.long)
        for r, c in enumerate(continuations):
            ids[r, :len(c)] = torch.tensor(list(c))
        out = decoder(input_ids=ids, past_key_values=cache, use_cache=True)
        c_aux = torch.cat([captured[i] for i in target_layer_ids], dim=-1)
        c_final = out.last_hidden_state
    finally:
        for h in handles:
            h.remove()
    return [(torch.cat([p_aux, c_aux[r, :len(c)]]), torch.cat([p_final, c_final[r, :len(c)]]))
            for r, c in enumerate(continuations)]
