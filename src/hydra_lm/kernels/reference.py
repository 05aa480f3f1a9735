"""PyTorch references of every fused op: the definition the kernels are tested against, the path
taken whenever the Triton path is off, and what ``torch.compile`` is benchmarked on.

Each one computes exactly what the model code computes today (``model/layers.py``,
``model/attention.py``, ``model/block.py``), so swapping an op in changes no result beyond rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def qk_norm(x: torch.Tensor, temperature: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to norm sqrt(d) over the last dim; times exp(temperature[h]) for x [..., H, d]."""
    y = F.rms_norm(x, (x.shape[-1],), eps=eps)
    if temperature is None:
        return y
    if x.dim() < 2 or x.shape[-2] != temperature.numel():
        raise ValueError(f"temperature has {temperature.numel()} heads but x {tuple(x.shape)} has "
                         f"{x.shape[-2] if x.dim() >= 2 else 'no'} heads in dim -2")
    return y * temperature.exp().to(y.dtype)[:, None]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, H, N, D]; cos/sin broadcast as [B, 1, N, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, temperature: torch.Tensor | None, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, pos: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """CCGQA's prologue: q [B, N, Hq, d], k [B, N, Hk, d] -> [B, H, N, d] each, normalised, k tempered,
    rotated at positions ``pos`` [B, N] looked up in the tables [L, d/2]."""
    cos = cos_table[pos].unsqueeze(1).to(q.dtype)
    sin = sin_table[pos].unsqueeze(1).to(q.dtype)
    q = qk_norm(q, None, eps)
    k = qk_norm(k, temperature, eps)
    return rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, E], idx [B, k] -> x[b, idx[b, j]] as [B, k, E]."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def scatter_add_gated(x: torch.Tensor, idx: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + scatter of gate[b, j] * delta[b, j] into row idx[b, j] (out of place)."""
    update = delta * gate[..., None].to(delta.dtype)
    return x.scatter_add(1, idx[..., None].expand(-1, -1, x.shape[-1]), update.to(x.dtype))
