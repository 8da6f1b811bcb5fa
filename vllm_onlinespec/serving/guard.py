"""The one rule of the serving path: an exception raised by OUR code in a vLLM hook is counted,
logged (the first three times, then every hundredth) and swallowed, and the step goes on as
vLLM alone would have run it. vLLM's own calls are never inside a guard, so vLLM's exceptions
reach vLLM unchanged. Silent skips (a hook that had nothing to work on) are counted too."""

from __future__ import annotations

import logging
from collections import Counter
from types import TracebackType

from vllm_onlinespec.serving.stats import HookStats

logger = logging.getLogger("vllm_onlinespec")

# Hook names (the keys of HookStats.errors).
EXECUTE_MODEL = "execute_model"
SAMPLE = "sample"  # _sample: remembering the sampler output, oracle, step cost
INVARIANT = "invariant"  # _sample: drafter-invariant rewrite of sampled requests' rows
GREEDY_VERIFY = "greedy_verify"  # _sample: an all-greedy step's lean verification
PROPOSE = "propose_draft_token_ids"
GATE = "gate"  # propose_draft_token_ids, before: speculate in the next step or draft at K = 0
CAPTURE = "capture"  # sample_tokens, before: the step view
FEEDBACK = "feedback"  # after_step: accepted counts -> policy stats, tracer, buffer
PUBLISH = "publish"  # after_step: learner snapshot -> vLLM's drafter, head refresh
METRICS = "metrics"  # after_step: the metrics file
DRAFT_HIDDEN = "draft_hidden"  # inside vLLM's drafter: the mask rows' hidden states
DRAFT_CONFIDENCE = "draft_confidence"  # inside vLLM's drafter: its top-1 probabilities
CUT = "cut"  # take_draft_token_ids: the verify-length cut

# Skip reasons (the keys of HookStats.skips).
NO_STEP_VIEW = "no_step_view"  # the runner kept no state for the step
NO_DRAFT_SAMPLER = "no_draft_sampler"  # the drafter has no _sample_draft_tokens to wrap
NON_LIST_DRAFTS = "non_list_drafts"  # take_draft_token_ids gave something other than lists
NO_DRAFT_HIDDEN = "no_draft_hidden"  # the head had no (or mis-shaped) hidden states to read
NO_DRAFT_CONFIDENCE = "no_draft_confidence"  # the estimator had no (or mis-shaped) confidences
NO_SAMPLER_OUTPUT = "no_sampler_output"  # a step with a view but no rejection-sampler output


class HookGuard:
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.skips: Counter[str] = Counter()

    def __call__(self, hook: str) -> "_Guarded":
        return _Guarded(self, hook)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skips[reason] += n

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())

    def failed(self, hook: str, e: BaseException) -> None:
        self.errors[hook] += 1
        n = self.total_errors
        if n <= 3 or n % 100 == 0:
            logger.error("onlinespec: %s hook failed (%d hook failures so far; the step goes on "
                         "as vLLM alone would run it): %s: %s", hook, n, type(e).__name__, e,
                         exc_info=e)

    def stats(self) -> HookStats:
        return HookStats(errors=dict(self.errors), skips=dict(self.skips))


class _Guarded:
    __slots__ = ("guard", "hook")

    def __init__(self, guard: HookGuard, hook: str) -> None:
        self.guard, self.hook = guard, hook

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> bool:
        # Exception only: KeyboardInterrupt / SystemExit keep their meaning.
        if e is not None and isinstance(e, Exception):
            self.guard.failed(self.hook, e)
            return True
        return False
