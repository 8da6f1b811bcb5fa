"""DFlash block-diffusion drafter core: plain PyTorch, no vLLM import."""

from .checkpoint import (load_draft_vocab, load_drafter, load_drafter_config, save_drafter,
                         state_dict_for_vllm)
from .config import DFlashConfig, default_target_layer_ids
from .length_head import LengthHead, accepted_length, length_label, length_loss
from .model import DFlashDrafter, block_labels, build_train_mask
from .vocab import DraftVocab

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DraftVocab",
    "LengthHead",
    "accepted_length",
    "block_labels",
    "build_train_mask",
    "load_drafter_config",
    "default_target_layer_ids",
    "length_label",
    "length_loss",
    "load_draft_vocab",
    "load_drafter",
    "save_drafter",
    "state_dict_for_vllm",
]
