"""An expert-choice router's decision on a decoded token in one Triton kernel: the logit, the gate, the decode
state's write and the causal rank rule's admission.

``ExpertChoiceRouter.decide_new`` (its reference) compiles to three kernels on a GPU: the logit reduction with the
gate, the state's index_put (inductor does not fuse a scatter with a later read of the same buffer) and the rank
count over the earlier candidates. A batch-1 decode step takes about ten such decisions between its six units,
each a few 1.5-us kernels with launch gaps between them (benchmarks/BENCHMARKS.md, fortieth session). Here one
program per row does all of it. Whether any row's token entered is left to the reader of the mask (the CUDA
graph IF node's condition kernel, or ``mask.any()``), which a per-row program cannot see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_decode_kernel(x_ptr, w_ptr, b_ptr, scale_ptr, tsum_ptr, tweight_ptr, valid_ptr, pos_ptr, state_ptr,
                         gate_ptr, mask_ptr, L, capacity,
                         E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_L: tl.constexpr, HAS_VALID: tl.constexpr,
                         PRIOR: tl.constexpr, ACC: tl.constexpr, EVERY: tl.constexpr):
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    # The logit r = w . x + b, in ACC (the residual stream's precision, at least fp32), as Router.logits.
    r = tl.zeros((BLOCK_E,), dtype=ACC)
    for e0 in tl.static_range(0, E, BLOCK_E):
        m = e0 + e < E
        r += tl.load(x_ptr + row * E + e0 + e, mask=m, other=0.0).to(ACC) * \
            tl.load(w_ptr + e0 + e, mask=m, other=0.0).to(ACC)
    r = tl.sum(r, axis=0) + tl.load(b_ptr).to(ACC)
    tl.store(gate_ptr + row, (tl.load(scale_ptr).to(ACC) / (1 + tl.exp(-r))).to(gate_ptr.dtype.element_ty))
    if HAS_VALID:
        v = tl.load(valid_ptr + row).to(tl.int1)
    else:
        v = tl.full((), 1, tl.int1)
    pos = tl.load(pos_ptr + row)
    state_row = state_ptr + row * 2 * L
    r_state = r.to(state_ptr.dtype.element_ty)
    if EVERY:  # capacity 1: every candidate enters, whatever the threshold (routing.rank_decision)
        admitted = v
    else:
        # The earlier candidates (slots before the token's own position flagged as one) and those above it.
        count = tl.zeros((BLOCK_L,), dtype=tl.int32)
        above = tl.zeros((BLOCK_L,), dtype=tl.int32)
        for s0 in range(0, pos, BLOCK_L):
            s = s0 + tl.arange(0, BLOCK_L)
            earlier = (s < pos) & (tl.load(state_row + L + s, mask=s < pos, other=0.0) > 0)
            logits = tl.load(state_row + s, mask=earlier, other=0.0)
            count += earlier.to(tl.int32)
            above += (earlier & (logits > r_state)).to(tl.int32)
        count_all = tl.sum(count, axis=0).to(ACC)
        above_all = tl.sum(above, axis=0).to(ACC)
        # routing.rank_decision: the calibrated threshold as PRIOR pseudo-candidates.
        tw = tl.load(tweight_ptr).to(ACC)
        threshold = tl.where(tw > 0, tl.load(tsum_ptr).to(ACC) / tl.maximum(tw, 1e-12), 0.0)
        share_above = tl.where(r <= threshold, (1 + capacity) / 2, capacity / 2)
        admitted = ((above_all + PRIOR * share_above) < capacity * (count_all + PRIOR)) & v
    tl.store(mask_ptr + row, admitted.to(mask_ptr.dtype.element_ty))
    # The token's own slot last: no read above looks at it.
    tl.store(state_row + pos, r_state)
    tl.store(state_row + L + pos, v.to(state_ptr.dtype.element_ty))


@torch.library.custom_op("hydra_lm::route_decode", mutates_args=("state", "gate", "mask"))
def _route_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gate_scale: torch.Tensor,
                  threshold_sum: torch.Tensor, threshold_weight: torch.Tensor, valid: torch.Tensor | None,
                  pos: torch.Tensor, state: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor,
                  capacity: float, prior: float) -> None:
    b, e = x.shape
    acc = tl.float64 if torch.float64 in (x.dtype, state.dtype) else tl.float32
    _route_decode_kernel[(b,)](
        x, weight, bias, gate_scale, threshold_sum, threshold_weight, x if valid is None else valid, pos, state,
        gate, mask, state.shape[2], capacity,
        E=e, BLOCK_E=min(1024, triton.next_power_of_2(e)), BLOCK_L=1024, HAS_VALID=valid is not None,
        PRIOR=prior, ACC=acc, EVERY=capacity >= 1, num_warps=4)


@_route_decode.register_fake
def _(x, weight, bias, gate_scale, threshold_sum, threshold_weight, valid, pos, state, gate, mask, capacity, prior):
    return None


def route_decode(router, x: torch.Tensor, valid: torch.Tensor | None, pos: torch.Tensor, capacity: float,
                 prior: float, state: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor) -> None:
    """``router`` (an ExpertChoiceRouter) on one new token per row, causally: x [B, 1, E], ``valid`` [B, 1]
    (None: every row's token is a candidate), ``pos`` [B, 1], ``prior`` (``routing.RANK_PRIOR``) and the router's
    decode ``state`` [B, 2, L]. Writes the gate into ``gate`` [B, 1], whether each row's token enters into
    ``mask`` [B, 1] (bool), and the token's logit and candidate flag into ``state``: what
    ``decode_step.decide_entries`` writes, by the same rule. ``capacity`` enters the kernel as an fp32 scalar, so
    in fp64 a capacity that fp32 cannot hold exactly may decide an exact tie of the rule otherwise."""
    b = x.shape[0]
    tensors = dict(x=x, state=state, gate=gate, mask=mask)
    strided = [name for name, t in tensors.items() if not t.is_contiguous()]
    if strided:  # the kernel indexes them as laid out contiguously
        raise ValueError(f"route_decode: {', '.join(strided)} not contiguous")
    # A [B, 1] column of a wider tensor reshapes to a strided view; the kernel reads row r at offset r.
    _route_decode(x.reshape(b, -1), router.proj.weight.reshape(-1), router.proj.bias, router.gate_scale,
                  router.threshold_sum, router.threshold_weight,
                  None if valid is None else valid.reshape(b).contiguous(), pos.reshape(b).contiguous(), state, gate,
                  mask, capacity, prior)
