"""Where a training step's GPU time goes: torch.profiler over a few steps, top kernels by time.

Usage: python benchmarks/profile_step.py --config hydra100M_cap0.5 --compiled --out DIR
Writes DIR/trace_<config>.json (Chrome trace) and prints the top kernels and op categories.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import hydra_lm
from step_timing import CONFIGS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="hydra100M_cap0.5", choices=list(CONFIGS))
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default=".")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    spec = dict(CONFIGS[args.config])
    preset = spec.pop("preset")
    torch.manual_seed(0)
    model = hydra_lm.create_model(preset, vocab_size=50257, max_seq_len=args.seq, **spec).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fwd = torch.compile(model, fullgraph=True) if args.compiled else model
    ids = torch.randint(0, 50257, (args.batch, args.seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(ids, targets=torch.roll(ids, -1, 1))["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    tag = f"{args.config}_{'compiled' if args.compiled else 'eager'}"
    prof.export_chrome_trace(os.path.join(args.out, f"trace_{tag}.json"))
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"{tag}: GPU time per step {total / 3 / 1e3:.1f} ms (self time summed over kernels)")
    rows = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[: args.top]
    for e in rows:
        print(f"{e.self_device_time_total / 3 / 1e3:8.2f} ms {100 * e.self_device_time_total / total:5.1f}%  "
              f"x{e.count // 3:<5} {e.key[:110]}")


if __name__ == "__main__":
    main()
