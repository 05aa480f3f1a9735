"""Muon for hidden matrices, with a step that replays inside the trainer's CUDA graph.

The update is ``torch.optim.Muon``'s (Nesterov momentum 0.95, five quintic Newton-Schulz iterations in
bf16 with its coefficients, decoupled weight decay, the AdamW-matching LR scale 0.2 * sqrt(max(A, B)))
and its state is the same (``momentum_buffer`` per matrix), so checkpoints of either load in the other.
Written here because torch's step cannot be captured: it applies the learning rate as a Python scalar
(``add_(update, alpha=-lr)``), so a replayed graph would keep the LR of its capture, and it
orthogonalises one matrix at a time (a few dozen small kernels each). Here the LR may be a device tensor
(``optim.make_capturable``), and the matrices of one shape are orthogonalised together, as one batch. On
one H100 the optimizer step (with the AdamW part) on the 100M preset's weights takes 4.7 ms, torch's
18.3 ms (benchmarks/BENCHMARKS.md, twelfth session).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
NS_STEPS = 5
EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS,
                  eps: float = EPS) -> torch.Tensor:
    """The Newton-Schulz approximation of ``U V^T`` for each matrix of ``g`` [G, A, B] (``U S V^T`` its
    SVD), in bf16: singular values land near 1 (roughly 0.7-1.2), not exactly on it."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = _baddbmm(x, _baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _baddbmm(input, batch1, batch2, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """``torch.baddbmm`` of bf16 tensors. On the CPU it runs in fp32 and is rounded back to bf16: the same
    values (bf16 operands, fp32 sums, one rounding), where a CPU without bf16 matrix units runs the bf16 op
    about 20x slower (1.6 s a call for the bench test's tiny model on a 2-core AMD EPYC)."""
    if input.is_cuda:
        return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
    return torch.baddbmm(input.float(), batch1.float(), batch2.float(), beta=beta, alpha=alpha).bfloat16()


class Muon(torch.optim.Optimizer):
    """Muon on 2-D parameters: ``p <- p * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * orth(nesterov(m))``.
    ``lr`` may be a float or a 0-d tensor on the parameters' device (a CUDA graph then reads its value at
    every replay)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = NS_STEPS, ns_coefficients=NS_COEFFICIENTS, eps: float = EPS):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got one of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # the trainer computes the gradients; no caller passes one
            raise ValueError("Muon.step takes no closure: compute the gradients first")
        for group in self.param_groups:
            mu, lr = group["momentum"], group["lr"]
            decay = 1 - lr * group["weight_decay"]
            by_shape: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[tuple(p.shape)].append(p)
            # One shape at a time: the step's temporaries hold one shape's matrices, not all of them.
            for shape, params in by_shape.items():
                grads = [p.grad for p in params]
                bufs = [self._momentum(p) for p in params]
                torch._foreach_lerp_(bufs, grads, 1 - mu)
                update = torch.stack(torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs)
                ortho = orthogonalize(update, group["ns_steps"], group["ns_coefficients"], group["eps"])
                del update
                torch._foreach_mul_(params, decay)
                # fp32 before the scale, as torch's add_(alpha=...) computes it
                step = ortho.float().mul_(-lr * 0.2 * math.sqrt(max(shape)))
                torch._foreach_add_(params, list(step.unbind(0)))

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]
