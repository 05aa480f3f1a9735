"""Whole ``generate`` calls as a user times them, against the steady decode rate (CUDA only).

    python benchmarks/generate_calls.py [--batches 1,32] [--prompt 128] [--new 128] [--calls 4]

For HYDRA and the dense baseline (100M, vocabulary 50,257, bf16 autocast, random weights, greedy): the wall time of
``--calls`` consecutive ``generate`` calls on one random prompt (the first compiles), and of calls with 1 and 3 new
tokens (prefill alone; prefill plus the eager first step and the capture), the median of the calls after the first
(128 new tokens) or after the first two (1 and 3: a new session's first prefill is launched, its second captured).
``--no-compile_step``: ``generate(compile_step=False)``, eager kernels captured. ``steady`` is the decode rate of
``bench --inference`` for the same batch and lengths: what a call's new tokens would cost without a call's fixed
work. ``overhead`` = a call's median wall minus its new tokens at the
steady rate: the prefill, the step's construction, its eager first step and its CUDA graph capture.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hydra_lm
from hydra_lm.diagnostics.bench import decode_tokens_per_s


def _wall(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--archs", default="hydra,dense")
    ap.add_argument("--no-compile_step", dest="compile_step", action="store_false",
                    help="generate(compile_step=False): the step and the prefill replay eager kernels")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = hydra_lm.create_model("100M", vocab_size=50257, max_seq_len=1024, arch=arch).to(dev).eval()
        for b in (int(x) for x in args.batches.split(",")):
            ids = torch.randint(0, 50257, (b, args.prompt), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                def call(n: int, ids=ids, model=model) -> None:
                    model.generate(ids, n, compile_step=args.compile_step)

                walls = [_wall(lambda: call(args.new)) for _ in range(args.calls)]
                # Each length is a session's first (launched), second (captured) and later (replayed) prefills
                # when its cache length differs (without a compiled step a session's cache is the call's length).
                one = statistics.median([_wall(lambda: call(1)) for _ in range(4)][2:])
                three = statistics.median([_wall(lambda: call(3)) for _ in range(4)][2:])
                steady, *_ = decode_tokens_per_s(model, b, args.prompt, dev, compiled=args.compile_step,
                                                 prompt=ids if args.new == args.prompt else None)
            warm = statistics.median(walls[1:])
            overhead = warm - b * (args.new - 1) / steady
            rows.append((arch, b, walls[0], warm, one, three, steady, overhead, b * args.new / warm))
            print(f"{arch} b{b}: calls {[round(w * 1e3, 1) for w in walls]} ms", flush=True)
    print(f"\nprompt {args.prompt}, new tokens {args.new}; ms unless marked")
    print("| arch | batch | first call (s) | later calls | 1 new token | 3 new tokens | steady decode tok/s | "
          "overhead a call | end-to-end new tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch, b, first, warm, one, three, steady, overhead, e2e in rows:
        print(f"| {arch} | {b} | {first:.1f} | {warm * 1e3:.1f} | {one * 1e3:.1f} | {three * 1e3:.1f} | "
              f"{steady:,.0f} | {overhead * 1e3:.1f} | {e2e:,.0f} |")


if __name__ == "__main__":
    main()
