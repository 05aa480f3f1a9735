"""Triton kernels for rotary embeddings: plain RoPE, and CCGQA's fused q/k prologue
(L2 norm to sqrt(d) + key temperature + RoPE at gathered positions, one launch for q and k).

Layout follows ``model/layers.py::apply_rotary``: channel i pairs with channel i + D/2. The
backward of a rotation is the rotation by the opposite angle, so forward and backward share code.
Plain RoPE tiles (batch, head, block of tokens), contiguous in the attention layout; the fused
prologue takes one (batch, token) row across all heads, so its cos/sin row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TILE_ELEMENTS, block, compute_type, jit


@jit
def _rope_kernel(X, C, S, Y, N, H, HALF,
                 sxb, sxh, sxn, scb, scn, scd, ssb, ssn, ssd, syb, syh, syn,
                 INVERSE: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    mask = (n < N)[:, None] & (c < HALF)[None, :]
    cos = tl.load(C + b * scb + n[:, None] * scn + c[None, :] * scd, mask=mask, other=0.0).to(ACC)
    sin = tl.load(S + b * ssb + n[:, None] * ssn + c[None, :] * ssd, mask=mask, other=0.0).to(ACC)
    if INVERSE:
        sin = -sin
    src = X + b * sxb + h * sxh + n[:, None] * sxn + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(ACC)
    dst = Y + b * syb + h * syh + n[:, None] * syn + c[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x1 * sin + x2 * cos).to(Y.dtype.element_ty), mask=mask)


def _bhnd_strides(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x [B, H, N, D] by cos/sin (broadcastable to [B, 1, N, D/2]); ``inverse``: by -angle."""
    b, h, n, d = x.shape
    half = d // 2
    if d % 2 or cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"rope: x {tuple(x.shape)} needs an even last dim and cos/sin of last dim {half}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Broadcast dims become stride 0, so a [1, 1, N, D/2] table needs no copy.
    cos = cos.expand(b, 1, n, half)
    sin = sin.expand(b, 1, n, half)
    y = torch.empty((b, h, n, d), dtype=x.dtype, device=x.device)
    if y.numel():
        block_d = block(half)
        block_n = min(block(n), max(1, TILE_ELEMENTS // (2 * block_d)))
        _rope_kernel[(b * h, triton.cdiv(n, block_n))](
            x, cos, sin, y, n, h, half, *_bhnd_strides(x),
            cos.stride(0), cos.stride(2), cos.stride(3), sin.stride(0), sin.stride(2), sin.stride(3),
            *_bhnd_strides(y), INVERSE=inverse, ACC=compute_type(x.dtype), BLOCK_N=block_n, BLOCK_D=block_d)
    return y


@jit
def _load_head_halves(X, b, n, sxb, sxn, sxh, H, HALF, ACC: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """The two rotary halves [BLOCK_H, BLOCK_D] of every head of entry (b, n), in ACC precision."""
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_D)
    h_ok = h < H
    mask = h_ok[:, None] & (c < HALF)[None, :]
    src = X + b * sxb + n * sxn + h[:, None] * sxh + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(ACC)
    return h, c, h_ok, mask, x1, x2


@jit
def _norm_rope_fwd_rows(X, Y, T, b, n, sxb, sxn, sxh, syb, syh, syn, H, HALF, D, eps, cos, sin,
                        HAS_T: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h, c, h_ok, mask, x1, x2 = _load_head_halves(X, b, n, sxb, sxn, sxh, H, HALF, ACC=ACC, BLOCK_H=BLOCK_H,
                                                 BLOCK_D=BLOCK_D)
    # eps may arrive as fp64 (torch.compile passes Python floats so): keep the math in ACC.
    scale = 1.0 / tl.sqrt(((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps).to(ACC))
    if HAS_T:
        scale = scale * tl.exp(tl.load(T + h, mask=h_ok, other=0.0).to(ACC))
    z1 = x1 * scale[:, None]
    z2 = x2 * scale[:, None]
    dst = Y + b * syb + n * syn + h[:, None] * syh + c[None, :]
    tl.store(dst, (z1 * cos - z2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (z1 * sin + z2 * cos).to(Y.dtype.element_ty), mask=mask)


@jit
def _norm_rope_bwd_rows(X, DY, DX, T, DT, b, n, row, sxb, sxn, sxh, sdyb, sdyh, sdyn, sdxb, sdxn, sdxh,
                        H, HALF, D, eps, cos, sin, HAS_T: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h, c, h_ok, mask, x1, x2 = _load_head_halves(X, b, n, sxb, sxn, sxh, H, HALF, ACC=ACC, BLOCK_H=BLOCK_H,
                                                 BLOCK_D=BLOCK_D)
    gsrc = DY + b * sdyb + n * sdyn + h[:, None] * sdyh + c[None, :]
    dy1 = tl.load(gsrc, mask=mask, other=0.0).to(ACC)
    dy2 = tl.load(gsrc + HALF, mask=mask, other=0.0).to(ACC)
    # Undo the rotation: the gradient with respect to the normalised, tempered z.
    g1 = dy1 * cos + dy2 * sin
    g2 = dy2 * cos - dy1 * sin
    rstd = 1.0 / tl.sqrt(((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps).to(ACC))
    xh1 = x1 * rstd[:, None]
    xh2 = x2 * rstd[:, None]
    if HAS_T:
        s = tl.exp(tl.load(T + h, mask=h_ok, other=0.0).to(ACC))
        g1 = g1 * s[:, None]
        g2 = g2 * s[:, None]
    dot = tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)
    if HAS_T:
        # z = s * xhat, so d/dt of the row is sum(dz * z) = dot; the launcher sums the rows.
        tl.store(DT + row * H + h, dot, mask=h_ok)
    dst = DX + b * sdxb + n * sdxn + h[:, None] * sdxh + c[None, :]
    tl.store(dst, (rstd[:, None] * (g1 - xh1 * (dot / D)[:, None])).to(DX.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (rstd[:, None] * (g2 - xh2 * (dot / D)[:, None])).to(DX.dtype.element_ty), mask=mask)


@jit
def _cos_sin_at(CT, ST, P, b, n, spb, spn, sct, scd, sst, ssd, HALF,
                ACC: tl.constexpr, BLOCK_D: tl.constexpr):
    """cos/sin table rows [1, BLOCK_D] at the original position of entry (b, n)."""
    pos = tl.load(P + b * spb + n * spn).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    c_ok = c < HALF
    cos = tl.load(CT + pos * sct + c * scd, mask=c_ok, other=0.0).to(ACC)[None, :]
    sin = tl.load(ST + pos * sst + c * ssd, mask=c_ok, other=0.0).to(ACC)[None, :]
    return cos, sin


@jit
def _norm_rope_fwd_kernel(Q, K, T, QO, KO, CT, ST, P, N, HQ, HK, HALF, D, eps,
                          sqb, sqn, sqh, skb, skn, skh, sob_q, soh_q, son_q, sob_k, soh_k, son_k,
                          sct, scd, sst, ssd, spb, spn,
                          HAS_T: tl.constexpr, ACC: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // N).to(tl.int64)
    n = (pid % N).to(tl.int64)
    cos, sin = _cos_sin_at(CT, ST, P, b, n, spb, spn, sct, scd, sst, ssd, HALF, ACC=ACC, BLOCK_D=BLOCK_D)
    _norm_rope_fwd_rows(Q, QO, T, b, n, sqb, sqn, sqh, sob_q, soh_q, son_q, HQ, HALF, D, eps, cos, sin,
                        HAS_T=False, ACC=ACC, BLOCK_H=BLOCK_HQ, BLOCK_D=BLOCK_D)
    _norm_rope_fwd_rows(K, KO, T, b, n, skb, skn, skh, sob_k, soh_k, son_k, HK, HALF, D, eps, cos, sin,
                        HAS_T=HAS_T, ACC=ACC, BLOCK_H=BLOCK_HK, BLOCK_D=BLOCK_D)


@jit
def _norm_rope_bwd_kernel(Q, K, T, DQO, DKO, DQ, DK, DT, CT, ST, P, N, HQ, HK, HALF, D, eps,
                          sqb, sqn, sqh, skb, skn, skh, sdqob, sdqoh, sdqon, sdkob, sdkoh, sdkon,
                          sdqb, sdqn, sdqh, sdkb, sdkn, sdkh, sct, scd, sst, ssd, spb, spn,
                          HAS_T: tl.constexpr, ACC: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // N).to(tl.int64)
    n = (pid % N).to(tl.int64)
    cos, sin = _cos_sin_at(CT, ST, P, b, n, spb, spn, sct, scd, sst, ssd, HALF, ACC=ACC, BLOCK_D=BLOCK_D)
    _norm_rope_bwd_rows(Q, DQO, DQ, T, DT, b, n, pid, sqb, sqn, sqh, sdqob, sdqoh, sdqon, sdqb, sdqn, sdqh,
                        HQ, HALF, D, eps, cos, sin, HAS_T=False, ACC=ACC, BLOCK_H=BLOCK_HQ, BLOCK_D=BLOCK_D)
    _norm_rope_bwd_rows(K, DKO, DK, T, DT, b, n, pid, skb, skn, skh, sdkob, sdkoh, sdkon, sdkb, sdkn, sdkh,
                        HK, HALF, D, eps, cos, sin, HAS_T=HAS_T, ACC=ACC, BLOCK_H=BLOCK_HK, BLOCK_D=BLOCK_D)


def _check_prologue(q: torch.Tensor, k: torch.Tensor, temperature, cos_table, pos) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, N, H, d] alike")
    if q.shape[-1] % 2 or cos_table.shape[-1] != q.shape[-1] // 2:
        raise ValueError(f"qk_norm_rope: head dim {q.shape[-1]} must be even and twice the table's "
                         f"last dim {tuple(cos_table.shape)}")
    if tuple(pos.shape) != tuple(q.shape[:2]):
        raise ValueError(f"qk_norm_rope: pos {tuple(pos.shape)} must be [B, N] = {tuple(q.shape[:2])}")
    if temperature is not None and temperature.numel() != k.shape[2]:
        raise ValueError(f"qk_norm_rope: temperature has {temperature.numel()} heads, k has {k.shape[2]}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _lead_strides(t: torch.Tensor):
    return t.stride()[:3]


def _lookup_strides(cos_table: torch.Tensor, sin_table: torch.Tensor, pos: torch.Tensor):
    return (*cos_table.stride(), *sin_table.stride(), *pos.stride())


def norm_rope_fwd(q, k, temperature, cos_table, sin_table, pos, eps):
    """q [B, N, Hq, d], k [B, N, Hk, d] -> (q', k') laid out [B, H, N, d] for attention."""
    _check_prologue(q, k, temperature, cos_table, pos)
    q, k = _unit_last(q), _unit_last(k)
    b, n, hq, d = q.shape
    hk = k.shape[2]
    qo = torch.empty((b, hq, n, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((b, hk, n, d), dtype=k.dtype, device=k.device)
    if b * n:
        _norm_rope_fwd_kernel[(b * n,)](
            q, k, q if temperature is None else temperature.contiguous(), qo, ko, cos_table, sin_table, pos,
            n, hq, hk, d // 2, d, eps, *_lead_strides(q), *_lead_strides(k),
            *_lead_strides(qo), *_lead_strides(ko),
            *_lookup_strides(cos_table, sin_table, pos),
            HAS_T=temperature is not None, ACC=compute_type(q.dtype),
            BLOCK_HQ=block(hq), BLOCK_HK=block(hk), BLOCK_D=block(d // 2))
    return qo, ko


def norm_rope_bwd(q, k, temperature, cos_table, sin_table, pos, eps, dqo, dko):
    """(dq, dk, dtemperature or None) for ``norm_rope_fwd``; dq/dk in the [B, N, H, d] input layout."""
    q, k, dqo, dko = _unit_last(q), _unit_last(k), _unit_last(dqo), _unit_last(dko)
    b, n, hq, d = q.shape
    hk = k.shape[2]
    dq = torch.empty((b, n, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, n, hk, d), dtype=k.dtype, device=k.device)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dt_rows = torch.zeros((b * n, hk), dtype=acc, device=q.device) if temperature is not None else dq
    if b * n:
        _norm_rope_bwd_kernel[(b * n,)](
            q, k, q if temperature is None else temperature.contiguous(), dqo, dko, dq, dk, dt_rows,
            cos_table, sin_table, pos, n, hq, hk, d // 2, d, eps,
            *_lead_strides(q), *_lead_strides(k),
            *_lead_strides(dqo), *_lead_strides(dko),
            *_lead_strides(dq), *_lead_strides(dk),
            *_lookup_strides(cos_table, sin_table, pos),
            HAS_T=temperature is not None, ACC=compute_type(q.dtype),
            BLOCK_HQ=block(hq), BLOCK_HK=block(hk), BLOCK_D=block(d // 2))
    dt = dt_rows.sum(0).to(temperature.dtype) if temperature is not None else None
    return dq, dk, dt
