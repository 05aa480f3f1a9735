"""The run's clocks: the seconds spent training, the run's position on its schedule, and which of
logging, evaluation and checkpointing fall due after a step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


class TrainClock:
    """Training time only: evaluation, checkpoints and compilation at a start are not counted in
    ``train_s`` (compilation and CUDA-graph capture go to ``startup_s``)."""

    def __init__(self, device: torch.device, max_steps: int, time_budget_s: float | None):
        self.device, self.max_steps, self.budget = device, max_steps, time_budget_s
        self.train_s = 0.0
        self.startup_s = 0.0
        self.t0: float | None = None  # None: the clock is stopped

    def start(self) -> float:
        self.t0 = time.perf_counter()
        return self.t0

    def bank(self, startup: bool = False) -> None:
        """Stop the clock (before eval / a checkpoint) and add what it measured to train_s; with
        ``startup`` add it to startup_s and keep the clock running."""
        if self.t0 is None:
            return
        if self.device.type == "cuda":  # the steps queued so far belong to this interval
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if startup:
            self.startup_s += now - self.t0
        else:
            self.train_s += now - self.t0
        self.t0 = now if startup else None

    def seconds(self) -> float:
        return self.train_s + (time.perf_counter() - self.t0 if self.t0 is not None else 0.0)

    def position(self, step: int) -> int:
        """Where the run is on its schedule, in steps of max_steps: the step itself, or with a time
        budget the fraction of it spent (so runs of any speed share one schedule family)."""
        if not self.budget:
            return step
        return int(self.max_steps * min(1.0, self.seconds() / self.budget))


@dataclass
class Due:
    regular: bool  # a log_every record: the only kind that feeds the run's loss-driven decisions
    log: bool
    eval: bool
    save: bool


def due_after_step(cfg, step: int, before: int, now: int, end: int, stopping: bool) -> Due:
    """What a step that moved the schedule from ``before`` to ``now`` makes due (``end``: where the run stops)."""
    regular = step % cfg.log_every == 0
    return Due(regular=regular,
               log=regular or now >= end or stopping,
               eval=bool(cfg.eval_every and now // cfg.eval_every > before // cfg.eval_every or now == cfg.max_steps),
               save=now // cfg.save_every > before // cfg.save_every or now >= end)
