"""Training system: config layers, the loop, schedules, curriculum, checkpoints, evaluation during training
(using a finished run: ``hydra_lm.infer``)."""

from __future__ import annotations

from .checkpoint import CheckpointError, CheckpointManager, resolve_checkpoint, verify
from .curriculum import Curriculum, CurriculumPlan
from .evaluate import evaluate
from .options import TrainConfig
from .pretest import get_history, get_summary, print_summary, run_pretests_for_checkpoint
from .run import setup_run
from .schedule import AdaptiveLR, lr_at
from .trainer import Trainer, train

__all__ = [
    "AdaptiveLR",
    "CheckpointError",
    "CheckpointManager",
    "Curriculum",
    "CurriculumPlan",
    "TrainConfig",
    "Trainer",
    "evaluate",
    "get_history",
    "get_summary",
    "lr_at",
    "print_summary",
    "run_pretests_for_checkpoint",
    "resolve_checkpoint",
    "setup_run",
    "train",
    "verify",
]
