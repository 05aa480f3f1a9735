"""Triton kernels for row normalisation: RMSNorm (learned gain) and CCGQA's QK-norm (optional
per-head temperature exp(t[h])). One kernel pair serves both: they differ only in the scale.

Rows are tiled [BLOCK_M, BLOCK_N] so that short rows (QK-norm heads of 32 to 128) still give each
program a useful amount of work. The backward recomputes 1/rms from x instead of saving it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import block, compute_type, jit, reduction_programs, rows_view, tile_rows


@jit
def _norm_fwd_kernel(X, W, T, Y, M, N, H, stride_x, stride_y, eps,
                     HAS_W: tl.constexpr, HAS_T: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
    # eps may arrive as fp64 (torch.compile passes Python floats so): keep the math in ACC.
    rstd = 1.0 / tl.sqrt((tl.sum(x * x, axis=1) / N + eps).to(ACC))
    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC)
        y = y * w[None, :]
    if HAS_T:
        t = tl.load(T + rows % H, mask=row_ok, other=0.0).to(ACC)
        y = y * tl.exp(t)[:, None]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _norm_bwd_kernel(X, W, T, DY, DX, DW_PART, DT_ROW, M, N, H, stride_x, stride_dy, stride_dx, eps,
                     HAS_W: tl.constexpr, HAS_T: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Each program walks a strided set of row tiles and keeps one partial dW row, so dW needs
    # no atomics: the launcher sums the [programs, N] partials.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC)
    dw = tl.zeros([BLOCK_N], dtype=ACC)
    for start in range(pid * BLOCK_M, M, n_prog * BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = 1.0 / tl.sqrt((tl.sum(x * x, axis=1) / N + eps).to(ACC))
        xhat = x * rstd[:, None]
        g = dy  # gradient with respect to xhat, built up below
        if HAS_W:
            dw += tl.sum(dy * xhat, axis=0)
            g = g * w[None, :]
        if HAS_T:
            scale = tl.exp(tl.load(T + rows % H, mask=row_ok, other=0.0).to(ACC))
            g = g * scale[:, None]
            # d y / d t = y, so each row contributes sum(dy * y); heads are summed by the launcher.
            tl.store(DT_ROW + rows, tl.sum(g * xhat, axis=1), mask=row_ok)
        dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)


def _heads(x: torch.Tensor, temperature: torch.Tensor | None) -> int:
    if temperature is None:
        return 1
    if x.dim() < 2 or x.shape[-2] != temperature.numel():
        raise ValueError(f"temperature has {temperature.numel()} heads but x {tuple(x.shape)} has "
                         f"{x.shape[-2] if x.dim() >= 2 else 'no'} heads in dim -2")
    return temperature.numel()


def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, temperature: torch.Tensor | None,
             eps: float) -> torch.Tensor:
    """y = x / rms(x) over the last dim, times ``weight`` [N] and/or exp(temperature[h])."""
    h = _heads(x, temperature)
    x2 = rows_view(x)
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(x.shape)
    block_n = block(n)
    block_m = tile_rows(block_n)
    _norm_fwd_kernel[(triton.cdiv(m, block_m),)](
        x2, x2 if weight is None else weight.contiguous(), x2 if temperature is None else temperature.contiguous(),
        y, m, n, h, x2.stride(0), y.stride(0), eps,
        HAS_W=weight is not None, HAS_T=temperature is not None, ACC=compute_type(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n)
    return y.reshape(x.shape)


def norm_bwd(x: torch.Tensor, weight: torch.Tensor | None, temperature: torch.Tensor | None,
             dy: torch.Tensor, eps: float):
    """(dx, dweight or None, dtemperature or None) for ``norm_fwd``."""
    h = _heads(x, temperature)
    x2, dy2 = rows_view(x), rows_view(dy)
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    block_n = block(n)
    block_m = tile_rows(block_n)
    programs = reduction_programs(triton.cdiv(m, block_m), x.device)
    dw_part = torch.zeros((programs, n), dtype=acc, device=x.device) if weight is not None else dx
    dt_row = torch.empty((m,), dtype=acc, device=x.device) if temperature is not None else dx
    if m > 0:
        _norm_bwd_kernel[(programs,)](
            x2, dx if weight is None else weight.contiguous(), dx if temperature is None else temperature.contiguous(),
            dy2, dx, dw_part, dt_row, m, n, h, x2.stride(0), dy2.stride(0), dx.stride(0), eps,
            HAS_W=weight is not None, HAS_T=temperature is not None, ACC=compute_type(x.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n)
    dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
    dt = None
    if temperature is not None:
        dt = (dt_row.view(-1, h).sum(0) if m > 0 else torch.zeros(h, dtype=acc, device=x.device)).to(temperature.dtype)
    return dx.reshape(x.shape), dw, dt
