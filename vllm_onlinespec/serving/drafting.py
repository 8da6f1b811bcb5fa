"""What the target verifies each step: before vLLM's drafter runs, how many tokens it drafts
(the budget's gate, the lookup skipping it); after, each request's draft cut to the
verify-length policy's choice, or the lookup's draft where it pays. Both are prefixes or
whole drafts the target verifies, so output stays lossless."""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.serving import compat
from vllm_onlinespec.serving import guard as G

logger = logging.getLogger("vllm_onlinespec")


# A step's (k, option) as one integer for the TP broadcast: k * 4 + the option's code.
_OPTION_CODES = {None: 0, "plain": 1, "tree": 2, "drafter": 3}
_OPTION_NAMES = {v: k for k, v in _OPTION_CODES.items()}


class DraftStage:
    def __init__(self, cfg: OnlineSpecConfig, runner: Any, cutter: Any, lookup: Any,
                 drafter_k: int, K: int, guard: Any, tp: Any = None) -> None:
        self.cfg, self.runner, self.cutter, self.lookup = cfg, runner, cutter, lookup
        self.drafter_k, self.K, self.guard = drafter_k, K, guard
        self.tp = tp  # the TP group (None: one rank)
        # Steps since one scheduled a new request: the budget's 'auto' objective counts a
        # batch that took none for option_closed_after steps as closed (option_choice.py).
        self.quiet_steps = 0
        self.closed_after = getattr(getattr(cfg, "length_head", None), "option_closed_after", 8)

    def gate(self, scheduler_output: Any, sampled: Any = None) -> tuple[Any, int] | None:
        """(the scheduler output vLLM's drafter should see, the draft length k it asks for),
        or None to leave the step alone (K). k is at most the drafter's own length
        (`drafter_tokens`); the budget's gate tells the policy the next step's batch and
        scheduled tokens besides drafts and picks k in 0..drafter_k; where every request has
        a lookup draft the hybrid rule takes, k = 0. A plain-decoding feature-log engine always
        asks for k = 0. `sampled`: this step's sampled tokens (vLLM drafts before it books
        them), which the lookup needs. Fewer than K: vLLM gets a copy of the scheduler output
        asking for k (vLLM's own dynamic-K field; at k = 0 the drafter writes its context K/V
        only, compat.install_context_only_k0)."""
        if self.cfg.features.plain:  # a data-generation engine: plain decoding, features logged
            return compat.with_spec_tokens(scheduler_output, 0), 0
        k = self.drafter_k
        if self.cutter.policy_name == "budget":
            self.note_admissions(compat.step_admits(scheduler_output))
            B, base = compat.step_token_counts(scheduler_output)
            k = min(k, self.agree(self.cutter.plan_next(B, base)).k)
        if (k and sampled is not None and self.lookup is not None
                and self.cfg.prompt_lookup.skip_drafter):
            req_ids = compat.batch_req_ids(self.runner)
            history = compat.tokens_before_bookkeeping(self.runner, req_ids, sampled)
            if self.lookup.prepare(req_ids, history, self.seed_bound(req_ids)):
                self.lookup.skipped_steps += 1
                k = 0
        if k >= self.K:
            return None
        return compat.with_spec_tokens(scheduler_output, k), k

    @property
    def counts_laggard(self) -> bool:
        """Whether the budget's prices need each cycle's tokens for the request furthest from
        its end (objective 'slowest' or 'auto')."""
        options = getattr(self.cutter, "options", None)
        return options is not None and options.objective != "tokens"

    def note_admissions(self, admitted: bool) -> None:
        """This step scheduled a new request (or not): whether the batch is closed now."""
        self.quiet_steps = 0 if admitted else self.quiet_steps + 1
        options = getattr(self.cutter, "options", None)
        if options is not None:
            options.closed = self.quiet_steps >= self.closed_after

    def agree(self, decision: Any) -> Any:
        """Under tensor parallelism every rank drafts what rank 0 decided: the gate and the
        options decide from each rank's own timings, and the drafter's forward is a
        collective (ranks asking it for different k would not meet). One int broadcast a step."""
        if self.tp is None:
            return decision
        code = decision.k * 4 + _OPTION_CODES.get(decision.option, 0)
        k, option = divmod(compat.broadcast_version(self.tp, code), 4)
        return self.cutter.adopt(k, _OPTION_NAMES[option])

    def cut(self, drafts: Any) -> Any:
        """Cut each request's draft to the verify-length policy's choice (a prefix), then the
        lookup's drafts where they pay. The runner returns vLLM's drafts unchanged if this
        raises."""
        ids = drafts.draft_token_ids
        if not isinstance(ids, list):
            self.guard.skip(G.NON_LIST_DRAFTS)
            return drafts
        req_ids = getattr(drafts, "req_ids", None)  # lets the next step's verification score the head
        req_ids = list(req_ids) if req_ids else None
        cut = self.cutter.cut(ids, req_ids)
        # A data-generation engine (features.plain) never speculates; a step the budget chose
        # to run plain verifies no lookup draft either.
        if (self.lookup is not None and req_ids is not None and not self.cfg.features.plain
                and self.cutter.next_option != "plain"):
            cut = self.lookup.propose(cut, req_ids, compat.request_tokens(self.runner, req_ids),
                                      self.seed_bound(req_ids), self.cutter.step_price(len(cut)))
        drafts.draft_token_ids = cut
        return drafts

    # -- what the budget prices, measured by the runner -------------------------------------------
    def observe_step_cost(self, tokens: int, seconds: float) -> None:
        """A target step over `tokens` tokens took `seconds` (the budget's cost model)."""
        self.cutter.observe_step_cost(tokens, seconds)

    def observe_draft_time(self, k: int | None, seconds: float) -> None:
        """vLLM's drafter forward at draft length k (None: K) took `seconds`."""
        self.cutter.observe_draft_time(self.drafter_k if k is None else k, seconds)

    @property
    def times_cycles(self) -> bool:
        """Whether the runner should time whole engine cycles (the budget's gate prices them)."""
        return self.cutter.gate is not None

    def observe_cycle(self, k: int | None, batch_size: int, tokens: int, seconds: float, *,
                      drafter_verified: bool) -> None:
        """A whole engine cycle (one execute_model to the next) drafted at k (None: the
        drafter's own length), B requests, `tokens` target tokens (lookup and drafter drafts
        included), `drafter_verified`: the drafter's drafts among them."""
        self.cutter.observe_cycle(self.drafter_k if k is None else k, batch_size, tokens, seconds,
                                  drafter_verified=drafter_verified)

    @property
    def option(self) -> str | None:
        """What the budget chose for the drafts of this step ("plain", "tree", "drafter"), or
        None where no choice was made (the step is not priced)."""
        return self.cutter.next_option

    def observe_option(self, option: str, batch_size: int, tokens: int, seconds: float, *,
                       slowest: float | None = None, drafts: int | None = None) -> None:
        """A whole engine cycle without prefill that verified `option`'s drafts (`drafts`
        draft tokens) produced `tokens` tokens in `seconds` (`slowest`: those of the request
        furthest from its end), its drafting included (policy/option_choice.py)."""
        self.cutter.observe_option(option, batch_size, tokens, seconds, slowest=slowest,
                                   drafts=drafts)

    def seed_bound(self, req_ids: list[str]) -> list[bool]:
        """Requests whose exact sample depends on the drafts they are shown: seeded ones under
        vLLM's rejection sampling. Under drafter-invariant verification none is (their tokens
        depend on seed and target alone), so they may draft from other requests' text too."""
        if getattr(self.runner, "_onlinespec_invariant", None) is not None:
            return [False] * len(req_ids)
        return compat.seeded_requests(self.runner, req_ids)


# Token counts the start-up probe times: decode-sized to a full verify batch of a busy server.
PROBE_TOKENS = (1, 16, 64, 256)


def probe_step_cost(cost_model: Any, runner: Any) -> None:
    """Start-up measurement of the target step's cost for the budget policy: timed dummy
    steps over a spread of token counts, before any request. Real steps refresh it online.
    A failed probe leaves the prior in place and says so."""
    if cost_model is None:
        return
    try:
        t0 = time.perf_counter()
        samples = compat.time_target_steps(runner, PROBE_TOKENS)
        for n, sec in samples:
            cost_model.observe(n, sec)
        logger.info("onlinespec: start-up probe, %d timed target steps of %s tokens in "
                    "%.1f s: %s", len(samples), sorted({n for n, _ in samples}),
                    time.perf_counter() - t0, cost_model.describe())
    except Exception as e:  # noqa: BLE001 - the prior and online refits still work
        logger.warning("onlinespec: start-up cost probe failed (%s: %s); the budget starts "
                       "from the prior %s and refits from real steps",
                       type(e).__name__, e, cost_model.describe())
