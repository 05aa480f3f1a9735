"""``out[index[i]] += src[i]`` over rows, deterministic and without a host sync: the tied embedding's gradient added
into the head's in place (``model.tied_lookup``).

PyTorch has no op for it that is both fast and deterministic on CUDA. ``index_add_`` adds with float atomics, whose
order varies from run to run (a resumed run then drifts from the uninterrupted one); ``index_put_(accumulate=True)``
sorts and then sums each index's rows one after another, which a frequent token turns into a long serial loop
(1.7 ms for 16,384 rows of width 768 drawn from a Zipf law, against 0.38 ms for the dense embedding gradient plus the
add it replaces; H200, benchmarks/BENCHMARKS.md, fifty-second session). Here the rows are sorted by index, one
program sums each chunk of ``_CHUNK`` sorted rows into one partial sum per index (a masked product with the chunk),
and one program per index adds up that index's partial sums in order (at most a ``_CHUNK``-th of its rows) and adds
the total to its row of ``out``, which no other program writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 32  # sorted rows a program sums; an index's total then adds at most ceil(rows / _CHUNK) + 1 partial sums
_COLS = 128  # columns a program holds


@triton.jit
def _chunk_sums_kernel(sorted_ptr, order_ptr, src_ptr, part_ptr, n, width, src_stride,
                       CHUNK: tl.constexpr, COLS: tl.constexpr):
    """Partial sums: for each run of equal indices inside this chunk of sorted rows, the sum of its source rows,
    written at the run's first sorted position."""
    rows = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    inside = rows < n
    ids = tl.load(sorted_ptr + rows, mask=inside, other=-1)
    prev = tl.load(sorted_ptr + rows - 1, mask=inside & (rows % CHUNK != 0), other=-1)
    first = inside & ((rows % CHUNK == 0) | (ids != prev))
    src_rows = tl.load(order_ptr + rows, mask=inside, other=0).to(tl.int64)
    x = tl.load(src_ptr + src_rows[:, None] * src_stride + cols[None, :],
                mask=inside[:, None] & (cols[None, :] < width), other=0.0).to(tl.float32)
    # Row i of the product sums the chunk's rows of i's index where i starts its run; a run is contiguous (sorted).
    pick = (first[:, None] & (ids[:, None] == ids[None, :])).to(tl.float32)
    sums = tl.dot(pick, x, input_precision="ieee")
    tl.store(part_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], sums,
             mask=first[:, None] & (cols[None, :] < width))


@triton.jit
def _index_totals_kernel(sorted_ptr, part_ptr, out_ptr, n, width, out_stride,
                         CHUNK: tl.constexpr, COLS: tl.constexpr):
    """For the index whose sorted rows start at this program's position: its partial sums (one where its rows start,
    then one at each chunk start they cross), added in order, then to its row of ``out``."""
    pos = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    in_width = cols < width
    idx = tl.load(sorted_ptr + pos)
    prev = tl.load(sorted_ptr + pos - 1, mask=pos > 0, other=-1)
    starts = (pos == 0) | (idx != prev)
    # A block of the scalar: Triton's interpreter rejects a scalar boolean and'ed with a block as a mask.
    live = in_width & ((cols * 0 + starts.to(tl.int32)) != 0)
    acc = tl.load(part_ptr + pos.to(tl.int64) * width + cols, mask=live, other=0.0)
    wanted = tl.where(starts, idx, -2)  # a program that does not start an index's rows loops over nothing
    nxt = (pos // CHUNK + 1) * CHUNK
    following = tl.load(sorted_ptr + nxt, mask=nxt < n, other=-1)
    while following == wanted:
        acc += tl.load(part_ptr + nxt.to(tl.int64) * width + cols, mask=in_width, other=0.0)
        nxt += CHUNK
        following = tl.load(sorted_ptr + nxt, mask=nxt < n, other=-1)
    target = out_ptr + idx.to(tl.int64) * out_stride + cols
    old = tl.load(target, mask=live, other=0.0)
    tl.store(target, (old + acc).to(out_ptr.dtype.element_ty), mask=live)


def sorted_index_add_(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out.index_add_(0, index, src)`` for ``out`` [R, W] (rows contiguous), ``index`` [n] and ``src`` [n, W],
    summed in an order fixed by ``index`` alone: the same bits on every run, in fp32 (``tied_lookup.kernel_applies``
    keeps float64 on ``index_add_``). Indices must lie in [0, R). Finite ``src`` only: the chunks are summed as a 0/1
    mask times the rows, so a non-finite row makes every index of its 32-row chunk NaN (the divergence guard stops
    such a step whichever rows it marks)."""
    if out.dim() != 2 or src.dim() != 2 or index.dim() != 1 or src.shape != (index.shape[0], out.shape[1]):
        raise ValueError(f"sorted_index_add_: out {tuple(out.shape)}, index {tuple(index.shape)}, src "
                         f"{tuple(src.shape)}; need out [R, W], index [n], src [n, W]")
    n, width = src.shape
    if n == 0:
        return out
    if out.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("sorted_index_add_: out and src need contiguous rows")
    keys = index.to(torch.int32) if out.shape[0] < 2**31 else index
    ordered, order = torch.sort(keys, stable=True)
    parts = torch.empty((n, width), dtype=torch.float32, device=src.device)
    col_tiles = triton.cdiv(width, _COLS)
    _chunk_sums_kernel[(triton.cdiv(n, _CHUNK), col_tiles)](ordered, order, src, parts, n, width, src.stride(0),
                                                             CHUNK=_CHUNK, COLS=_COLS)
    _index_totals_kernel[(n, col_tiles)](ordered, parts, out, n, width, out.stride(0), CHUNK=_CHUNK, COLS=_COLS)
    return out
