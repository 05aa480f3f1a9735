"""Triton kernels for routed units (ARCHITECTURE.md 4): gather the chosen rows, and write
gate * delta back into the residual stream in one pass.

Indices must be unique within a batch row. Expert-choice top-k and the causal permutation both
guarantee that, and it lets every write be a plain store: no atomics, deterministic results.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .launch import block, compute_type, jit

_BLOCK_E = 1024


@jit
def _copy_rows_kernel(SRC, DST, IDX, K, E, s_src_b, s_src_t, s_dst_b, s_dst_t, s_ib, s_ik,
                      GATHER: tl.constexpr, BLOCK_E: tl.constexpr):
    # GATHER: dst[b, j] = src[b, idx[b, j]]; otherwise dst[b, idx[b, j]] = src[b, j].
    pid = tl.program_id(0)
    b = (pid // K).to(tl.int64)
    j = (pid % K).to(tl.int64)
    t = tl.load(IDX + b * s_ib + j * s_ik).to(tl.int64)
    if GATHER:
        src = SRC + b * s_src_b + t * s_src_t
        dst = DST + b * s_dst_b + j * s_dst_t
    else:
        src = SRC + b * s_src_b + j * s_src_t
        dst = DST + b * s_dst_b + t * s_dst_t
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        mask = cols < E
        tl.store(dst + cols, tl.load(src + cols, mask=mask, other=0.0), mask=mask)


@jit
def _scatter_gated_fwd_kernel(X, OUT, IDX, DELTA, GATE, K, E, s_xb, s_xt, s_ob, s_ot, s_ib, s_ik,
                              s_db, s_dk, s_gb, s_gk, ACC: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // K).to(tl.int64)
    j = (pid % K).to(tl.int64)
    t = tl.load(IDX + b * s_ib + j * s_ik).to(tl.int64)
    g = tl.load(GATE + b * s_gb + j * s_gk).to(ACC)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        mask = cols < E
        x = tl.load(X + b * s_xb + t * s_xt + cols, mask=mask, other=0.0).to(ACC)
        d = tl.load(DELTA + b * s_db + j * s_dk + cols, mask=mask, other=0.0).to(ACC)
        tl.store(OUT + b * s_ob + t * s_ot + cols, (x + g * d).to(OUT.dtype.element_ty), mask=mask)


@jit
def _scatter_gated_bwd_kernel(DOUT, IDX, DELTA, GATE, DDELTA, DGATE, K, E, s_ob, s_ot, s_ib, s_ik,
                              s_db, s_dk, s_gb, s_gk, s_ddb, s_ddk, ACC: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // K).to(tl.int64)
    j = (pid % K).to(tl.int64)
    t = tl.load(IDX + b * s_ib + j * s_ik).to(tl.int64)
    g = tl.load(GATE + b * s_gb + j * s_gk).to(ACC)
    acc = tl.zeros([BLOCK_E], dtype=ACC)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        mask = cols < E
        dout = tl.load(DOUT + b * s_ob + t * s_ot + cols, mask=mask, other=0.0).to(ACC)
        d = tl.load(DELTA + b * s_db + j * s_dk + cols, mask=mask, other=0.0).to(ACC)
        acc += dout * d
        tl.store(DDELTA + b * s_ddb + j * s_ddk + cols, (g * dout).to(DDELTA.dtype.element_ty), mask=mask)
    tl.store(DGATE + pid, tl.sum(acc, axis=0))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def check_routing(x: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor | None = None,
                  gate: torch.Tensor | None = None) -> None:
    if x.dim() != 3 or idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"routing: x must be [B, T, E] and idx [B, k] integer; got {tuple(x.shape)}, "
                         f"{tuple(idx.shape)} {idx.dtype}")
    if rows is not None and tuple(rows.shape) != (idx.shape[0], idx.shape[1], x.shape[2]):
        raise ValueError(f"routing: delta {tuple(rows.shape)} must be [B, k, E] = {(*idx.shape, x.shape[2])}")
    if gate is not None and tuple(gate.shape) != tuple(idx.shape):
        raise ValueError(f"routing: gate {tuple(gate.shape)} must be [B, k] = {tuple(idx.shape)}")


def _block_e(e: int) -> int:
    return min(_BLOCK_E, block(e))


def copy_rows(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, gather: bool) -> torch.Tensor:
    b, k = idx.shape
    if b * k and src.shape[-1]:
        src = _unit_last(src)
        _copy_rows_kernel[(b * k,)](src, dst, idx, k, src.shape[-1], src.stride(0), src.stride(1),
                                    dst.stride(0), dst.stride(1), idx.stride(0), idx.stride(1),
                                    GATHER=gather, BLOCK_E=_block_e(src.shape[-1]))
    return dst


def gather_fwd(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    out = torch.empty((idx.shape[0], idx.shape[1], x.shape[2]), dtype=x.dtype, device=x.device)
    return copy_rows(x, idx, out, gather=True)


def gather_bwd(dy: torch.Tensor, idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    dx = torch.zeros((dy.shape[0], seq_len, dy.shape[2]), dtype=dy.dtype, device=dy.device)
    return copy_rows(dy, idx, dx, gather=False)


def scatter_gated_fwd(x, idx, delta, gate) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    b, k = idx.shape
    if b * k and x.shape[-1]:
        x, delta = _unit_last(x), _unit_last(delta)
        _scatter_gated_fwd_kernel[(b * k,)](
            x, out, idx, delta, gate, k, x.shape[-1], x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            idx.stride(0), idx.stride(1), delta.stride(0), delta.stride(1), gate.stride(0), gate.stride(1),
            ACC=compute_type(out.dtype), BLOCK_E=_block_e(x.shape[-1]))
    return out


def scatter_gated_bwd(dout, idx, delta, gate):
    """(d delta, d gate); d x is ``dout`` itself."""
    dout, delta = _unit_last(dout), _unit_last(delta)
    b, k = idx.shape
    ddelta = torch.empty(delta.shape, dtype=delta.dtype, device=delta.device)
    acc = torch.float64 if dout.dtype == torch.float64 or delta.dtype == torch.float64 else torch.float32
    dgate = torch.zeros((b, k), dtype=acc, device=gate.device)
    if b * k and delta.shape[-1]:
        _scatter_gated_bwd_kernel[(b * k,)](
            dout, idx, delta, gate, ddelta, dgate, k, delta.shape[-1], dout.stride(0), dout.stride(1),
            idx.stride(0), idx.stride(1), delta.stride(0), delta.stride(1), gate.stride(0), gate.stride(1),
            ddelta.stride(0), ddelta.stride(1), ACC=compute_type(acc), BLOCK_E=_block_e(delta.shape[-1]))
    return ddelta, dgate.to(gate.dtype)
