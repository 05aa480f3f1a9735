"""A candidate for the routers' pooled top-k boundary (``routing.topk_boundary``): one Triton program selecting the two
logits around the cut by radix select, against today's full sort of the pooled logits.

``topk_boundary`` sorts all B x N logits of a router to read two of them. On CUDA a sort of the 100M preset's 16,384
pooled logits is cub's radix sort: six kernels and their memsets per router, 0.32 ms a step for the eight largest
routers of the 100M preset on an H200 (benchmarks/BENCHMARKS.md, fifty-second session). Selecting needs less: one
program keeps a 256-bin histogram of one byte of the logits' order-preserving keys per pass (four passes narrow the
key to the wanted rank), then one more pass finds the next lower logit. Measured on an H200 (benchmarks/BENCHMARKS.md,
fifty-third session): faster than the sort alone up to the preset's 16,384 logits, but the same tokens/s end to end
(0.9995x), so not adopted. This script checks it against the sort (on a CPU under TRITON_INTERPRET=1 too) and times
both on a GPU:

    python benchmarks/router_boundary_select.py [--check-only]

and, with ``--bench``, runs ``hydra-lm bench`` in this process with ``routing.topk_boundary`` replaced by the
selection (a ``torch.library.triton_op``, so the compiled block graphs call the kernel):

    python benchmarks/router_boundary_select.py --bench -- --seq_len 1024 --warmup 2 --model_size 100M --arch hydra
"""

import argparse
import os

import torch
import triton
import triton.language as tl

from hydra_lm.model.routing import topk_boundary


@triton.jit
def _boundary_kernel(x_ptr, out_ptr, n, m, BLOCK: tl.constexpr):
    """Midpoint of the ascending order statistics m - 1 and m (0-indexed) of the n float32 values at ``x_ptr``."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.int32)  # the wanted key's bytes found so far, in place
    rank = m  # the wanted rank among the values whose key starts with ``prefix``
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, n, BLOCK):
            i = start + offs
            bits = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.int32, bitcast=True)
            # Order-preserving key: flip all bits of a negative float, only the sign bit of a positive one.
            key = bits ^ ((bits >> 31) | (-2147483648))
            if p == 0:
                match = i < n
            else:
                match = (i < n) & (((key ^ prefix) >> (shift + 8)) == 0)
            hist += tl.histogram((key >> shift) & 255, 256, mask=match)  # masked histograms: Triton 3.4 on
        below = tl.cumsum(hist, 0) - hist  # values with a smaller digit
        digit_of_rank = tl.sum(((below + hist) <= rank).to(tl.int32), 0)
        rank -= tl.sum(tl.where(bins < digit_of_rank, hist, 0), 0)
        prefix = prefix | (digit_of_rank << shift)
    # Back from the key to the float: a key with its top bit set was a positive float.
    bits = tl.where(prefix < 0, prefix ^ (-2147483648), ~prefix)
    upper = bits.to(tl.float32, bitcast=True)
    lower = tl.full((), float("-inf"), tl.float32)
    smaller = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        i = start + offs
        x = tl.load(x_ptr + i, mask=i < n, other=float("inf"))
        below_upper = x < upper
        smaller += tl.sum(below_upper.to(tl.int32), 0)
        lower = tl.maximum(lower, tl.max(tl.where(below_upper, x, float("-inf")), 0))
    # Fewer than m values below it: rank m - 1 holds an equal value.
    lower = tl.where(smaller < m, upper, lower)
    tl.store(out_ptr, 0.5 * (lower + upper))


def selected_boundary(r: torch.Tensor, k: int, block: int = 4096, warps: int = 8) -> torch.Tensor:
    """``topk_boundary(r, k)`` by selection: the midpoint of the pooled (B x k)-th and (B x k + 1)-th highest logits.
    ``block``: logits the program holds per step of a pass (a pass over more loops)."""
    flat = r.reshape(-1).float().contiguous()
    n_sel = r.shape[0] * k
    if n_sel >= flat.shape[0]:
        return flat.amin() - 1.0
    out = torch.empty((), dtype=torch.float32, device=r.device)
    # Descending ranks n_sel - 1 and n_sel are ascending ranks n - n_sel and n - n_sel - 1.
    _boundary_kernel[(1,)](flat, out, flat.shape[0], flat.shape[0] - n_sel, BLOCK=block, num_warps=warps)
    return out.to(r.dtype)


@torch.library.triton_op("hydra_bench::pooled_boundary", mutates_args=())
def pooled_boundary(flat: torch.Tensor, m: int) -> torch.Tensor:
    """The selection as an op that torch.compile traces into its graphs (ascending ranks m - 1 and m of ``flat``)."""
    out = torch.empty((), dtype=torch.float32, device=flat.device)
    torch.library.wrap_triton(_boundary_kernel)[(1,)](flat, out, flat.shape[0], m, BLOCK=4096, num_warps=8)
    return out


def topk_boundary_by_selection(r: torch.Tensor, k: int) -> torch.Tensor:
    """A drop-in for ``routing.topk_boundary``."""
    flat = r.reshape(-1).float().contiguous()
    n_sel = r.shape[0] * k
    if n_sel >= flat.shape[0]:
        return flat.amin() - 1.0
    return pooled_boundary(flat, flat.shape[0] - n_sel).to(r.dtype)


def check(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    cases = [((4, 64), 8, 1.0), ((3, 50), 49, 1.0), ((2, 300), 1, 1.0), ((5, 40), 7, 0.0)]
    for shape, k, spread in cases:
        for dtype in (torch.float32, torch.bfloat16):  # bf16: many ties at the cut
            r = (torch.randn(shape, generator=g) * 3 * spread - 1).to(dtype).to(device)
            if spread == 0.0:
                r = torch.zeros(shape, dtype=dtype, device=device)
                r.view(-1)[::3] = -0.0
            want = topk_boundary(r, k)
            for block in (64, 1024):  # several steps a pass, and one
                got = selected_boundary(r, k, block=block)
                assert torch.equal(want, got), (shape, k, dtype, block, want, got)
            assert torch.equal(want, topk_boundary_by_selection(r, k))
    print("selection == sort on", device)


def microseconds(fn, reps=200) -> float:
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps // 10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--bench", action="store_true", help="run hydra-lm bench with the arguments after --")
    args, bench_args = parser.parse_known_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 (the check only)")
    check(device)
    if args.bench:
        from hydra_lm.cli import main
        from hydra_lm.model import routing

        routing.topk_boundary = topk_boundary_by_selection
        raise SystemExit(main(["bench", *[a for a in bench_args if a != "--"]]))
    if args.check_only or device.type == "cpu":
        raise SystemExit(0)
    settings = [(1024, 4), (4096, 8), (16384, 16)]
    print(f"{'logits':<14}{'k':>6}{'sort us':>10}" + "".join(f"{f'select {b}/{w}w':>18}" for b, w in settings)
          + "  (us a call replayed in a CUDA graph; select: logits a step / warps)")
    for rows, n, k in [(16, 1024, 128), (16, 128, 16), (16, 16, 2), (64, 1024, 128), (16, 4096, 512)]:
        r = torch.randn(rows, n, device=device)
        times = [microseconds(lambda: topk_boundary(r, k))]  # noqa: B023 (timed before the loop moves on)
        times += [microseconds(lambda: selected_boundary(r, k, b, w)) for b, w in settings]  # noqa: B023
        print(f"{f'{rows} x {n}':<14}{k:>6}" + "".join(f"{t:>10.1f}" if i == 0 else f"{t:>18.1f}"
                                                     for i, t in enumerate(times)))
