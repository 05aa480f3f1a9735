"""The public fused ops: each picks the Triton path or the PyTorch reference (``switches``), and
wraps the Triton launchers in an autograd Function so that every kernel has its backward.

A backward whose own flag is off (``rms_norm_bwd``, ``swiglu_bwd``, ``qk_norm_bwd``) differentiates
the reference instead; the choice is made in the forward so that the pair stays consistent.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from . import reference, switches
from .switches import kernel_enabled, use_kernel

# Widest row normalised as one register tile; wider rows would spill, so they take the reference.
MAX_ROW = 16384


def _vjp(fn, inputs, grad, *args):
    """Gradients of ``fn(*inputs, *args)`` for each floating input (None elsewhere)."""
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves, *args)
        wrt = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wrt, grad))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in leaves)


def _needed(ctx, *grads):
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


class _Norm(Function):
    """RMSNorm (``weight``) and CCGQA's QK-norm (``temperature``) share one kernel pair."""

    @staticmethod
    def forward(ctx, x, weight, temperature, eps, fused_bwd):
        ctx.save_for_backward(x, weight, temperature)
        ctx.eps, ctx.fused_bwd = eps, fused_bwd
        return switches.TK.norms.norm_fwd(x, weight, temperature, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, temperature = ctx.saved_tensors
        if ctx.fused_bwd:
            dx, dw, dt = switches.TK.norms.norm_bwd(x, weight, temperature, dy, ctx.eps)
        elif weight is not None:
            (dx, dw), dt = _vjp(reference.rms_norm, (x, weight), dy, ctx.eps), None
        else:
            (dx, dt), dw = _vjp(reference.qk_norm, (x, temperature), dy, ctx.eps), None
        return *_needed(ctx, dx, dw, dt), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (``F.rms_norm(x, (N,), weight, eps)``); any leading shape."""
    if use_kernel("rms_norm", x, weight) and x.shape[-1] <= MAX_ROW:
        return _Norm.apply(x, weight, None, eps, kernel_enabled("rms_norm_bwd"))
    return reference.rms_norm(x, weight, eps)


class _SwiGLU(Function):
    @staticmethod
    def forward(ctx, gate, up, fused_bwd):
        ctx.save_for_backward(gate, up)
        ctx.fused_bwd = fused_bwd
        return switches.TK.swiglu.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        if ctx.fused_bwd:
            dg, du = switches.TK.swiglu.swiglu_bwd(gate, up, dy)
        else:
            dg, du = _vjp(reference.swiglu, (gate, up), dy)
        return *_needed(ctx, dg, du), None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; ``gate``/``up`` may be the two ``chunk`` halves of one projection."""
    if use_kernel("swiglu", gate, up) and gate.shape == up.shape:
        if up is gate:
            # torch.compile (2.11) keeps only one of the two gradients when the same tensor enters
            # an autograd Function twice; a view is a distinct input and gets both.
            up = up.view_as(up)
        return _SwiGLU.apply(gate, up, kernel_enabled("swiglu_bwd"))
    return reference.swiglu(gate, up)


def qk_norm(x: torch.Tensor, temperature: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise the last dim to norm sqrt(d); with ``temperature`` [H] and x [..., H, d],
    also scale head h by exp(temperature[h]) (CCGQA's learnable key temperature)."""
    if use_kernel("qk_norm", x, temperature) and x.shape[-1] <= MAX_ROW:
        return _Norm.apply(x, None, temperature, eps, kernel_enabled("qk_norm_bwd"))
    return reference.qk_norm(x, temperature, eps)


class _Rope(Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return switches.TK.rope.rope_apply(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return switches.TK.rope.rope_apply(dy, cos, sin, inverse=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, H, N, D] (pairs (i, i + D/2)); cos/sin [B or 1, 1, N, D/2].

    cos/sin get no gradient on the Triton path (they are tables); if they require one, the
    reference runs instead.
    """
    if (use_kernel("rope", x, cos, sin) and x.dim() == 4 and cos.dim() == 4 and sin.dim() == 4
            and not (cos.requires_grad or sin.requires_grad)):
        return _Rope.apply(x, cos, sin)
    return reference.rope(x, cos, sin)


class _QKNormRope(Function):
    @staticmethod
    def forward(ctx, q, k, temperature, cos_table, sin_table, pos, eps):
        ctx.save_for_backward(q, k, temperature, cos_table, sin_table, pos)
        ctx.eps = eps
        return switches.TK.rope.norm_rope_fwd(q, k, temperature, cos_table, sin_table, pos, eps)

    @staticmethod
    def backward(ctx, dqo, dko):
        q, k, temperature, cos_table, sin_table, pos = ctx.saved_tensors
        dq, dk, dt = switches.TK.rope.norm_rope_bwd(q, k, temperature, cos_table, sin_table, pos, ctx.eps,
                                                     dqo, dko)
        return *_needed(ctx, dq, dk, dt), None, None, None, None


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, temperature: torch.Tensor | None, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, pos: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """CCGQA's fused prologue for q [B, N, Hq, d] and k [B, N, Hk, d]: ``qk_norm`` (k tempered by
    ``temperature`` [Hk]) then RoPE at positions ``pos`` [B, N] read from ``cos_table``/``sin_table``
    [L, d/2] (``RotaryEmbedding.cos``/``.sin``). Returns q, k laid out [B, H, N, d] for attention.
    """
    if (use_kernel("qk_norm_rope", q, k, temperature, cos_table, sin_table)
            and not (cos_table.requires_grad or sin_table.requires_grad)):
        if q.dtype != k.dtype:
            raise ValueError(f"qk_norm_rope: q {q.dtype} and k {k.dtype} must share a dtype")
        return _QKNormRope.apply(q, k, temperature, cos_table, sin_table, pos, eps)
    return reference.qk_norm_rope(q, k, temperature, cos_table, sin_table, pos, eps)


class _GatherRows(Function):
    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.seq_len = x.shape[1]
        return switches.TK.routing.gather_fwd(x, idx)

    @staticmethod
    def backward(ctx, dy):
        (idx,) = ctx.saved_tensors
        return switches.TK.routing.gather_bwd(dy, idx, ctx.seq_len), None


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, E], idx [B, k] (unique per row on the Triton path) -> [B, k, E]."""
    if use_kernel("routing", x):
        switches.TK.routing.check_routing(x, idx)
        return _GatherRows.apply(x, idx)
    return reference.gather_rows(x, idx)


class _ScatterAddGated(Function):
    @staticmethod
    def forward(ctx, x, idx, delta, gate):
        ctx.save_for_backward(idx, delta, gate)
        return switches.TK.routing.scatter_gated_fwd(x, idx, delta, gate)

    @staticmethod
    def backward(ctx, dout):
        idx, delta, gate = ctx.saved_tensors
        ddelta, dgate = switches.TK.routing.scatter_gated_bwd(dout, idx, delta, gate)
        return *_needed(ctx, dout, None, ddelta, dgate),


def scatter_add_gated(x: torch.Tensor, idx: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + scatter(gate * delta) into rows idx, out of place: the routed unit's residual write.

    x [B, T, E], idx [B, k] (unique per row on the Triton path), delta [B, k, E], gate [B, k].
    """
    if use_kernel("routing", x, delta, gate):
        switches.TK.routing.check_routing(x, idx, delta, gate)
        return _ScatterAddGated.apply(x, idx, delta, gate)
    return reference.scatter_add_gated(x, idx, delta, gate)
