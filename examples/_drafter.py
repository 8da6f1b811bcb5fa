"""What the CPU examples serve (prints the drafter's path, or with --k vLLM's
num_speculative_tokens, when run as a script): the shipped SmolLM2 drafter
(`vllm-onlinespec model drafter smollm2-135m`) and the `cpu` preset's K
(vllm_onlinespec/presets.py: the suffix tree drafts up to 16 tokens, the drafter its own block).
"""

from __future__ import annotations

import sys

PRESET = "cpu"


def default_drafter() -> str:
    from vllm_onlinespec.models import shipped_drafter

    return str(shipped_drafter("smollm2-135m"))


def num_speculative_tokens() -> int:
    from vllm_onlinespec.presets import PRESET_K

    return PRESET_K[PRESET]


if __name__ == "__main__":
    print(num_speculative_tokens() if "--k" in sys.argv else default_drafter())
