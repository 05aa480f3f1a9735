"""Decode tokens/s of fresh 100M-preset models, HYDRA (thresholds calibrated) and dense, without the training
bench: for A/Bs of the decode step (``hydra-lm bench --inference`` times training first, and its cold compile).

Each batch size times ``bench.decode_tokens_per_s`` (a seeded prompt of 128 tokens, then 128 one-token steps
as ``generate`` runs them: on CUDA compiled, CUDA-graphed, decisions on the device; median of 3). A fresh
router's threshold admits about half its candidates; ``--calibrate N`` training-mode forwards of random tokens
(no optimizer step) calibrate them as training does, so the units run per step are a trained model's.

    python benchmarks/decode_rates.py --batches 1,8,32 [--model.decode_kernel torch] [--inductor combo_kernels=1]
"""

from __future__ import annotations

import argparse
import json

import torch

import hydra_lm
from hydra_lm.diagnostics.bench import decode_tokens_per_s


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_size", default="100M")
    p.add_argument("--arch", default="hydra,dense", help="comma-separated")
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new_tokens", type=int, default=128, help="prompt length and decode steps timed")
    p.add_argument("--calibrate", type=int, default=30, help="HYDRA: training-mode forwards of 8 x 1024 first")
    p.add_argument("--model.decode_kernel", dest="decode_kernel", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=INT",
                   help="an inductor config option for the decode compile, e.g. combo_kernels=1")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    for option in args.inductor:
        key, value = option.split("=")
        setattr(torch._inductor.config, key, bool(int(value)) if value in ("0", "1") else int(value))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows = []
    for arch in args.arch.split(","):
        torch.manual_seed(0)
        extra = {"decode_kernel": args.decode_kernel} if arch == "hydra" else {}
        model = hydra_lm.create_model(args.model_size, arch=arch, vocab_size=args.vocab_size, max_seq_len=1024,
                                      **extra).to(device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            if arch == "hydra" and args.calibrate:
                model.train()
                for _ in range(args.calibrate):
                    model(torch.randint(0, args.vocab_size, (8, min(1024, model.config.max_seq_len)), device=device))
            model.eval()
            for batch in (int(b) for b in args.batches.split(",")):
                rate, units, _, on_device = decode_tokens_per_s(model, batch, args.new_tokens, device, compiled=cuda)
                rows.append(dict(arch=arch, batch=batch, tokens_per_s=rate, units_per_step=units,
                                 device_decisions=on_device))
                print(f"{arch:6s} batch {batch:4d}: {rate:10,.0f} tokens/s, {units:5.2f} units a step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
