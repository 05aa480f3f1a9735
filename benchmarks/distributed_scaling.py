"""Data-parallel scaling: training-step throughput and peak memory per GPU, FSDP2 vs DDP.

Runs the trainer's own wrapping (``hydra_lm.train.distributed``) and step (``hydra_lm.train.step``) on random
tokens, bf16, fused
AdamW, gradient clipping; one step = forward + backward + optimizer step; the median of the timed
steps is reported. Launch with torchrun (one process = one GPU; nproc 1 is the single-GPU baseline):

    torchrun --standalone --nproc_per_node 2 benchmarks/distributed_scaling.py --model_size 1B \\
        --parallel fsdp --batch_size 8
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

import hydra_lm
from hydra_lm.model.accounting import executed_flops_per_token
from hydra_lm.train.compile_policy import SpeedPlan, apply_speed_plan
from hydra_lm.train.distributed import gradient_sync, init_distributed, shutdown, wrap_model
from hydra_lm.train.step import TrainStep


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model_size", default="250M")
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument("--batch_size", type=int, default=16, help="sequences per GPU")
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step (synchronised on the last)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--gradient_checkpointing", action="store_true")
    args = p.parse_args()

    info, device = init_distributed("cuda", args.parallel)
    device = device or torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = hydra_lm.create_model(args.model_size, vocab_size=50257, max_seq_len=args.seq_len).to(device)
    model.gradient_checkpointing = args.gradient_checkpointing
    cfg = model.config
    routed = cfg.arch == "hydra" and (cfg.mod_enabled or cfg.mor_enabled)
    wrapped = wrap_model(model, info, device, find_unused=routed or cfg.moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    # The trainer's step (compiled as `hydra-lm train` does under torchrun; materialised logits).
    plan = SpeedPlan("model" if args.compile else None, cuda_graph=False, ce_impl="naive",
                     ce_chunk_size=4096)
    train_step = TrainStep(model, apply_speed_plan(model, wrapped, plan), opt, device, plan, args.grad_accum)
    gen = torch.Generator(device=device).manual_seed(1 + info.rank)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=device, generator=gen)
    inputs = {"input_ids": ids, "targets": torch.roll(ids, -1, 1)}

    def step() -> None:
        for i in range(args.grad_accum):
            with gradient_sync(wrapped, info, sync=i == args.grad_accum - 1):
                train_step.micro(inputs)
        train_step.update()

    times = []
    for i in range(1 + args.warmup + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(device)
        if i > args.warmup:
            times.append(start.elapsed_time(end) / 1e3)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    if info.enabled:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s = statistics.median(times)
    per_gpu = args.batch_size * args.seq_len * args.grad_accum / step_s
    if info.is_main:
        flops = executed_flops_per_token(cfg, args.seq_len, training=True)
        print(json.dumps({
            "model_size": args.model_size, "params_M": round(model.num_parameters() / 1e6, 1),
            "gpus": info.world_size, "parallel": args.parallel if info.enabled else "single",
            "compile": args.compile, "batch_per_gpu": args.batch_size, "grad_accum": args.grad_accum,
            "seq_len": args.seq_len,
            "step_ms": round(step_s * 1e3, 1), "tokens_per_s_per_gpu": round(per_gpu),
            "tokens_per_s_total": round(per_gpu * info.world_size),
            "tflops_per_gpu": round(flops * per_gpu / 1e12, 1), "peak_mem_GB_max_rank": round(float(peak), 2),
            "gpu": torch.cuda.get_device_name(device)}), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
