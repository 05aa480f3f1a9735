"""The fused loss's row kernel (kernels/cross_entropy_rows.py) at each column block and warp count, on one chunk of
4,096 rows x 50,304 padded columns of bf16 logits, us a call replayed from a CUDA graph; a bf16 clone of the same
logits (one read, one write) as the bandwidth reference. Needs CUDA.

    python benchmarks/loss_row_kernel_sweep.py
"""

from __future__ import annotations

import torch

from graph_timing import us_per_call  # this folder's helper (the script's folder is on sys.path)

from hydra_lm.kernels import cross_entropy_rows as rows_kernel


def main() -> None:
    dev, rows, width, vocab, padded = "cuda", 4096, 768, 50257, 50304
    h = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
    w = torch.randn(padded, width, device=dev, dtype=torch.bfloat16) * 0.05
    w[vocab:] = 0
    t = torch.randint(0, vocab, (rows,), device=dev)
    logits = h @ w.t()
    scale = torch.tensor(1.0 / rows, device=dev)
    print(f"bf16 clone of the logits: {us_per_call(lambda: logits.clone()):.1f} us")
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16, 32):
            rows_kernel._BLOCK, rows_kernel._WARPS = block, warps
            us = us_per_call(lambda: rows_kernel.cross_entropy_rows(logits, t, scale, vocab, -100, True))
            print(f"{block} columns a block, {warps} warps: {us:.1f} us")


if __name__ == "__main__":
    main()
