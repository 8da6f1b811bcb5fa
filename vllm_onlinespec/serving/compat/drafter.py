"""vLLM's DFlash drafter: finding it, loading it republishable, writing and reading its weights,
and the hook on its final hidden states (vLLM 0.32.0, qwen3_dflash.py / llm_base_proposer.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

logger = logging.getLogger("vllm_onlinespec")
_drafter_loading = threading.local()


def drafter_module(runner: Any) -> torch.nn.Module | None:
    """vLLM's DFlashQwen3ForCausalLM instance (or None when the runner has no DFlash drafter)."""
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    return model if model is not None and hasattr(model, "load_weights") else None


def target_embed_and_head(runner: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] weights (shared by the drafter).
    Under TP they are vocabulary-sharded: gathered whole (a collective: every rank calls it)."""
    from vllm_onlinespec.serving.compat.parallel import gather_vocab, tp_group

    model = runner.model
    inner = getattr(model, "model", model)
    group = tp_group()
    embed_layer = inner.embed_tokens
    embed = gather_vocab(embed_layer, embed_layer.weight, group)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or getattr(lm_head, "weight", None) is None or lm_head.weight is embed_layer.weight:
        return embed, embed  # tied (SmolLM2): one gather
    return embed, gather_vocab(lm_head, lm_head.weight, group)


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
    hold copies of k/v projections, k_norm weights and the RoPE cache (qwen3_dflash.py:886).
    That rebuild makes new tensors (qwen3_dflash.py:538, :552); a CUDA graph captured over the
    old ones would go on reading them, so the new values are copied into the old storage."""
    model = drafter_module(runner)
    if model is None:
        raise RuntimeError("the engine has no DFlash drafter to publish into")
    inner = getattr(model, "model", model)
    before = _tensor_attrs(inner)
    with torch.inference_mode(), _no_mask_embedding_lookup(model):
        model.load_weights(iter(list(named)))
        for attr, old in before.items():
            new = getattr(inner, attr, None)
            if (isinstance(new, torch.Tensor) and new is not old and new.shape == old.shape
                    and new.dtype == old.dtype and new.device == old.device):
                old.copy_(new)
                setattr(inner, attr, old)


@contextlib.contextmanager
def _no_mask_embedding_lookup(model: torch.nn.Module) -> Iterator[None]:
    """Publishing never looks for a mask embedding file. vLLM's DFlash `load_weights` calls
    `_read_mask_embedding` on every call (qwen3_dflash.py:910), which asks the hub for
    `mask_embedding.pt` whenever the drafter is a hub id and the file is not in the local cache
    (repo_utils.py:418-425 `get_hf_file_bytes` -> :381 `_try_download_from_hf_hub`, an HTTP
    request with the hub's timeout unless HF_HUB_OFFLINE): on the serving thread, at every
    publish. The lookup only matters at start-up: vLLM's own load put any shipped mask
    embedding into the `mask_embedding` parameter and set `has_separate_mask_embedding`
    (:911-913), which load_weights only ever sets, never clears; a publish carries the
    learner's weights, never a mask embedding (read_draft_weights leaves it out), so without
    the lookup the loader simply leaves that parameter as loaded. The lookup is shadowed on
    this instance for the call only (vLLM's class is untouched; other models keep theirs)."""
    if not callable(getattr(model, "_read_mask_embedding", None)):
        yield
        return
    had = "_read_mask_embedding" in vars(model)
    saved = vars(model).get("_read_mask_embedding")
    model._read_mask_embedding = lambda: None
    try:
        yield
    finally:
        if had:
            model._read_mask_embedding = saved
        else:
            del model._read_mask_embedding


