"""Zero the gradients of a batch whose loss is an outlier, decided on the device (no host sync).

A running mean and variance (EMAs) of the accepted step losses set the bar: after ``warmup`` steps (at
least two, for a variance), a loss above mean + k x std, or not finite, masks that step's gradients to zero.
``RESEED_AFTER`` outliers in a row are a new level of the loss (a curriculum or sequence-length switch
moves it for good), not outliers: the statistics start again from the next loss, or the filter would
reject every later batch and the run would stop learning. The batch is
still consumed (the data order, and so an exact resume, do not depend on the decision). A masked
step adds no gradient; optimizers with momentum still apply their momentum and weight decay.
"""

from __future__ import annotations

import torch

RESEED_AFTER = 10


class BatchFilter:
    def __init__(self, k: float, device: torch.device, beta: float = 0.98, warmup: int = 20):
        self.k, self.beta, self.warmup = k, beta, warmup
        self.mean = torch.zeros((), device=device)
        self.var = torch.zeros((), device=device)
        self.seen = torch.zeros((), device=device)  # accepted losses folded into the EMAs
        self.skipped = torch.zeros((), device=device)
        self.streak = torch.zeros((), device=device)  # finite outliers in a row

    def keep(self, loss: torch.Tensor) -> torch.Tensor:
        """1.0 to apply this step's update, 0.0 to mask it; updates the statistics."""
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        bar = self.mean + self.k * self.var.clamp(min=0).sqrt()
        outlier = (self.seen >= max(self.warmup, 2)) & (loss > bar)
        self.streak = torch.where(finite & outlier, self.streak + 1, torch.zeros_like(self.streak))
        self.seen = torch.where(self.streak >= RESEED_AFTER, torch.zeros_like(self.seen), self.seen)  # a new level
        self.streak = torch.where(self.streak >= RESEED_AFTER, torch.zeros_like(self.streak), self.streak)
        keep = (finite & ~outlier).float()
        # Fold accepted losses into the bias-free EMAs (the first one seeds them).
        value = torch.where(finite, loss, self.mean)
        w = keep * torch.where(self.seen == 0, torch.ones_like(loss), torch.full_like(loss, 1 - self.beta))
        delta = value - self.mean
        self.mean += w * delta
        self.var = (1 - w) * (self.var + w * delta * delta)
        self.seen += keep
        self.skipped += 1 - keep
        return keep

    def mask(self, params: list[torch.Tensor], keep: torch.Tensor) -> None:
        # A fill, not a multiply by ``keep``: a non-finite batch's NaN and inf gradients times 0 stay NaN.
        skip = keep == 0
        for p in params:
            if p.grad is not None:
                p.grad.masked_fill_(skip, 0.0)

    def state_dict(self) -> dict:
        return {name: float(getattr(self, name)) for name in ("mean", "var", "seen", "skipped", "streak")}

    def load_state_dict(self, state: dict) -> None:
        for name in ("mean", "var", "seen", "skipped", "streak"):
            getattr(self, name).fill_(float(state.get(name, 0.0)))  # "streak": checkpoints before it had none
