"""Online learning of the drafter from verification feedback (no vLLM imports here)."""

from . import checkpoint
from .algorithms import (HedgeEnsemble, OGD, OnlineAlgorithm, Optimistic, OptimisticMomentum,
                         make_algorithm)
from .buffer import FeedbackBuffer, FeedbackRecord, TrainingWindow
from .checkpoint import Checkpoint, CheckpointError
from .factory import build_learner
from .learner import OnlineLearner

__all__ = [
    "Checkpoint", "CheckpointError", "FeedbackBuffer", "FeedbackRecord", "HedgeEnsemble", "OGD",
    "OnlineAlgorithm", "OnlineLearner", "Optimistic", "OptimisticMomentum", "TrainingWindow",
    "build_learner", "checkpoint", "make_algorithm",
]