def _tensor_attrs(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain tensor attributes (not parameters or buffers): the fused copies load_weights rebuilds."""
    return {k: v for k, v in vars(module).items()
            if isinstance(v, torch.Tensor) and not k.startswith("_parameters")}


def read_draft_weights(runner: Any) -> dict[str, torch.Tensor]:
    """vLLM's drafter weights as loaded, under checkpoint names (float32 CPU copies): the
    stacked qkv_proj / gate_up_proj parameters are split back into q/k/v and gate/up, and
    under TP each rank's shards are gathered whole (a collective: every rank calls it), so the
    result compares with `drafter.state_dict()` of the plain-PyTorch twin on every rank. The
    target's shared embedding (and anything else that is not a drafter weight of ours) is left
    out."""
    from vllm_onlinespec.serving.compat.parallel import gather_linear, tp_group

    model = drafter_module(runner)
    if model is None:
        raise RuntimeError("the engine has no DFlash drafter")
    inner = model.model
    group = tp_group()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in inner.named_parameters():
            if name.startswith(("embed_tokens.", "mask_embedding")):
                continue
            module = inner.get_submodule(name.rsplit(".", 1)[0]) if "." in name else inner
            w = p.detach()
            if name.endswith("qkv_proj.weight"):
                attn = inner.get_submodule(name.rsplit(".", 2)[0])
                q, kv = int(attn.q_size), int(attn.kv_size)  # this rank's sizes
                qf, kf, vf = gather_linear(module, name, w, group, [q, kv, kv])
                reps = int(getattr(module, "num_kv_head_replicas", 1) or 1)
                if group is not None and reps > 1:  # fewer KV heads than ranks: copies
                    kf, vf = (t.view(group.world_size, kv, -1)[::reps].reshape(-1, t.shape[-1])
                              for t in (kf, vf))
                base = name.removesuffix("qkv_proj.weight")
                parts = {"q_proj.weight": qf, "k_proj.weight": kf, "v_proj.weight": vf}
            elif name.endswith("gate_up_proj.weight"):
                half = w.shape[0] // 2
                g, u = gather_linear(module, name, w, group, [half, half])
                base = name.removesuffix("gate_up_proj.weight")
                parts = {"gate_proj.weight": g, "up_proj.weight": u}
            else:
                base, parts = "", {name: gather_linear(module, name, w, group)[0]}
            for k, t in parts.items():
                out[base + k] = t.to("cpu", torch.float32).clone()
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


def wrap_draft_confidence(runner: Any, on_conf: Callable[[torch.Tensor], None]) -> bool:
    """Call `on_conf(top1 [B*k])` with the drafter's top-1 probability at each draft row, from
    the logits vLLM's drafter computes to pick its draft tokens (llm_base_proposer.py:448, the
    greedy path; no second LM head). False when this drafter computes no full logits (another
    vLLM version, or `use_local_argmax_reduction`): the caller must say so. `on_conf` must not
    raise (the caller guards it)."""
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    if (model is None or not hasattr(model, "compute_logits")
            or getattr(drafter, "use_local_argmax_reduction", False)):
        return False
    orig = model.compute_logits

    def compute_logits(hidden_states, *args, **kwargs):
        logits = orig(hidden_states, *args, **kwargs)
        if logits is not None and logits.dim() == 2:
            x = logits.float()
            on_conf((x.amax(-1) - torch.logsumexp(x, -1)).exp())
        return logits

    model.compute_logits = compute_logits
    return True


def wrap_draft_ids(runner: Any, rewrite: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> bool:
    """Pass vLLM's greedy draft ids through `rewrite(hidden [B*K, H], ids)` (its result is what
    vLLM proposes). Probabilistic drafts (with draft probabilities) are left alone: the
    rejection sampler reads those probabilities. False when the drafter has no
    _sample_draft_tokens. `rewrite` must not raise (the caller guards it)."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "_sample_draft_tokens"):
        return False
    orig = drafter._sample_draft_tokens

    def _sample_draft_tokens(hidden_states, sampling_metadata):
        ids, probs = orig(hidden_states, sampling_metadata)
        return (rewrite(hidden_states, ids) if probs is None else ids), probs

    drafter._sample_draft_tokens = _sample_draft_tokens
    return True


