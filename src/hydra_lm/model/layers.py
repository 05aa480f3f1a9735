"""Building blocks shared by every model: RMSNorm, SwiGLU MLP, rotary embeddings, init helpers."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module.eval()`` inside the block; after it every submodule's own train/eval flag as it was.
    ``module.train(was)`` would set them all alike, undoing e.g. routers frozen with ``router.eval()``
    (which stops their threshold calibration)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (``torch.nn.functional.rms_norm`` underneath)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with the gate and up projections fused into one matmul."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """One cos/sin table for the whole model; layers look rows up by (possibly gathered) position ids."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding head_dim={head_dim} must be even")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        cos, sin = self._tables(None)
        # Not saved in checkpoints: they are a pure function of the config.
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [max_seq_len, head_dim/2], computed in float64."""
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device),
                             1.0 / self.theta ** steps)
        return angles.cos(), angles.sin()

    def _apply(self, fn, recurse=True):
        # ``.double()`` would widen the float32 table with its rounding (3e-8): a float64 model gets the exact one.
        super()._apply(fn, recurse)
        if self.cos.dtype == torch.float64:
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` [B, N], shaped [B, 1, N, head_dim/2] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of ``x`` [B, H, N, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def init_weights_normal(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) for linear and embedding weights, zeros for linear biases."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def scale_residual_weights(projections: list[nn.Linear], n_residual_layers: int, std: float = 0.02) -> None:
    """Shrink the projections that write into the residual stream by 1/sqrt(2 * layers)."""
    for proj in projections:
        nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * max(1, n_residual_layers)))


class GradientCheckpointMixin:
    """``enable_gradient_checkpointing()`` / ``disable_gradient_checkpointing()`` toggle the
    ``gradient_checkpointing`` attribute that the model's forward consults (training only)."""

    gradient_checkpointing: bool = False

    def enable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = True

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False
