"""One online-speculation session per worker: config, buffer, learner, publishing, policy.

The serving thread only ever does cheap things here (clone feedback rows into the buffer, swap
in the newest published weights, cut drafts); the learner thread does the training. Nothing
that goes wrong on the learning side may reach the serving path: every hook is guarded, counts
its failures and lets the engine step finish with the last good weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.serving import compat
from vllm_onlinespec.budget import StepCostModel
from vllm_onlinespec.serving.feedback import records_from_step
from vllm_onlinespec.serving.metrics import MetricsWriter
from vllm_onlinespec.serving.publish import Publisher
from vllm_onlinespec.serving.trace import DraftTracer
from vllm_onlinespec.verify_length import make_policy

logger = logging.getLogger("vllm_onlinespec")
# Token counts the start-up probe times: decode-sized to a full verify batch of a busy server.
PROBE_TOKENS = (1, 16, 64, 256)


def config_from_vllm(vllm_config: Any) -> OnlineSpecConfig:
    """Validate `additional_config["onlinespec"]`; raises ConfigError (one line) when bad."""
    cfg = OnlineSpecConfig.from_any(compat.additional_config(vllm_config).get("onlinespec"))
    method = compat.spec_method(vllm_config)
    if method != "dflash":
        raise ConfigError(
            f"onlinespec: vllm_onlinespec.SpecDecodeWorker needs --speculative-config with "
            f"method 'dflash' (got {method!r})")
    k = compat.num_speculative_tokens(vllm_config)
    if cfg.oracle.accept_len is not None and cfg.oracle.accept_len > k + 1:
        raise ConfigError(f"onlinespec.oracle.accept_len: must be <= num_speculative_tokens + 1 "
                          f"= {k + 1} (got {cfg.oracle.accept_len:g})")
    return cfg


class TrainBundle(nn.Module):
    """What the learner trains: the drafter twin and, optionally, its length head."""

    def __init__(self, drafter: nn.Module, length_head: nn.Module | None) -> None:
        super().__init__()
        self.drafter = drafter
        self.length_head = length_head


class OnlineSession:
    def __init__(self, runner: Any, cfg: OnlineSpecConfig) -> None:
        self.cfg = cfg
        self.K = compat.num_speculative_tokens(runner.vllm_config)
        self.errors = 0
        self.steps = 0
        self.learner = None
        self.buffer = None
        self.publisher = Publisher(runner, repack=cfg.publish.repack and cfg.enabled)
        self.tracer = DraftTracer.maybe(cfg, runner)
        self.metrics = MetricsWriter()
        self.policy = make_policy(cfg.length_head, StepCostModel())
        self.last_reason = ""
        self.policy_drafted = self.policy_verified = 0
        self.head: nn.Module | None = None
        self._draft_hidden: torch.Tensor | None = None
        self.oracle = None
        if cfg.oracle.accept_len is not None:
            from vllm_onlinespec.serving.oracle import OracleVerifier

            self.oracle = OracleVerifier(cfg.oracle.accept_len, self.K, cfg.oracle.seed)
        if cfg.length_head.policy != "fixed":
            compat.wrap_draft_sampler(runner, self._on_draft_hidden)
        if cfg.enabled:
            self._start_learner(runner)
        if cfg.length_head.policy != "fixed" and self.head is None:
            self.head = self._checkpoint_head(runner)
        logger.info("onlinespec: worker ready (learning=%s, algorithm=%s, K=%d); %s; length head: %s",
                    cfg.enabled, cfg.algorithm, self.K, self.policy.describe(),
                    "none: population estimate only" if self.head is None else "on")

    @classmethod
    def start(cls, runner: Any) -> "OnlineSession":
        return cls(runner, config_from_vllm(runner.vllm_config))

    @property
    def wants_feedback(self) -> bool:
        return self.learner is not None or self.tracer is not None

    # -- set-up ---------------------------------------------------------------------------------
    def _start_learner(self, runner: Any) -> None:
        from vllm_onlinespec.drafter import load_drafter, save_drafter
        from vllm_onlinespec.learner import FeedbackBuffer, OnlineLearner
        from vllm_onlinespec.learner.batches import make_batch_fn
        from vllm_onlinespec.training.blocks import block_loss

        path = self.cfg.drafter or compat.draft_model_path(runner.vllm_config)
        dcfg, drafter, head = load_drafter(path, dtype=torch.float32)
        if head is None and self.cfg.length_head.train:
            from vllm_onlinespec.drafter import LengthHead

            head = LengthHead(dcfg.hidden_size)
        embed, lm_head = compat.target_embed_and_head(runner)
        with torch.inference_mode(False):
            self.embed_w = embed.detach().to("cpu", torch.float32).clone()
            self.head_w = lm_head.detach().to("cpu", torch.float32).clone()
        self.buffer = FeedbackBuffer.from_config(self.cfg)
        loss_cfg = self.cfg.loss

        def loss_fn(model: TrainBundle, batch) -> tuple[torch.Tensor, dict]:
            loss, stats = block_loss(model.drafter, batch.ids, batch.aux.float(),
                                     batch.final_hidden.float(), batch.anchors, self.embed_w,
                                     self.head_w, loss_cfg=loss_cfg, length_head=model.length_head,
                                     lengths=batch.lengths)
            return loss, stats.as_dict()

        make_batch = make_batch_fn(self.cfg.batch_blocks, self.cfg.anchors_per_request,
                                   holdback=self.K)
        bundle = TrainBundle(drafter, head)
        if head is not None:
            import copy

            self.head = copy.deepcopy(head).eval().requires_grad_(False)

        def save_model(directory) -> None:  # learner checkpoints stay loadable by vLLM
            save_drafter(directory, dcfg, bundle.drafter, bundle.length_head)

        self.learner = OnlineLearner(bundle, self.cfg, loss_fn, make_batch, self.buffer,
                                     save_model=save_model, holdback=self.K)
        if self.cfg.checkpoint.dir:
            try:
                v = self.learner.load_checkpoint()
                if v:
                    self.publisher.publish(self.learner.latest())
                    logger.info("onlinespec: resumed drafter version %d from %s", v,
                                self.cfg.checkpoint.dir)
            except FileNotFoundError:
                pass
        self.learner.start()

    def _checkpoint_head(self, runner: Any) -> nn.Module | None:
        from vllm_onlinespec.drafter import load_drafter

        try:
            path = self.cfg.drafter or compat.draft_model_path(runner.vllm_config)
            return load_drafter(path, dtype=torch.float32)[2]
        except Exception as e:  # noqa: BLE001 - no head: the policy says so in its reasons
            logger.warning("onlinespec: no length head (%s); verify policy uses population "
                           "estimates", e)
            return None

    def _on_draft_hidden(self, hidden: torch.Tensor) -> None:
        self._draft_hidden = hidden

    # -- every engine step ------------------------------------------------------------------------
    def observe_step_cost(self, tokens: int, seconds: float) -> None:
        cm = getattr(self.policy, "cost_model", None)
        if cm is not None:
            cm.observe(tokens, seconds)
    def probe_step_cost(self, runner: Any) -> None:
        """Start-up measurement of the target step's cost for the budget policy: timed dummy
        steps over a spread of token counts, before any request. Real steps refresh it online.
        A failed probe leaves the prior in place and says so."""
        cm = getattr(self.policy, "cost_model", None)
        if cm is None:
            return
        try:
            t0 = time.perf_counter()
            samples = compat.time_target_steps(runner, PROBE_TOKENS)
            for n, sec in samples:
                cm.observe(n, sec)
            logger.info("onlinespec: start-up probe, %d timed target steps of %s tokens in "
                        "%.1f s: %s", len(samples), sorted({n for n, _ in samples}),
                        time.perf_counter() - t0, cm.describe())
        except Exception as e:  # noqa: BLE001 - the prior and online refits still work
            logger.warning("onlinespec: start-up cost probe failed (%s: %s); the budget starts "
                           "from the prior %s and refits from real steps",
                           type(e).__name__, e, cm.describe())

    def force_oracle(self, sampled: Any, logits: Any, metadata: Any) -> None:
        """Benchmark-only: rewrite the sampler's accepted lengths (serving/oracle.py)."""
        if self.oracle is not None and metadata is not None:
            self.oracle.force(sampled, logits, metadata)

    def capture(self, runner: Any) -> compat.StepView | None:
        if not self.wants_feedback:
            return None
        try:
            return compat.step_view(runner)
        except Exception as e:  # noqa: BLE001 - serving must go on
            self._failed(e)
            return None

    def _failed(self, e: BaseException) -> None:
        self.errors += 1
        if self.errors <= 3 or self.errors % 100 == 0:
            logger.exception("onlinespec: step hook failed (%d so far): %s", self.errors, e)

    def after_step(self, runner: Any, view: compat.StepView | None, sampled: Any) -> None:
        self.steps += 1
        try:
            if view is not None and sampled is not None:
                accepted = compat.accepted_counts(sampled, view.num_draft_tokens)
                if view.num_draft_tokens is not None:
                    drafted = view.num_draft_tokens
                    self.policy.observe([d for d in drafted if d], [a for d, a in zip(drafted, accepted) if d])
                if self.tracer is not None:
                    self.tracer.record(view, accepted, sampled)
                if self.buffer is not None:
                    with torch.inference_mode(False):
                        for rec in records_from_step(view, accepted, self.publisher.version):
                            self.buffer.push(rec)
                    for rid in view.finished_req_ids:
                        self.buffer.finish(rid)
                    self.learner.notify()
            if self.learner is not None and self.publisher.publish(self.learner.latest()):
                self._refresh_head(self.learner.latest()[1])
            if self.metrics.due():
                self.metrics.write(self.stats(), self.info())
        except Exception as e:  # noqa: BLE001 - serving must go on
            self._failed(e)

    def _refresh_head(self, snapshot) -> None:
        if self.head is None:
            return
        prefix = "length_head."
        state = {k[len(prefix):]: v for k, v in snapshot.items() if k.startswith(prefix)}
        if state:
            self.head.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"oracle_accept_len": self.oracle.accept_len if self.oracle else 0.0,
                               "published_version": self.publisher.version,
                               "publishes": self.publisher.count,
                               "publish_ms_last": self.publisher.last_ms,
                               "publish_ms_total": self.publisher.total_ms,
                               "hook_errors": self.errors, "steps": self.steps,
                               "policy/drafted": self.policy_drafted,
                               "policy/verified": self.policy_verified,
                               "policy/last_reason": self.last_reason}
        cm = getattr(self.policy, "cost_model", None)
        if cm is not None:
            out.update({"cost/a_s": cm.a, "cost/b_s_per_token": cm.b})
        if self.learner is not None:
            out.update({f"learner/{k}": v for k, v in self.learner.stats().items()})
            out.update({f"buffer/{k}": v for k, v in self.buffer.stats().items()})
        return out

    def digest(self) -> str:
        """Digest of the published weights (what vLLM's drafter holds)."""
        from vllm_onlinespec.learner.checkpoint import state_digest

        if self.learner is None:
            return ""
        return state_digest(self.learner.latest()[1])

    def info(self) -> dict[str, str]:
        return {"algorithm": self.cfg.algorithm, "learning": str(self.cfg.enabled),
                "verify_policy": self.cfg.length_head.policy, "K": str(self.K),
                "length_head": "on" if self.head is not None else "off"}

    def cut_drafts(self, drafts: Any) -> Any:
        """Cut each request's draft to the verify-length policy's choice (a prefix: lossless)."""
        try:
            ids = drafts.draft_token_ids
            if not isinstance(ids, list) or not ids:
                return drafts
            B = len(ids)
            drafted = [len(d) for d in ids]
            self.policy_drafted += sum(drafted)
            if self.cfg.length_head.policy == "fixed":
                self.policy_verified += sum(drafted)
                return drafts
            hidden, self._draft_hidden = self._draft_hidden, None
            pred = None
            if self.head is not None and hidden is not None and hidden.shape[0] == B * self.K:
                with torch.inference_mode():
                    pred = self.head(hidden.float().view(B, self.K, -1)).tolist()
            lengths, self.last_reason = self.policy.lengths(pred, self.K, B)
            drafts.draft_token_ids = [d[: min(len(d), n)] for d, n in zip(ids, lengths)]
            self.policy_verified += sum(len(d) for d in drafts.draft_token_ids)
        except Exception as e:  # noqa: BLE001 - fall back to the uncut drafts
            self._failed(e)
        return drafts

    def close(self) -> None:
        if self.learner is not None:
            self.learner.stop()
            if self.cfg.checkpoint.dir:
                try:
                    self.learner.save_checkpoint()
                except Exception as e:  # noqa: BLE001
                    logger.warning("onlinespec: final checkpoint failed: %s", e)
