"""The draft cutter: the length head -> the verify-length policy -> each request's cut draft.

One object per engine, driven by the serving layer at three points of a step:

    plan_next(B, n)     before drafting ('budget' with its gate): the next step's draft length,
                        K, fewer, or vLLM's drafter at K = 0 (policy/step_gate.py)
    observe_hidden(h)   inside vLLM's drafter, the mask rows' final hidden states [B*K, H]
    cut(drafts)         before verification: each request's draft cut to the policy's length
                        (a prefix of what was drafted: lossless)
    observe(d, a)       after verification: drafted / accepted per request (policy statistics)
    refresh(snap, v)    after a publish: the length head's weights from that same snapshot

Which head, if any, predicts: a head shipped by the drafter checkpoint, or one learning from
real verification (`length_head.head_lr` > 0), is warm; a head created fresh for the learner to
train is not until the learner has published `HEAD_WARMUP_VERSIONS` versions that trained it.
A warm head is consulted only once its predictions beat the population estimate on
`length_head.head_gate_labels` fresh verification labels (policy/head_feedback.py; until then
the policy uses its population estimate and the reason says so). Policy `fixed` never consults
a head.
No vLLM import here: the serving layer guards every call.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from vllm_onlinespec.policy.acceptance_estimator import ConfidenceEstimator
from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.policy.head_feedback import HeadFeedback
from vllm_onlinespec.policy.lookup_price import StepPrice
from vllm_onlinespec.policy.option_choice import OptionChoice
from vllm_onlinespec.policy.step_gate import GateDecision, StepGate
from vllm_onlinespec.policy.verify_length import make_policy

HEAD_WARMUP_VERSIONS = 50
LENGTH_HEAD_PREFIX = "length_head."


class DraftCutter:
    def __init__(self, length_cfg: Any, K: int, *, head: nn.Module | None = None,
                 head_trusted: bool = False, cost_model: StepCostModel | None = None,
                 on_skip: Callable[[str], None] | None = None,
                 warmup_versions: int = HEAD_WARMUP_VERSIONS, lookup: bool = False) -> None:
        """K: vLLM's num_speculative_tokens (draft tokens per request per step).
        head: the length head to predict with (a private copy is kept), or None.
        head_trusted: True for a head that came trained (a checkpoint's), False for one being
        trained online from random weights. lookup: a lookup stage drafts beside the drafter
        (the gate's options then include 'tree')."""
        self.K = K
        self.policy_name = length_cfg.policy
        self.policy = make_policy(length_cfg, cost_model or StepCostModel())
        fixed = self.policy_name == "fixed"
        self.head = None if fixed or head is None else _frozen_copy(head)
        self.head_trusted = head_trusted
        self.warmup_versions = warmup_versions
        self.head_version = 0
        self.on_skip = on_skip or (lambda reason: None)
        self.drafted = self.verified = 0
        self.last_reason = ""
        self._hidden: torch.Tensor | None = None
        self.gate: StepGate | None = None
        if self.policy_name == "budget" and getattr(length_cfg, "gate", False):
            self.gate = StepGate(K, self.policy.cost_model,
                                 explore_every=length_cfg.explore_every,
                                 explore_requests=length_cfg.explore_requests,
                                 min_obs=self.policy.min_obs, rho=length_cfg.rho)
        # What each step verifies, chosen by measured cycles (policy/option_choice.py).
        self.options: OptionChoice | None = None
        if self.gate is not None:
            held = getattr(length_cfg, "options", None) or (
                ["plain", "tree", "drafter"] if lookup else ["plain", "drafter"])
            if held != ["drafter"]:
                self.options = OptionChoice(
                    tuple(held), explore_every=getattr(length_cfg, "option_explore_every", 16),
                    regret=getattr(length_cfg, "option_regret", 0.01),
                    objective=getattr(length_cfg, "option_objective", "tokens"),
                    cold_pick=getattr(length_cfg, "option_cold_pick", "neighbour"),
                    margin=getattr(length_cfg, "option_margin", 0.05))
        self._next = GateDecision(K, False, "")
        self._base_tokens: int | None = None
        self.price_lookup = getattr(length_cfg, "price_lookup", True)
        # vLLM-style acceptance from the drafter's top-1 probability, instead of the head.
        self.estimator = (ConfidenceEstimator(K) if self.policy_name == "budget"
                          and getattr(length_cfg, "estimator", "head") == "confidence" else None)
        if self.estimator is not None:
            self.head = None
        self._conf: torch.Tensor | None = None
        # Real verification scores (and, with head_lr > 0, trains) the head; it is consulted
        # only once it beats the population estimate on fresh labels (policy/head_feedback.py).
        self.learn_from_verification = (self.head is not None
                                        and getattr(length_cfg, "head_lr", 0.0) > 0)
        self.feedback = HeadFeedback(K, min_labels=getattr(length_cfg, "head_gate_labels", 0),
                                     lr=getattr(length_cfg, "head_lr", 0.0))

    # -- what the serving layer asks -----------------------------------------------------------
    @property
    def needs_hidden(self) -> bool:
        """Whether vLLM's drafter must hand over its hidden states (a head that may predict)."""
        return self.head is not None

    @property
    def needs_confidence(self) -> bool:
        """Whether vLLM's drafter must hand over its top-1 probabilities (the estimator)."""
        return self.estimator is not None

    @property
    def head_warm(self) -> bool:
        """Trained at all: shipped, learning from verification, or published by the learner
        often enough."""
        return self.head is not None and (self.head_trusted or self.learn_from_verification
                                          or self.head_version >= self.warmup_versions)

    @property
    def head_in_use(self) -> bool:
        return self.head_warm and self.feedback.passes()

    @property
    def head_state(self) -> str:
        if self.head is None:
            return "off"
        if not self.head_warm:
            return "warming"
        return "on" if self.feedback.passes() else "gated"

    @property
    def cost_model(self) -> StepCostModel | None:
        return getattr(self.policy, "cost_model", None)

    def describe(self) -> str:
        if self.estimator is not None:
            return (f"{self.policy.describe()}; acceptance: online logistic on the drafter's "
                    f"top-1 probability")
        return f"{self.policy.describe()}; length head: {self.head_state}"

    # -- a step ----------------------------------------------------------------------------------
    def plan_next(self, batch_size: int, base_tokens: int | None = None) -> GateDecision:
        """Before this step's drafter runs: how many tokens (0..K) it drafts for the next step
        (its requests: `batch_size`; tokens besides drafts: `base_tokens`). Without a gate: K."""
        self._base_tokens = base_tokens
        if self.gate is None:
            self._next = GateDecision(self.K, False, "")
        else:
            d = self.gate.decide(self.policy.stats, batch_size, base_tokens)
            if self.options is not None and batch_size > 0 and not d.explore:
                d = self._choose_option(d, batch_size)
            self._next = d
        return self._next

    def _choose_option(self, d: GateDecision, batch_size: int) -> GateDecision:
        """The gate's verdict (the drafter at k, or shut) against the options' measured prices:
        the drafter keeps the gate's k (its best plan's k where the gate shut it); 'tree' and
        'plain' draft nothing from the drafter, 'plain' no lookup draft either."""
        opts = self.options.options
        pick = "drafter" if d.k > 0 else ("tree" if "tree" in opts else "plain")
        o = self.options.choose(batch_size, pick)
        k = (d.k or self.gate.best_k or self.K) if o.option == "drafter" else 0
        return GateDecision(k, False, f"{d.reason}; {o.reason}", option=o.option)

    def adopt(self, k: int, option: str | None) -> GateDecision:
        """Serve the next step at draft length k as `option` (another rank's decision under
        tensor parallelism)."""
        if (k, option) != (self._next.k, self._next.option):
            self._next = GateDecision(k, self._next.explore and k == self._next.k,
                                      f"rank 0's decision: k={k}, {option}", option=option)
        return self._next

    @property
    def next_option(self) -> str | None:
        """The option the drafts being cut now were chosen as (None: no choice made)."""
        return self._next.option

    def observe_option(self, option: str, batch_size: int, tokens: int, seconds: float, *,
                       slowest: float | None = None, drafts: int | None = None) -> None:
        """A measured cycle that verified `option`'s drafts (policy/option_choice.py)."""
        if self.options is not None:
            self.options.observe(option, batch_size, tokens, seconds, slowest=slowest,
                                 drafts=drafts)

    def step_price(self, batch_size: int) -> StepPrice | None:
        """What pricing the next step's lookup drafts needs (policy/lookup_price.py) under the
        budget policy; None: lookup drafts verified whole."""
        if self.policy_name != "budget" or not self.price_lookup:
            return None
        stats = self.policy.stats
        drafter_p = stats._rates() if stats is not None and stats.n_obs >= self.policy.min_obs else None
        base = self._base_tokens if self._base_tokens is not None else batch_size
        return StepPrice(self.policy.cost_model, max(batch_size, int(base)), drafter_p,
                         1.0 / self.policy.rho)

    def observe_draft_time(self, k: int, seconds: float) -> None:
        """The drafter's forward at draft length k took `seconds`."""
        if self.gate is not None:
            self.gate.timer.observe(k, seconds)

    def observe_cycle(self, k: int, batch_size: int, tokens: int, seconds: float, *,
                      drafter_verified: bool = False) -> None:
        """A whole engine cycle's wall time (policy/cycle_overhead.py)."""
        if self.gate is not None:
            self.gate.observe_cycle(k, batch_size, tokens, seconds,
                                    drafter_verified=drafter_verified)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        if self.head is not None:
            self._hidden = hidden

    def observe_confidence(self, conf: torch.Tensor) -> None:
        """The drafter's top-1 probability per draft row [B * k], this step."""
        if self.estimator is not None:
            self._conf = conf

    def cut(self, drafts: list[list[int]], req_ids: list[str] | None = None) -> list[list[int]]:
        """Each request's draft cut to the policy's verify length (new lists; drafts unchanged).
        req_ids (the drafts' requests) let the next step's verification score the head."""
        hidden, self._hidden = self._hidden, None
        drafted = [len(d) for d in drafts]
        self.drafted += sum(drafted)
        if self.policy_name == "fixed" or not drafts:
            self.verified += sum(drafted)
            return drafts
        if not any(drafted):  # the gate shut this step: vLLM drafted at K = 0
            self.last_reason = self._next.reason
            return drafts
        B = len(drafts)
        pred = rows = None
        if self.head is not None and (self.head_warm or req_ids is not None):
            if hidden is not None and hidden.shape[0] == B * self.K:
                head = self.head_on(hidden.device)
                rows = hidden.float().view(B, self.K, -1)
                with torch.inference_mode():
                    pred = head(rows).tolist()  # shadow prediction while the head is gated
            elif self.head_in_use:
                self.on_skip("no_draft_hidden")
        used = pred if self.head_in_use else None
        # The gate may have asked vLLM for k < K draft tokens: the budget allocates over those.
        k = max(drafted)
        kw = ({"base_tokens": self._base_tokens, "draft_len": k}
              if self.policy_name == "budget" else {})
        conf, self._conf = self._conf, None
        if self.estimator is not None:
            if conf is not None and conf.numel() == B * k:
                conf = conf.float().view(B, k).cpu().numpy()
                conf_p = self.estimator.predict(conf)
                p = np.zeros((B, self.K))
                p[:, :k] = conf_p
                kw["p_accept"] = p
            else:
                conf = None
                self.on_skip("no_draft_confidence")  # serving/guard.NO_DRAFT_CONFIDENCE
        lengths, reason = self.policy.lengths(used, self.K, B, **kw)
        if self.gate is not None:
            # What the policy verifies on its own, before exploration forces full drafts.
            self.gate.observe_cut(sum(lengths) / B)
            if self._next.explore:
                n = min(self.gate.explore_requests, B)
                lengths = [k] * n + list(lengths[n:])
        out = [d[: min(len(d), n)] for d, n in zip(drafts, lengths)]
        if self.head is not None and pred is not None and used is None:
            reason += f"; length head not used ({self.feedback.state()})"
        self.last_reason = f"{reason}; {self._next.reason}" if self._next.reason else reason
        self.verified += sum(len(d) for d in out)
        if req_ids is not None and (self.head is not None or conf is not None):
            stats = self.policy.stats
            r_pop = (stats.expected_fraction() if stats is not None
                     and stats.n_obs >= self.policy.min_obs else None)
            if self.head is not None:
                self.feedback.record(req_ids, pred, r_pop, [len(d) for d in out], rows)
            if conf is not None:
                self.estimator.record(req_ids, conf, conf_p, [len(d) for d in out], r_pop)
                reason += f"; {self.estimator.state()}"
                self.last_reason = f"{reason}; {self._next.reason}" if self._next.reason else reason
        return out

    def head_on(self, device: torch.device) -> nn.Module:
        """The head, moved once to where vLLM's drafter hands over its hidden states (a CUDA
        tensor on a GPU): predicting where the states are costs no host copy of [B*K, H].
        Later refreshes copy into these parameters, so they stay on that device."""
        p = next(self.head.parameters(), None)
        if p is not None and p.device != device:
            with torch.inference_mode(False):  # parameters stay trainable (head_feedback)
                self.head.to(device)
        return self.head

    def observe(self, drafted: list[int] | None, accepted: list[int],
                req_ids: list[str] | None = None) -> None:
        if drafted is None:
            return
        self.policy.observe([d for d in drafted if d], [a for d, a in zip(drafted, accepted) if d])
        if req_ids is not None and self.head is not None:
            self.feedback.observe(self.head, req_ids, drafted, accepted)
        if req_ids is not None and self.estimator is not None:
            self.estimator.observe(req_ids, drafted, accepted)

    def forget(self, req_ids) -> None:
        """Finished requests: no verification will come for their last cut."""
        self.feedback.forget(req_ids)
        if self.estimator is not None:
            self.estimator.forget(req_ids)

    def observe_step_cost(self, tokens: int, seconds: float) -> None:
        cm = self.cost_model
        if cm is not None:
            cm.observe(tokens, seconds)

    def refresh(self, snapshot: Mapping[str, torch.Tensor], version: int) -> None:
        """The head's weights from the snapshot that was just published (version `version`)."""
        if self.head is None or self.learn_from_verification:
            return  # a head learning from real verification is not overwritten by the learner's
        state = {k[len(LENGTH_HEAD_PREFIX):]: v for k, v in snapshot.items()
                 if k.startswith(LENGTH_HEAD_PREFIX)}
        if state:
            self.head.load_state_dict(state)
            self.head_version = version


def _frozen_copy(head: nn.Module) -> nn.Module:
    import copy

    with torch.inference_mode(False):  # vLLM builds us under inference mode; keep it trainable
        return copy.deepcopy(head).to(torch.float32).eval().requires_grad_(False)
