"""Triton kernels for SwiGLU, silu(gate) * up, and its backward in one pass each.

Gate and up are usually the two halves of one projection's output (``chunk`` views), so the
kernels take a row stride per operand instead of asking for contiguous copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import block, compute_type, jit, rows_view

_BLOCK = 1024


@jit
def _swiglu_fwd_kernel(G, U, Y, N, stride_g, stride_u, stride_y, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(ACC)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(G, U, DY, DG, DU, N, stride_g, stride_u, stride_dy, stride_dgu,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(ACC)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(ACC)
    s = 1.0 / (1.0 + tl.exp(-g))
    # silu'(g) = s * (1 + g * (1 - s))
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(DG + row * stride_dgu + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_dgu + cols, du.to(DU.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    g2, u2 = rows_view(gate), rows_view(up)
    m, n = g2.shape
    y = torch.empty((m, n), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if y.numel():
        bl = min(_BLOCK, block(n))
        _swiglu_fwd_kernel[(m, triton.cdiv(n, bl))](g2, u2, y, n, g2.stride(0), u2.stride(0), y.stride(0),
                                                    ACC=compute_type(y.dtype), BLOCK=bl)
    return y.reshape(gate.shape)


def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor):
    """(d gate, d up)."""
    g2, u2, dy2 = rows_view(gate), rows_view(up), rows_view(dy)
    m, n = g2.shape
    dg = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    du = torch.empty((m, n), dtype=up.dtype, device=up.device)
    if dg.numel():
        bl = min(_BLOCK, block(n))
        _swiglu_bwd_kernel[(m, triton.cdiv(n, bl))](g2, u2, dy2, dg, du, n, g2.stride(0), u2.stride(0), dy2.stride(0),
                                                    dg.stride(0), ACC=compute_type(dg.dtype), BLOCK=bl)
    return dg.reshape(gate.shape), du.reshape(up.shape)
