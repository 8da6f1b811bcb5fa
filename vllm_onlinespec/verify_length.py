"""Old import path of `vllm_onlinespec.policy.verify_length` (kept for callers; the same module object)."""

import sys

from vllm_onlinespec.policy import verify_length as _module

sys.modules[__name__] = _module
