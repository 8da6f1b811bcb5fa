"""Old import path of `vllm_onlinespec.policy.budget` (kept for callers; the same module object)."""

import sys

from vllm_onlinespec.policy import budget as _module

sys.modules[__name__] = _module
