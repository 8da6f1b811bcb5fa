"""The model-runner half of SpecDecodeWorker: hooks into vLLM's V1 runner at four points.

  load_model        drafter loads with plain weights (republishable); the online session starts
  _sample           remembers the rejection sampler's output (accepted lengths)
  sample_tokens     before: a view of the target step; after: feedback -> buffer, then publish
  take_draft_token_ids   the verify-length policy cuts each request's draft (issue 5)

Publishing happens at the end of sample_tokens, after this step's drafter forward and before
the next step's: new weights never land in the middle of a forward.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_onlinespec.serving import compat

logger = logging.getLogger("vllm_onlinespec")


class OnlineSpecRunnerMixin:
    _onlinespec: Any = None
    _onlinespec_sampled: Any = None

    def load_model(self, *args, **kwargs):
        compat.wrap_drafter_load(self)
        out = super().load_model(*args, **kwargs)
        from vllm_onlinespec.serving.session import OnlineSession

        self._onlinespec = OnlineSession.start(self)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._onlinespec_t0 = time.perf_counter()
        self._onlinespec_tokens = int(scheduler_output.total_num_scheduled_tokens)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        out = super()._sample(logits, spec_decode_metadata)
        self._onlinespec_sampled = out.sampled_token_ids
        if self._onlinespec is not None and getattr(self, "_onlinespec_t0", None) is not None:
            # Target forward + verification, not drafting: what one more verify token costs.
            self._onlinespec.observe_step_cost(self._onlinespec_tokens,
                                               time.perf_counter() - self._onlinespec_t0)
            self._onlinespec_t0 = None
        return out

    def sample_tokens(self, grammar_output):
        session = self._onlinespec
        view = session.capture(self) if session is not None else None
        self._onlinespec_sampled = None
        out = super().sample_tokens(grammar_output)
        if session is not None:
            session.after_step(self, view, self._onlinespec_sampled)
        return out

    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        session = self._onlinespec
        if session is None or drafts is None:
            return drafts
        return session.cut_drafts(drafts)

    def shutdown_onlinespec(self) -> None:
        if self._onlinespec is not None:
            self._onlinespec.close()
            self._onlinespec = None


_RUNNER_CLASSES: dict[type, type] = {}


def runner_class(base: type) -> type:
    """OnlineSpecRunnerMixin over vLLM's CPU or GPU runner (cached: one class per base)."""
    if base not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[base] = type(f"OnlineSpec{base.__name__}", (OnlineSpecRunnerMixin, base), {})
    return _RUNNER_CLASSES[base]
