"""Cold compile time of one training step (forward + backward), and where it goes.

    python benchmarks/compile_time.py --model_size 100M --scope model     # torch.compile(model) (torchrun's)
    python benchmarks/compile_time.py --model_size 100M --scope units     # compile_policy.compile_units (CUDA default)
    python benchmarks/compile_time.py --scope units --backend aot_eager --cprofile 40   # front end only, profiled
    python benchmarks/compile_time.py --scope units --batch_size 2 --seq_len 1024 --eval   # + first evaluation

Dynamo tracing, AOT autograd and inductor's scheduling do not depend on the device, so a CPU run
shows the front-end cost; code generation differs (C++ on CPU, Triton on CUDA).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch._inductor.metrics
from torch._dynamo.utils import compile_times, counters

import hydra_lm
from hydra_lm.train.compile_policy import compile_units


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model_size", default="100M")
    p.add_argument("--scope", default="model", choices=["model", "units"])
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ce_impl", default="naive", choices=["naive", "chunked", "liger", "auto"])
    p.add_argument("--backend", default="inductor", help="aot_eager: Dynamo + AOT autograd only, no code generation")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="profile the first (compiling) step, forward and backward, with cProfile; print the top N "
                   "functions by cumulative time")
    p.add_argument("--cprofile_file", default=None, metavar="PATH",
                   help="with --cprofile: also save the profile there (pstats format) for a closer look")
    p.add_argument("--steps", type=int, default=1, metavar="N",
                   help="compiled steps timed after the first (compiling) one; their median is printed")
    p.add_argument("--eval", action="store_true",
                   help="then evaluate as the trainer does (no gradients, causal and top-k routing) three times")
    args = p.parse_args()

    torch.manual_seed(0)
    model = hydra_lm.create_model(args.model_size, vocab_size=50257, max_seq_len=args.seq_len)
    model = model.to(args.device).train()
    model.ce_impl = args.ce_impl
    if args.scope == "units":
        step = compile_units(model, backend=args.backend)
    else:
        step = torch.compile(model, fullgraph=True, backend=args.backend)
    ids = torch.randint(0, 50257, (args.batch_size, args.seq_len), device=args.device)
    cuda = ids.device.type == "cuda"
    steady = []
    for call in range(1 + args.steps):
        t0 = time.perf_counter()
        profiler = cProfile.Profile() if args.cprofile and call == 0 else None
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cuda):  # the graph training compiles
            if profiler:
                profiler.enable()
            loss = step(ids, targets=torch.roll(ids, -1, 1))["loss"]
        t1 = time.perf_counter()
        loss.backward()  # compiles the backward graphs on the first call
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
            if args.cprofile_file:
                profiler.dump_stats(args.cprofile_file)
        print(f"call {call}: forward {t1 - t0:.1f} s, backward {t2 - t1:.1f} s", flush=True)
        if call:
            steady.append(t2 - t0)
    if steady:
        print(f"median of the {len(steady)} compiled steps after the first: {statistics.median(steady):.3f} s")
    print(f"unique graphs: {counters['stats']['unique_graphs']}, inductor kernels generated: "
          f"{torch._inductor.metrics.generated_kernel_count}")
    if args.eval:
        model.eval()
        for call in range(3):
            t0 = time.perf_counter()
            with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cuda):
                for mode in ("causal", "topk"):
                    step(ids, targets=torch.roll(ids, -1, 1), routing=mode)
            if cuda:
                torch.cuda.synchronize()
            print(f"evaluation {call} (causal + top-k): {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"unique graphs after evaluation: {counters['stats']['unique_graphs']}")
    print(compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
