"""Divergence guard: nothing non-finite is ever saved, and a diverged run rolls back to its last good state.

Every step folds ``isfinite(loss) & isfinite(grad_norm)`` into one boolean that stays on the device
(no host synchronisation inside a step); it is read only where the loop synchronises anyway: at
log points, before evaluation and before every save. A save additionally checks the parameters
themselves. When the flag is down the run reloads its newest checkpoint (all of which passed the
same check) with the learning rate scaled down, at most ``max_rollbacks`` times; after that it stops
and names that checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class FiniteFlag:
    """All losses and gradient norms since the last reset were finite (one device boolean)."""

    def __init__(self, device: torch.device):
        self.flag = torch.ones((), dtype=torch.bool, device=device)

    def fold(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.flag &= torch.isfinite(loss).all() & torch.isfinite(grad_norm).all()

    def read(self) -> bool:
        """Host sync: call only at log, eval and save points."""
        return bool(self.flag.item())

    def reset(self) -> None:
        self.flag.fill_(True)


def parameters_finite(params: list[torch.Tensor]) -> bool:
    """Every (local shard of a) parameter finite: one device reduction and one host sync, for save points."""
    if not params:
        return True
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return bool(torch.stack([torch.isfinite(p.detach()).all() for p in local]).all().item())


@dataclass
class RollbackPolicy:
    """How often a diverged run may roll back, and the LR multiplier it has accumulated."""

    max_rollbacks: int = 2
    lr_factor: float = 0.5
    rollbacks: int = 0
    lr_scale: float = 1.0

    def may_roll_back(self) -> bool:
        return self.rollbacks < self.max_rollbacks

    def record_rollback(self) -> None:
        self.rollbacks += 1
        self.lr_scale *= self.lr_factor

    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks = int(state.get("rollbacks", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
