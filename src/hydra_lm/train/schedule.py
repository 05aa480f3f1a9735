"""Learning-rate schedules (linear warm-up, then cosine or warmup-stable-decay) and adaptive cool-down.

The schedule is a pure function of the step, so resuming needs no scheduler state beyond the
step itself; only the adaptive cool-down carries state (saved in the checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str = "cosine",
          wsd_decay_pct: float = 0.2) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        # From the peak at the first step after warm-up to min_lr at the last step, max_steps - 1 (a run of one
        # step after warm-up stays at the peak).
        span = max(1, max_steps - 1 - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, round(wsd_decay_pct * max_steps))
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / max(1, max_steps - decay_start))
        return lr + (min_lr - lr) * progress
    raise ValueError(f"unknown schedule {schedule!r}: use cosine or wsd")


def ema_update(ema: float | None, value: float, beta: float, cap: float) -> float:
    """Exponential moving average fed ``value`` capped at ``cap`` x the average: one outlier raises
    the bar only a little, yet a lasting new level is reached within a few dozen readings (an
    average that ignored outliers altogether would call every later reading an outlier)."""
    if ema is None:
        return value
    return beta * ema + (1 - beta) * min(value, cap * ema)


@dataclass
class AdaptiveLR:
    """Cuts the LR after a loss spike (logged loss > ``spike`` x its EMA) for ``cooldown`` steps.

    It only looks at losses already read for logging, so it adds no host synchronisation.
    """

    spike: float = 2.0
    factor: float = 0.5
    cooldown: int = 100
    beta: float = 0.9
    ema: float | None = None
    cool_until: int = -1
    spikes: int = 0

    def multiplier(self, step: int) -> float:
        return self.factor if step < self.cool_until else 1.0

    def observe(self, step: int, loss: float) -> bool:
        """Feed the loss logged after ``step`` steps; True when it starts a cool-down."""
        if not math.isfinite(loss):
            self.cool_until = step + self.cooldown
            self.spikes += 1
            return True
        spiked = self.ema is not None and loss > self.spike * self.ema
        self.ema = ema_update(self.ema, loss, self.beta, self.spike)
        if spiked:
            self.cool_until = step + self.cooldown
            self.spikes += 1
        return spiked

    def state_dict(self) -> dict:
        return {"ema": self.ema, "cool_until": self.cool_until, "spikes": self.spikes}

    def load_state_dict(self, state: dict) -> None:
        self.ema = state["ema"]
        self.cool_until = int(state["cool_until"])
        self.spikes = int(state["spikes"])
