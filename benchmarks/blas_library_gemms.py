"""The GEMMs of a training step under cuBLAS and cuBLASLt (``torch.backends.cuda.preferred_blas_library``).

Inductor leaves a compiled step's matrix products to ATen, which calls cuBLAS unless told to prefer cuBLASLt,
whose heuristics pick other kernels. This times every Linear layer of the preset's units at the preset's token
counts (the MoR depths' and the MoD blocks'), forward, input gradient and weight gradient, under each library,
each from a CUDA graph of ``--calls`` calls (as the trainer's whole-step graph replays them: no launch overhead),
and prints a step-weighted total (each shape counted as often as the step runs it). How fast ATen's GEMMs already
are in the step also bounds what inductor's GEMM autotuning could gain (benchmarks/BENCHMARKS.md, seventy-seventh
session).

    python benchmarks/blas_library_gemms.py --model_size 100M --batch_size 16 --seq_len 1024
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F

from graph_timing import us_per_call  # this folder's helper (the script's folder is on sys.path)
from hydra_lm.config import preset_config
from hydra_lm.model.hydra import HydraModel


def step_gemms(model: HydraModel, batch_size: int, seq_len: int) -> Counter:
    """(tokens, in, out) -> how many times a training step runs that Linear, from each block's token counts."""
    counts: Counter = Counter()
    for block in model.blocks:
        linears = [m for m in block.layers.modules() if isinstance(m, torch.nn.Linear)]
        for tokens in block.tokens_per_depth(seq_len):
            for lin in linears:
                counts[(batch_size * tokens, lin.in_features, lin.out_features)] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_size", default="100M")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("blas_library_gemms.py times cuBLAS kernels: it needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = HydraModel(preset_config(args.model_size))
    counts = step_gemms(model, args.batch_size, args.seq_len)
    libraries = ("cublas", "cublaslt")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 | us per call, CUDA graph of "
          f"{args.calls} calls")
    print(f"{'M x in -> out':<22}{'runs':>5}" + "".join(f"{lib + ' ' + part:>16}" for part in ("fwd", "dgrad", "wgrad")
                                                   for lib in libraries))
    totals = dict.fromkeys(libraries, 0.0)
    for (m, k, n), runs in sorted(counts.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        parts = {"fwd": lambda x=x, w=w: F.linear(x, w), "dgrad": lambda g=g, w=w: g @ w,
                 "wgrad": lambda g=g, x=x: g.t() @ x}
        row = {}
        for part, fn in parts.items():
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                row[(lib, part)] = us_per_call(fn, calls=args.calls)
                totals[lib] += runs * row[(lib, part)]
        print(f"{f'{m} x {k} -> {n}':<22}{runs:>5}"
              + "".join(f"{row[(lib, part)]:>16.1f}" for part in parts for lib in libraries))
    torch.backends.cuda.preferred_blas_library("cublas")
    print("step-weighted GEMM time (the units' Linear layers, forward + both gradients), ms: "
          + ", ".join(f"{lib} {t / 1000:.3f}" for lib, t in totals.items())
          + f"; cublaslt / cublas {totals['cublaslt'] / totals['cublas']:.3f}")


if __name__ == "__main__":
    main()
