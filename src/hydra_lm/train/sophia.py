"""Sophia with Hutchinson estimates of the Hessian diagonal (pytorch-optimizer's SophiaH), fitted to
the trainer.

The estimate needs gradients that carry their own graph, so every ``update_period`` steps the
trainer runs that step's backward with ``create_graph=True`` (``hessian_due`` tells it when).
"""

from __future__ import annotations

from pytorch_optimizer import SophiaH


class Sophia(SophiaH):
    def hessian_due(self) -> bool:
        """Whether the next ``step`` estimates the Hessian (so this step's backward must create a graph)."""
        return self.param_groups[0].get("step", 0) % self.update_period == 0

    def compute_hutchinson_hessian(self, param_groups, state, num_samples=1, alpha=1.0, distribution="gaussian"):
        # Loading a checkpoint first initialises the state with one zero-gradient step; those
        # gradients have no graph to differentiate, and their Hessian estimate is zero anyway.
        if not any(p.grad is not None and p.grad.requires_grad for g in param_groups for p in g["params"]):
            return
        super().compute_hutchinson_hessian(param_groups, state, num_samples, alpha, distribution)
