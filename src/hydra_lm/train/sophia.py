"""Sophia-G: a clipped, diagonally preconditioned momentum update whose curvature comes from the
Gauss-Newton-Bartlett estimate (the seeds' ``--optimizer sophia``).

Every ``update_period`` steps the trainer runs one more backward pass, of the loss on labels sampled
from the model's own predictions (``TrainStep.sample_hessian``); the squared gradients of that loss,
times the tokens of the batch, estimate the diagonal of the Gauss-Newton matrix, and ``update_hessian``
folds them into a running mean. Unlike the Hutchinson estimate no second derivative is taken, so the
step compiles and its forward + backward replay as a CUDA graph like any optimizer's.

Written here because no maintained package has this variant (pytorch-optimizer offers the Hutchinson
one, SophiaH, which needs a second-order backward; torch has neither).
"""

from __future__ import annotations

import torch

# Keeps the preconditioner finite where the Hessian estimate is still 0 (the update is then clipped).
EPS = 1e-15


class SophiaG(torch.optim.Optimizer):
    """``p -= lr * clip(m / (rho * tokens_per_batch * h), 1)`` coordinate-wise, after decoupled weight decay;
    ``m`` a momentum of the gradients (beta1), ``h`` a running mean (beta2) of the sampled-label squared
    gradients, updated by ``update_hessian``. ``rho`` bounds how far the curvature lets a coordinate move
    below the clip. ``tokens_per_batch``: the tokens of the batch the sampled-label loss averages over (one
    micro-batch: the Gauss-Newton estimate is its squared gradient times that count)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.965, 0.99), rho: float = 0.04,
                 weight_decay: float = 0.1, update_period: int = 10, tokens_per_batch: int | None = 1):
        if update_period < 1:
            raise ValueError(f"--sophia_update_period {update_period}: must be >= 1")
        # "steps" lives in the groups, so a checkpoint keeps the estimate's schedule.
        super().__init__(params, dict(lr=lr, betas=betas, rho=rho, weight_decay=weight_decay, steps=0))
        self.update_period = update_period
        self.tokens_per_batch = tokens_per_batch

    def hessian_due(self) -> bool:
        """Whether the step just taken is followed by a Hessian estimate: after the first step, then every
        ``update_period`` steps."""
        return (self.param_groups[0]["steps"] - 1) % self.update_period == 0

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["hessian"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # the trainer computes the gradients; no caller passes one
            raise ValueError("SophiaG.step takes no closure: compute the gradients first")
        if self.tokens_per_batch is None:
            raise ValueError("SophiaG.tokens_per_batch is not set: give it the tokens of one micro-batch (batch x "
                             "length), which the sampled-label loss averages over and which scale its Hessian estimate")
        for group in self.param_groups:
            group["steps"] += 1
            beta1 = group["betas"][0]
            scale = group["rho"] * self.tokens_per_batch
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m = state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                ratio = (m.abs() / (state["hessian"] * scale + EPS)).clamp_(max=1.0)
                p.addcmul_(m.sign(), ratio, value=-group["lr"])

    @torch.no_grad()
    def update_hessian(self) -> None:
        """Fold the squared gradients now in ``.grad`` (the loss on sampled labels) into the estimate."""
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                if p.grad is not None:
                    self._state(p)["hessian"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
