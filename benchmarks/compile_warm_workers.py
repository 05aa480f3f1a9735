"""Can the cold first step's compile run in parallel? A prototype: one worker process per block layout of the 100M
preset (block 0: no MoD router; block 1: routed at depth 0) compiles that block's training graph, forward and
backward, into a fresh shared inductor cache; then the training step runs in a process of its own on the warm
cache. ``base`` runs the step alone on a fresh cache. Both print the first step and the total wall time.

    python benchmarks/compile_warm_workers.py base
    python benchmarks/compile_warm_workers.py warm [--device cuda]

On the GPU host (16 cores, H200) the split did not pay: the workers compiled in 45-46 s each against the step's
83 s alone, but each process's start (about 16 s) and the step on the warm cache (25.6 s) made 101.0 s in all
against 97.8 s (benchmarks/BENCHMARKS.md, forty-first session).

The workers must trace what the step traces (the same config, shapes, dtypes and inductor options), or their
cache entries are not the step's: here no document masks and, on CUDA, bf16 autocast, as ``compile_time.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

import hydra_lm
from hydra_lm.train.compile_policy import compile_units


def _model(device: str, seq_len: int):
    torch.manual_seed(0)
    model = hydra_lm.create_model("100M", vocab_size=50257, max_seq_len=seq_len).to(device).train()
    model.ce_impl = "chunked"
    return compile_units(model)


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def worker(block_index: int, device: str, batch: int, seq_len: int) -> None:
    model = _model(device, seq_len)
    x = torch.randn(batch, seq_len, model.config.dim, device=device, requires_grad=True)
    pos = torch.arange(seq_len, device=device).repeat(batch, 1)  # as HydraModel.forward builds it
    start = time.perf_counter()
    with _autocast(device):
        out, losses, _ = model.blocks[block_index](x, pos, model.rope, "topk", None, None)
        loss = out.float().square().mean() + sum(loss for kind in losses.values() for loss in kind)
    loss.backward()
    _sync(device)
    print(f"worker, block {block_index}: {time.perf_counter() - start:.1f} s", flush=True)


def step(device: str, batch: int, seq_len: int) -> None:
    model = _model(device, seq_len)
    ids = torch.randint(0, 50257, (batch, seq_len), device=device)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with _autocast(device):
            loss = model(ids, targets=torch.roll(ids, -1, 1))["loss"]
        loss.backward()
        _sync(device)
        times.append(time.perf_counter() - start)
    print(f"step: first {times[0]:.1f} s, second {times[1]:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["base", "warm", "worker", "step"])
    p.add_argument("block", nargs="?", type=int, default=0, help="worker: the block whose layout it compiles")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=1024)
    args = p.parse_args()
    shape = ["--device", args.device, "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len)]
    if args.mode == "worker":
        return worker(args.block, args.device, args.batch_size, args.seq_len)
    if args.mode == "step":
        return step(args.device, args.batch_size, args.seq_len)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
    start = time.perf_counter()
    if args.mode == "warm":
        workers = [subprocess.Popen([sys.executable, __file__, "worker", str(i), *shape], env=env) for i in (0, 1)]
        for w in workers:
            w.wait()
        print(f"workers done at {time.perf_counter() - start:.1f} s", flush=True)
    subprocess.run([sys.executable, __file__, "step", *shape], env=env, check=True)
    print(f"total ({args.mode}): {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
