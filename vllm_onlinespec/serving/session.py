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
from vllm_onlinespec.serving.feedback import records_from_step
from vllm_onlinespec.serving.publish import Publisher
from vllm_onlinespec.serving.trace import DraftTracer

logger = logging.getLogger("vllm_onlinespec")


def config_from_vllm(vllm_config: Any) -> OnlineSpecConfig:
    """Validate `additional_config["onlinespec"]`; raises ConfigError (one line) when bad."""
    cfg = OnlineSpecConfig.from_any(compat.additional_config(vllm_config).get("onlinespec"))
    method = compat.spec_method(vllm_config)
    if method != "dflash":
        raise ConfigError(
            f"onlinespec: vllm_onlinespec.SpecDecodeWorker needs --speculative-config with "
            f"method 'dflash' (got {method!r})")
    if cfg.publish.kv_policy != "tolerate":
        raise ConfigError(f"onlinespec.publish.kv_policy: only 'tolerate' is implemented "
                          f"(got {cfg.publish.kv_policy!r})")
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
        self.publisher = Publisher(runner)
        self.tracer = DraftTracer.maybe(cfg, runner)
        if cfg.enabled:
            self._start_learner(runner)
        logger.info("onlinespec: worker ready (learning=%s, algorithm=%s, verify policy=%s, K=%d)",
                    cfg.enabled, cfg.algorithm, cfg.length_head.policy, self.K)

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

        def save_model(directory) -> None:  # learner checkpoints stay loadable by vLLM
            save_drafter(directory, dcfg, bundle.drafter, bundle.length_head)

        self.learner = OnlineLearner(bundle, self.cfg, loss_fn, make_batch, self.buffer,
                                     save_model=save_model)
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

    # -- every engine step ------------------------------------------------------------------------
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
                if self.tracer is not None:
                    self.tracer.record(view, accepted, sampled)
                if self.buffer is not None:
                    with torch.inference_mode(False):
                        for rec in records_from_step(view, accepted, self.publisher.version):
                            self.buffer.push(rec)
                    for rid in view.finished_req_ids:
                        self.buffer.finish(rid)
                    self.learner.notify()
            if self.learner is not None:
                self.publisher.publish(self.learner.latest())
        except Exception as e:  # noqa: BLE001 - serving must go on
            self._failed(e)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"published_version": self.publisher.version,
                               "publishes": self.publisher.count,
                               "publish_ms_last": self.publisher.last_ms,
                               "publish_ms_total": self.publisher.total_ms,
                               "hook_errors": self.errors, "steps": self.steps}
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

    def cut_drafts(self, drafts: Any) -> Any:
        return drafts

    def close(self) -> None:
        if self.learner is not None:
            self.learner.stop()
            if self.cfg.checkpoint.dir:
                try:
                    self.learner.save_checkpoint()
                except Exception as e:  # noqa: BLE001
                    logger.warning("onlinespec: final checkpoint failed: %s", e)
