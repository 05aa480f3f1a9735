"""Where a one-token decode step's time goes, per op of ``DecodeStep`` (embedding, each router's decision, each
routed unit, MoE, head): calls a step, kernels a call, kernel time a call, and each kind's largest kernels.

The step runs its ops one by one (no CUDA graph, so each op's kernels can be told apart; the functions are
compiled as ``generate`` compiles them on CUDA), each op under a ``record_function`` whose kernels the
profiler attributes to it. Kernel time excludes the launch gaps that a graph replay still has, so the
kinds' times add up to less than a step takes. On a CPU the "kernels" are the ATen ops that ran (with their
CPU time): the counts show the same structure, not the GPU's costs. A fresh model's routers admit about
half of their candidates (threshold 0); ``--calibrate N`` first runs N training-mode forwards of random
tokens (no optimizer step), which calibrates the thresholds as training does.

    python benchmarks/decode_profile.py --model_size 100M --batch 1 --calibrate 30 [--arch dense]
"""

from __future__ import annotations

import argparse
import collections
from contextlib import nullcontext

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import hydra_lm
from hydra_lm.model.decode_step import DecodeStep, decode_compiles

LABEL = "decode_op:"


def profile_step(model, batch: int, prompt_len: int = 128, steps: int = 10, compiled: bool | None = None,
                 seed: int = 0, top: int = 8) -> dict:
    """Profile ``steps`` one-token steps after a ``prompt_len``-token prefill (and three warm-up steps).
    Returns {"steps", "unit_calls" (units run in the profiled steps, DecodeStep's count), "kinds": {kind:
    {"calls", "kernels", "time_us", "top": [(kernel, calls, total us)] (the ``top`` longest)}}}; the kernel counts
    and times are totals over the profiled steps."""
    device = model.embed.weight.device
    cuda = device.type == "cuda"
    compiled = decode_compiles(device, compiled)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.no_grad(), autocast:
        caches = model.init_cache(batch, prompt_len + steps + 8)
        token = model.forward_cached(prompt, 0, caches).argmax(-1)
        step = DecodeStep(model, caches, batch, device, graphed=False, compiled=compiled)
        for op in step._ops:
            op.run = _labelled(op.run, LABEL + op.kind)
        position = prompt_len
        for _ in range(3):
            token = step(token[:, None], position).argmax(-1)
            position += 1
        before = step.unit_calls
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                token = step(token[:, None], position).argmax(-1)
                position += 1
            if cuda:
                torch.cuda.synchronize()
    return {"steps": steps, "unit_calls": step.unit_calls - before, "kinds": _by_kind(prof.events(), cuda, top)}


def _labelled(run, label: str):
    def labelled():
        with record_function(label):
            return run()
    return labelled


def _by_kind(events, cuda: bool, top: int) -> dict:
    kinds: dict[str, dict] = {}
    for event in events:
        # The labels' CPU events; with CUDA the profiler also lists each label as a GPU-side annotation.
        if not event.name.startswith(LABEL) or event.device_type != DeviceType.CPU:
            continue
        kind = kinds.setdefault(event.name[len(LABEL):], {"calls": 0, "kernels": 0, "time_us": 0.0,
                                                          "top": collections.Counter(), "count": collections.Counter()})
        kind["calls"] += 1
        for name, us in _kernels(event, cuda):
            kind["kernels"] += 1
            kind["time_us"] += us
            kind["top"][name] += us
            kind["count"][name] += 1
    for kind in kinds.values():
        longest, count = kind.pop("top"), kind.pop("count")
        kind["top"] = [(name, count[name], us) for name, us in longest.most_common(top)]
    return kinds


def _kernels(event, cuda: bool):
    """(name, time in us) of what ``event`` ran: its CUDA kernels, or on a CPU its innermost ATen ops."""
    if cuda:
        for kernel in event.kernels:
            yield kernel.name, kernel.duration
        for child in event.cpu_children:
            yield from _kernels(child, cuda)
        return
    for child in event.cpu_children:
        if child.name.startswith("aten::") and not child.cpu_children:
            yield child.name, child.self_cpu_time_total
        else:
            yield from _kernels(child, cuda)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_size", default="100M")
    p.add_argument("--arch", default="hydra", choices=["hydra", "dense"])
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--calibrate", type=int, default=0, help="training-mode forwards first (thresholds as trained)")
    p.add_argument("--top", type=int, default=8, help="kernels listed per op kind (all of a unit's: 30)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                   help="eager functions (default: compiled on CUDA, as generate)")
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = hydra_lm.create_model(args.model_size, arch=args.arch, vocab_size=args.vocab_size,
                                  max_seq_len=1024).to(device)
    if args.calibrate:
        model.train()
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        with torch.no_grad(), autocast:
            for _ in range(args.calibrate):
                model(torch.randint(0, args.vocab_size, (8, 1024), device=device))
    result = profile_step(model, args.batch, steps=args.steps, compiled=args.compile, top=args.top)
    n = result["steps"]
    print(f"{args.arch} {args.model_size}, batch {args.batch}, {device.type}: {result['unit_calls'] / n:.2f} units a "
          f"step; per kind: calls a step, kernels a call, kernel time a call (us)")
    for name, kind in sorted(result["kinds"].items(), key=lambda kv: -kv[1]["time_us"]):
        calls = max(kind["calls"], 1)
        print(f"  {name:6s} {kind['calls'] / n:6.2f} calls  {kind['kernels'] / calls:6.1f} kernels  "
              f"{kind['time_us'] / calls:8.1f} us  ({kind['time_us'] / n:8.1f} us a step)")
        for kernel, count, us in kind["top"]:
            print(f"         {count / calls:5.2f}x {us / count:7.2f} us  {kernel[:90]}")


if __name__ == "__main__":
    main()
