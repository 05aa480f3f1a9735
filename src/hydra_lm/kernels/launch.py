"""Launch plumbing shared by the Triton kernel modules: building kernels, tile sizes, row views."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# Elements of one fp32 tile per program: enough work per program without spilling registers.
TILE_ELEMENTS = 4096


def interpreted() -> bool:
    """Whether the imported triton runs kernels in its interpreter.

    Decided by how triton built its own library functions at import time, not by the current
    TRITON_INTERPRET value: our kernels call ``tl.sum`` and must be built the same way.
    """
    return not isinstance(tl.sum, JITFunction)


_INTERPRETED = interpreted()
# Read now rather than per launch: a device query inside a traced forward would break the graph.
_SM_COUNT = {i: torch.cuda.get_device_properties(i).multi_processor_count
             for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else {}


def jit(fn):
    """``triton.jit`` that follows the mode triton was imported in (see ``interpreted``)."""
    return InterpretedFunction(fn) if _INTERPRETED else JITFunction(fn)


def compute_type(dtype: torch.dtype):
    """Accumulation type: float32, or float64 for float64 inputs (gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def block(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """[M, N] view of ``x`` over its last dim, copying only when the last dim is not unit-stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def tile_rows(n_cols_block: int) -> int:
    """Rows per program for a row-wise kernel with ``n_cols_block`` columns per tile."""
    return max(1, min(64, TILE_ELEMENTS // n_cols_block))


def reduction_programs(n_tiles: int, device: torch.device) -> int:
    """Programs for kernels that also reduce across rows (each keeps one partial sum)."""
    if device.type == "cuda" and not _INTERPRETED:
        return max(1, min(n_tiles, 4 * _SM_COUNT.get(device.index or 0, 132)))
    return max(1, min(n_tiles, 4))
