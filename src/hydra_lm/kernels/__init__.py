"""Fused Triton kernels, each with a PyTorch reference and an autograd Function (forward and backward).

Ops (all differentiable; the reference lives in ``hydra_lm.kernels.reference``):

* ``rms_norm(x, weight, eps)``: RMSNorm over the last dim, any leading shape, fp32 accumulation.
* ``swiglu(gate, up)``: ``silu(gate) * up``.
* ``qk_norm(x, temperature=None, eps)``: CCGQA's L2 norm to sqrt(d), optionally times exp(t[h]).
* ``rope(x, cos, sin)``: rotary embedding of x [B, H, N, D], pairs (i, i + D/2).
* ``qk_norm_rope(q, k, temperature, cos_table, sin_table, pos, eps)``: CCGQA's whole q/k prologue
  (norm, key temperature, RoPE at gathered positions, transpose to [B, H, N, d]) in one launch.
* ``gather_rows(x, idx)`` and ``scatter_add_gated(x, idx, delta, gate)``: a routed unit's gather and
  its gated residual write-back (indices unique per row, as top-k and permutations are).

When the Triton path runs
-------------------------
Off by default: ``use_triton_kernels`` starts False and stays so until a GPU benchmark
(``benchmark_kernels``) shows a kernel beating ``torch.compile``'s own fusion of the reference.
An op takes the Triton path only when all of these hold, and otherwise runs the reference:

1. ``set_use_triton_kernels(True)`` was called (it imports triton, so forwards never do);
2. ``HYDRA_DISABLE_TRITON`` is not set, and triton imports;
3. the op's flag is on: ``HYDRA_ENABLE_FUSED_<NAME>`` (default 1) and not ``HYDRA_DISABLE_FUSED_<NAME>``
   for NAME in ROPE, RMS_NORM, RMS_NORM_BWD, SWIGLU, SWIGLU_BWD, QK_NORM, QK_NORM_BWD, QK_NORM_ROPE,
   ROUTING (the ``_BWD`` flags switch only the backward to the reference); ``set_kernel_enabled``
   changes a flag from code;
4. the tensors are on CUDA, or triton runs in its interpreter (``TRITON_INTERPRET=1`` set before
   triton was first imported), which also accepts CPU tensors: that is how the CPU tests run.

Environment variables are read once, at import and by ``refresh_from_env()``; never in a forward.
``get_kernel_status()`` reports what is available, requested and active, per kernel.
"""

from .benchmark import benchmark_kernels, print_benchmark_results
from .ops import gather_rows, qk_norm, qk_norm_rope, rms_norm, rope, scatter_add_gated, swiglu
from .switches import (KERNELS, get_kernel_status, refresh_from_env, set_kernel_enabled,
                       set_use_triton_kernels)

__all__ = [
    "KERNELS",
    "benchmark_kernels",
    "gather_rows",
    "get_kernel_status",
    "print_benchmark_results",
    "qk_norm",
    "qk_norm_rope",
    "refresh_from_env",
    "rms_norm",
    "rope",
    "scatter_add_gated",
    "set_kernel_enabled",
    "set_use_triton_kernels",
    "swiglu",
]
