"""Training-step timing on one GPU: tokens/s, executed-FLOP MFU, peak memory, compile time.

A first measurement ahead of the `hydra-lm bench` command. Random tokens, bf16 autocast, fused
AdamW, one step = forward + backward + optimizer step. Usage:
    python benchmarks/step_timing.py --configs hydra100M dense113M --batch 16 --seq 1024 --compile both
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hydra_lm
from hydra_lm.model.accounting import executed_flops_per_token

CONFIGS = {
    "hydra100M": dict(preset="100M"),
    "hydra100M_cap0.5": dict(preset="100M", mod_capacity=0.5, mod_every=1),
    "dense113M": dict(preset="100M", arch="dense", n_layers=12, n_heads=12, n_kv_heads=3, mlp_hidden=2048),
}


def measure_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12


def time_config(name: str, batch: int, seq: int, compiled: bool, steps: int, warmup: int) -> dict:
    spec = dict(CONFIGS[name])
    preset = spec.pop("preset")
    torch.manual_seed(0)
    model = hydra_lm.create_model(preset, vocab_size=50257, max_seq_len=seq, **spec).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    ids = torch.randint(0, 50257, (batch, seq), device="cuda")
    targets = torch.roll(ids, -1, 1)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(ids, targets=targets)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    med = statistics.median(times)
    flops = executed_flops_per_token(model.config, seq) * batch * seq
    return {"config": name, "compiled": compiled, "params_M": model.num_parameters() / 1e6,
            "tokens_per_s": batch * seq / med, "step_ms": med * 1e3, "tflops": flops / med / 1e12,
            "peak_mem_GB": torch.cuda.max_memory_allocated() / 1e9, "first_step_s": first}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--compile", choices=["eager", "compiled", "both"], default="both")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = measure_peak_tflops()
    modes = {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, measured bf16 peak {peak:.0f} TFLOP/s, "
          f"batch {args.batch} x {args.seq}")
    header = f"{'config':<18}{'mode':<10}{'params':>8}{'tok/s':>11}{'ms/step':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak GB':>9}{'1st step s':>11}"
    print(header, flush=True)
    rows = []
    for name in args.configs:
        for compiled in modes:
            r = time_config(name, args.batch, args.seq, compiled, args.steps, args.warmup)
            r["mfu"] = r["tflops"] / peak
            rows.append(r)
            # Each row as soon as it is measured: a run cut short still reports what it finished.
            print(f"{r['config']:<18}{'compiled' if r['compiled'] else 'eager':<10}{r['params_M']:>7.1f}M"
                  f"{r['tokens_per_s']:>11,.0f}{r['step_ms']:>9.1f}{r['tflops']:>9.1f}{r['mfu']:>7.1%}"
                  f"{r['peak_mem_GB']:>9.1f}{r['first_step_s']:>11.1f}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"peak_tflops": peak, "rows": rows}, f, indent=1)
            torch._dynamo.reset()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
