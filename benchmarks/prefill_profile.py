"""Where generate's prefill goes (CUDA): wall time against GPU kernel time, kernels, aten calls and
host syncs per call, for HYDRA and the dense baseline at two prompt shapes.

    python benchmarks/prefill_profile.py [--model_size 100M --vocab_size 50257] [--units eager compiled]

``--units``: the prefill eager, or compiled as ``generate`` runs it when it compiles its step
(``forward_cached(compiled=True)``: one graph with dynamic shapes per block layout; the first call compiles,
and its time is printed as "first call").
"""

from __future__ import annotations

import argparse
import time

import torch

import hydra_lm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_size", default="100M")
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--table", action="store_true", help="print HYDRA's host-time table at 8 x 1024")
    p.add_argument("--units", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                   help="the prefill eager or compiled (forward_cached's compiled), each timed in turn")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    runs = [(arch, units) for units in args.units for arch in ("hydra", "dense")]
    for arch, units in runs:
        torch.manual_seed(0)
        model = hydra_lm.create_model(args.model_size, vocab_size=args.vocab_size, max_seq_len=1024, arch=arch)
        model = model.to(dev).eval()
        arch = f"{arch}, {units}"
        for b, t in ((1, 128), (8, 1024)):
            ids = torch.randint(0, args.vocab_size, (b, t), device=dev)

            def prefill(model=model, ids=ids, b=b, compiled=units == "compiled"):
                model.forward_cached(ids, 0, model.init_cache(b, 1024), compiled=compiled)

            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                prefill()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                for _ in range(2):
                    prefill()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    prefill()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / 5
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    prefill()
                    torch.cuda.synchronize()
            ev = prof.key_averages()
            cuda = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
            syncs = sum(e.count for e in ev if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaMemcpyAsync"))
            print(f"{arch} {b} x {t}: first call {first:.1f} s, wall {wall * 1e3:.1f} ms "
                  f"({b * t / wall:,.0f} tokens/s), GPU kernels "
                  f"{sum(e.self_device_time_total for e in cuda) / 1e3:.1f} ms over {sum(e.count for e in cuda)} "
                  f"kernels, {sum(e.count for e in ev if e.key.startswith('aten::'))} aten calls, {syncs} "
                  "sync/memcpy calls", flush=True)
            if args.table and arch.startswith("hydra") and b == 8:
                print(ev.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
