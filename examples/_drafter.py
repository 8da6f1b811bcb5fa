"""Which DFlash drafter the CPU examples start from (prints its path when run as a script).

The trained default (`vllm-onlinespec train --recipe smollm2-default`, or `make demo`'s) if it is
in the cache; otherwise a randomly initialised 1-layer drafter, so the examples run on a fresh
machine too: online learning then starts from scratch, acceptance starts near zero.
"""

from __future__ import annotations

import sys
from pathlib import Path


def default_drafter() -> str:
    from vllm_onlinespec.models import cache_dir, pull

    trained = cache_dir() / "drafters" / "smollm2-default"
    if (trained / "config.json").is_file():
        return str(trained)
    fresh = cache_dir() / "drafters" / "random-smollm2-b5"
    if not (fresh / "config.json").is_file():
        import torch
        from transformers import AutoConfig

        from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, save_drafter

        print(f"no trained drafter at {trained}; writing a random one to {fresh}", file=sys.stderr)
        target = pull("smollm2-135m")
        cfg = DFlashConfig.for_target(AutoConfig.from_pretrained(target), mask_token_id=16,
                                      num_layers=1, num_target_features=3, block_size=5,
                                      torch_dtype="float32")
        torch.manual_seed(0)
        save_drafter(fresh, cfg, DFlashDrafter(cfg))
    return str(fresh)


def num_speculative_tokens(drafter: str) -> int:
    import json

    from vllm_onlinespec.drafter import DFlashConfig

    cfg = json.loads((Path(drafter) / "config.json").read_text())
    return DFlashConfig.from_hf_dict(cfg).block_size - 1


if __name__ == "__main__":
    d = default_drafter()
    print(d if "--k" not in sys.argv else num_speculative_tokens(d))
