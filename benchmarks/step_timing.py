"""Training-step timing on one GPU for named anchor configs (the timing code is `hydra_lm.bench`'s).

Random tokens, bf16 autocast, fused AdamW, one step = forward + backward + optimizer step. Usage:
    python benchmarks/step_timing.py --configs hydra100M dense113M --batch 16 --seq 1024 --compile both
"""

from __future__ import annotations

import argparse
import json

import torch

import hydra_lm
from hydra_lm.bench import bench_training, measure_peak_tflops

CONFIGS = {
    "hydra100M": dict(preset="100M"),
    "hydra100M_cap0.5": dict(preset="100M", mod_capacity=0.5, mod_every=1),
    "dense113M": dict(preset="100M", arch="dense", n_layers=12, n_heads=12, n_kv_heads=3, mlp_hidden=2048),
}


def time_config(name: str, batch: int, seq: int, compiled: bool, steps: int, warmup: int) -> dict:
    spec = dict(CONFIGS[name])
    preset = spec.pop("preset")
    torch.manual_seed(0)
    model = hydra_lm.create_model(preset, vocab_size=50257, max_seq_len=seq, **spec)
    row = bench_training(model, batch, seq, steps, warmup, compiled, torch.device("cuda"))
    return {"config": name, "compiled": compiled, "params_M": model.num_parameters() / 1e6,
            "tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"], "tflops": row["executed_tflops"],
            "peak_mem_GB": row["peak_memory_gb"], "first_step_s": row["first_step_s"]}


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
    peak = measure_peak_tflops(torch.device("cuda"))
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