def install_context_only_k0(runner: Any, never_drafts: bool = False,
                            deferred: bool = False) -> bool:
    """Make vLLM's DFlash proposer take a context-only path when it is asked for 0 draft
    tokens (a K = 0 step of the budget's gate): the new tokens' context K/V are written (fc +
    the fused k/v projection, norm, RoPE, cache insert: what every later draft attends to) and
    nothing else runs. vLLM's own K = 0 path also runs the drafter's layers over the B
    bonus-token queries and throws their output away (llm_base_proposer.py:617-626); those
    queries' K/V sit past the committed tokens and are overwritten by the next step's context
    before anything reads them. `deferred`: a K = 0 step writes nothing; its accepted rows are
    kept and written in one pass when the drafter next drafts (compat/deferred_context.py).
    `never_drafts` (a plain feature-logging engine, the K = 0 floor): no later draft reads that
    context, so a K = 0 step runs no drafter forward at all. Counts each kind of call in
    `proposer._onlinespec_passes` ("draft", "context", "deferred", "none"). Returns whether the
    path is installed (only on a DFlash proposer, once)."""
    from vllm_onlinespec.serving.compat.deferred_context import DeferredContext

    proposer = getattr(runner, "drafter", None)
    model = getattr(proposer, "model", None)
    if (getattr(proposer, "method", None) != "dflash"
            or not hasattr(model, "precompute_and_store_context_kv")
            or getattr(proposer, "_onlinespec_k0", False)):
        return False
    full = proposer.propose
    passes = {"draft": 0, "context": 0, "deferred": 0, "none": 0}
    store = DeferredContext() if deferred and not never_drafts else None

    def no_drafts(kwargs) -> torch.Tensor:
        proposer.num_speculative_tokens = 0
        proposer._last_draft_probs = None
        return torch.empty(kwargs["common_attn_metadata"].batch_size(), 0,
                           device=kwargs["next_token_ids"].device, dtype=torch.int64)

    def propose(num_speculative_tokens, *args, **kwargs):
        if num_speculative_tokens != 0 or args:  # vLLM passes keywords (gpu_model_runner.py:5006)
            passes["draft"] += 1
            if store is not None and not args:  # what it will attend to, written first
                store.catch_up(proposer, runner, kwargs["common_attn_metadata"])
            return full(num_speculative_tokens, *args, **kwargs)
        if never_drafts:
            passes["none"] += 1
            return no_drafts(kwargs)
        if store is not None:
            if not store.full:
                try:
                    store.defer(runner, **kwargs)
                    passes["deferred"] += 1
                    return no_drafts(kwargs)
                except Exception as e:  # noqa: BLE001 - written now instead, below
                    store.errors += 1
                    if store.errors == 1:
                        logger.warning("onlinespec: deferring the drafter context failed "
                                       "(%s: %s); written now", type(e).__name__, e)
            store.catch_up(proposer, runner, kwargs["common_attn_metadata"])
        passes["context"] += 1
        return context_only_propose(proposer, **kwargs)

    proposer.propose = propose
    proposer._onlinespec_k0 = True
    proposer._onlinespec_passes = passes
    proposer._onlinespec_deferred = store
    proposer._onlinespec_full_propose = full  # vLLM's own, for tests that compare the two
    return True


def context_only_propose(proposer: Any, *, target_token_ids, target_positions,
                         target_hidden_states, next_token_ids, common_attn_metadata,
                         token_indices_to_sample=None, num_rejected_tokens_gpu=None,
                         **_unused) -> torch.Tensor:
    """DFlashProposer.propose at 0 draft tokens without the query forward: the same first two
    stages as vLLM's (combine_hidden_states, set_inputs_first_pass: the context positions and
    slots) and the same context K/V write (build_model_inputs_first_pass's
    precompute_and_store_context_kv), then an empty [B, 0] draft."""
    proposer.num_speculative_tokens = 0
    proposer._last_draft_probs = None
    batch_size = common_attn_metadata.batch_size()
    hidden = proposer.model.combine_hidden_states(target_hidden_states)
    proposer.set_inputs_first_pass(
        target_token_ids=target_token_ids, next_token_ids=next_token_ids,
        target_positions=target_positions, target_hidden_states=hidden,
        token_indices_to_sample=token_indices_to_sample, cad=common_attn_metadata,
        num_rejected_tokens_gpu=num_rejected_tokens_gpu)
    n = proposer._dflash_num_context
    proposer.model.precompute_and_store_context_kv(
        proposer._dflash_hidden_states, proposer._context_positions_buffer[:n],
        proposer._context_slot_mapping_buffer[:n])
    return torch.empty(batch_size, 0, device=hidden.device, dtype=torch.int64)
