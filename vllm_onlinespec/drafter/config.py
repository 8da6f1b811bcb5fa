"""DFlash drafter config: the fields our PyTorch twin needs, and the exact `config.json` vLLM loads.

Block-size convention. `block_size` counts every token of a drafted block *including* the first,
already-known token (z-lab convention: a "b16" drafter has block_size 16). The drafter proposes
K = block_size - 1 tokens. vLLM's `num_speculative_tokens` is K, not block_size: DFlashProposer
builds `1 + num_speculative_tokens` query rows per request (vllm/v1/spec_decode/dflash.py:126) and
samples `num_speculative_tokens` of them (:137); z-lab serves its b16 drafters with
`num_speculative_tokens: 15`. vLLM 0.32 never reads `block_size` from config.json.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ARCHITECTURE = "DFlashDraftModel"


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter, spread over the target's depth.

    Follows z-lab's `build_target_layer_ids`: one feature -> the middle layer; otherwise evenly from
    layer 1 to layer L-3 (the last layers are too close to the output to add information beyond
    the token itself). Tiny targets where that range cannot hold `num_features` distinct layers fall
    back to an even spread over all layers: duplicates are not an option, since vLLM captures each
    aux layer once and the fc input would come up short.
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if not 1 <= num_features <= num_target_layers:
        raise ValueError(f"num_features must be in [1, {num_target_layers}], got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]
    if end > start and all(b > a for a, b in zip(ids, ids[1:])):
        return ids
    # floor(x + 0.5), not round(): banker's rounding can map two half-steps onto one layer.
    step = (num_target_layers - 1) / (num_features - 1)
    return [math.floor(i * step + 0.5) for i in range(num_features)]


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope_theta(cfg: Any, default: float) -> float:
    # transformers 5 moves rope_theta into rope_parameters; 4.x and z-lab b16 configs keep it on top.
    params = _get(cfg, "rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = _get(cfg, "rope_theta")
    return float(theta) if theta is not None else default


def _rope_type(cfg: Any) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        params = _get(cfg, key)
        if isinstance(params, Mapping):
            kind = params.get("rope_type", params.get("type"))
            if kind not in (None, "default"):
                return str(kind)
    return "default"


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    target_hidden_size: int | None = None  # None -> hidden_size
    num_target_layers: int | None = None  # only for z-lab readers and range checks
    torch_dtype: str = "bfloat16"
    initializer_range: float = 0.02
    # A reduced draft vocabulary (vLLM's draft_vocab_size + d2t; drafter/vocab.py): the
    # checkpoint then holds its own lm_head rows and d2t. None = the target's whole LM head.
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def num_draft_tokens(self) -> int:
        """K = vLLM's num_speculative_tokens."""
        return self.block_size - 1

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_target_features * self.target_hidden_size

    # -- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"DFlashConfig.{name}: {why} (got {getattr(self, name)!r})")

        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                     "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(name, "must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            bad("head_dim", "must be even for neox RoPE")
        if self.block_size < 2:
            bad("block_size", "must be >= 2 (first known token + at least one draft token)")
        if not self.rms_norm_eps > 0:
            bad("rms_norm_eps", "must be > 0")
        if not self.rope_theta > 0:
            bad("rope_theta", "must be > 0")
        if self.hidden_act != "silu":
            bad("hidden_act", "only 'silu' is implemented")
        if not 0 <= self.mask_token_id < self.vocab_size:
            bad("mask_token_id", f"must be a token id in [0, {self.vocab_size})")
        dvs = self.draft_vocab_size
        if dvs is not None and (not isinstance(dvs, int) or isinstance(dvs, bool)
                                or not 1 <= dvs <= self.vocab_size):
            bad("draft_vocab_size", f"must be an int in [1, vocab_size={self.vocab_size}]")
        ids = self.target_layer_ids
        if not ids:
            bad("target_layer_ids", "must not be empty")
        if min(ids) < 0 or any(b <= a for a, b in zip(ids, ids[1:])):
            # vLLM concatenates aux layers in forward order: unsorted ids would silently permute fc.
            bad("target_layer_ids", "must be non-negative and strictly increasing")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            bad("target_layer_ids", f"must be < num_target_layers={self.num_target_layers}")

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def for_target(
        cls,
        target_hf_config: Any,
        *,
        mask_token_id: int,
        num_layers: int = 1,
        num_target_features: int | None = None,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        torch_dtype: str = "bfloat16",
    ) -> DFlashConfig:
        """A drafter sized like the target: it shares the target's embedding and LM head, so its
        hidden size must be the target's. `num_target_features` defaults to `num_layers` (z-lab)."""
        tgt = _get(target_hf_config, "text_config") or target_hf_config  # multimodal wrappers
        hidden = int(_get(tgt, "hidden_size"))
        heads = int(_get(tgt, "num_attention_heads"))
        num_target_layers = int(_get(tgt, "num_hidden_layers"))
        if target_layer_ids is None:
            n = num_target_features if num_target_features is not None else num_layers
            target_layer_ids = default_target_layer_ids(num_target_layers, n)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or _get(tgt, "intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(_get(tgt, "num_key_value_heads") or heads),
            head_dim=int(_get(tgt, "head_dim") or hidden // heads),
            vocab_size=int(_get(tgt, "vocab_size")),
            target_layer_ids=list(target_layer_ids),
            mask_token_id=int(mask_token_id),
            block_size=block_size,
            rms_norm_eps=float(_get(tgt, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(tgt, 10_000.0),
            max_position_embeddings=int(_get(tgt, "max_position_embeddings", 40960)),
            target_hidden_size=hidden,
            num_target_layers=num_target_layers,
            torch_dtype=torch_dtype,
        )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> DFlashConfig:
        """Parse our own config.json or a public z-lab DFlash one (b16 style with top-level
        block_size/rope_theta, or the newer style with dflash_config.block_size/rope_parameters).
        Features this twin does not implement are refused rather than silently mis-computed."""
        dflash = d.get("dflash_config") or {}

        def pick(name: str, default: Any = None) -> Any:
            # Same precedence as vLLM's DFlashQwen3Model and z-lab's _draft_value.
            return dflash.get(name, d.get(name, default))

        def refuse(name: str, why: str) -> None:
            raise ValueError(f"DFlash config field {name!r}: {why}")

        archs = d.get("architectures")
        if archs and ARCHITECTURE not in archs:
            refuse("architectures", f"expected {ARCHITECTURE!r}, got {archs}")
        if d.get("model_type", "qwen3") != "qwen3":
            refuse("model_type", f"expected 'qwen3', got {d.get('model_type')!r}")
        if d.get("attention_bias"):
            refuse("attention_bias", "biased attention is not implemented")
        if any(t != "full_attention" for t in d.get("layer_types") or []):
            refuse("layer_types", "only all-'full_attention' (non-causal) drafters are implemented")
        if dflash.get("use_swa") or pick("is_causal") or dflash.get("causal"):
            refuse("dflash_config", "sliding-window or causal drafters are not implemented")
        for name in ("attention_value_scale", "attention_sink_bias"):
            if dflash.get(name) not in (None, False):
                refuse(name, "not implemented")
        if not pick("use_aux_hidden_state", True):
            refuse("use_aux_hidden_state", "drafters without target features are not implemented")
        dvs = d.get("draft_vocab_size")
        if dvs is not None and not (isinstance(dvs, int) and not isinstance(dvs, bool)):
            refuse("draft_vocab_size", f"must be an int, got {dvs!r}")
        if (kind := _rope_type(d)) != "default":
            refuse("rope_parameters", f"rope_type {kind!r} is not implemented")

        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "vocab_size"):
            if d.get(name) is None:
                refuse(name, "missing")
        num_target_layers = pick("num_target_layers")
        layer_ids = pick("target_layer_ids")
        if layer_ids is None and num_target_layers is not None:
            # Old z-lab code derives ids from num_target_layers when dflash_config omits them.
            layer_ids = default_target_layer_ids(int(num_target_layers), int(d["num_hidden_layers"]))
        if layer_ids is None:
            refuse("dflash_config.target_layer_ids", "missing")
        if pick("mask_token_id") is None:
            refuse("dflash_config.mask_token_id", "missing")

        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(d["vocab_size"]),
            target_layer_ids=list(layer_ids),
            mask_token_id=int(pick("mask_token_id")),
            block_size=int(pick("block_size", 16)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d, 1_000_000.0),  # vLLM's default for DFlash drafters
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            hidden_act=str(d.get("hidden_act", "silu")),
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            initializer_range=float(d.get("initializer_range", 0.02)),
            draft_vocab_size=dvs if dvs not in (None, d.get("vocab_size")) else None,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json vLLM 0.32 loads with `method: "dflash"` (registry -> qwen3_dflash).

        `block_size` and `num_target_layers` are for z-lab's readers only; vLLM takes K from
        num_speculative_tokens. vLLM auto-detects DFlash only if the path contains "dflash",
        so pass `method: "dflash"` explicitly.
        """
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "target_hidden_size": self.target_hidden_size,
            "initializer_range": self.initializer_range,
            "torch_dtype": self.torch_dtype,
            "block_size": self.block_size,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
        }
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = self.draft_vocab_size
        return d
