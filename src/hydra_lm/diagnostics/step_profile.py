"""Where a training step's device time goes: torch.profiler over a few steps, kernels grouped by kind.

Used by ``hydra-lm bench --profile DIR``: the same (already compiled, warmed-up) step the bench
timed is profiled, so the breakdown explains the timed number without a second compilation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from ..train.checkpoint import write_text_atomic

# (category, name fragments) in priority order: the first category with a matching fragment wins.
_CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn_generated_fort_native_sdpa", "sdpa", "attention", "flex")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "splitk", "matmul", "sm90_", "sm80_", "triton_tem_")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("sort/top-k", ("sort", "topk", "radix", "bitonic")),
    ("gather/scatter", ("gather", "scatter", "index")),
    # triton_per_* / triton_red_*: fused reductions; _ce_rows: the loss kernel (kernels/cross_entropy_rows.py)
    ("reduction", ("reduce", "red_", "per_fused_", "_ce_rows")),
    ("fused pointwise", ("poi_", "triton_")),
    ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat")),
    ("convolution", ("conv",)),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, fragments in _CATEGORIES:
        if any(f in lowered for f in fragments):
            return category
    return "other"


def profile_steps(step: Callable[[], None], steps: int, device: torch.device, out_dir: str | None = None,
                  tag: str = "step", top: int = 15) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the profiler. Returns device time per step (ms), split by
    kernel category and the ``top`` kernels; writes a Chrome trace to ``out_dir`` when given, and on
    CUDA every kernel's time and launches per step as ``kernels_TAG.csv`` (a few hundred KB where the
    trace is tens of MB: small enough to bring back from a lent machine)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        trace = os.path.join(out_dir, f"trace_{tag}.json")
        prof.export_chrome_trace(trace)
    if device.type != "cuda":
        return {"trace": trace, "device_ms_per_step": None, "categories_ms": {}, "top_kernels": []}
    # Device-side events only (the kernels themselves; not the ranges user annotations such as
    # the optimizer's step draw on the GPU timeline), so nothing counts twice.
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    kernels = [(e.name, e.device_time_total) for e in events]
    if out_dir:
        write_kernel_table(os.path.join(out_dir, f"kernels_{tag}.csv"), summarize_kernels(kernels, steps, None))
    idle = device_idle([(e.time_range.start, e.time_range.end, e.name) for e in events], steps)
    return {"trace": trace, **summarize_kernels(kernels, steps, top), **idle}


def device_idle(intervals: list[tuple[float, float, str]], steps: int) -> dict[str, float]:
    """(start us, end us, name) of the device's kernels, copies and memsets over ``steps`` steps -> ms a step the
    device ran none of them between the first start and the last end, and the part of it that directly follows
    a memset (in a captured graph a kernel after a memset node starts microseconds late: the step's libraries,
    cub's sorts, cuDNN's attention and cuBLAS, set a few bytes before many of their kernels)."""
    idle = after_memsets = 0.0
    end, last, memsets = None, "", 0
    for start, stop, name in sorted(intervals):
        memsets += name.startswith("Memset")
        if end is not None and start > end:
            idle += start - end
            after_memsets += (start - end) if last.startswith("Memset") else 0.0
        if end is None or stop >= end:  # overlapping events (several streams) leave no gap
            end, last = stop, name
    return {"idle_ms_per_step": idle / 1e3 / steps, "idle_after_memsets_ms_per_step": after_memsets / 1e3 / steps,
            "memsets_per_step": memsets / steps}


def write_kernel_table(path: str, summary: dict[str, Any]) -> None:
    import csv
    import io

    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(["ms_per_step", "launches_per_step", "category", "kernel"])
    for k in summary["top_kernels"]:
        writer.writerow([f"{k['ms']:.6f}", f"{k['calls']:g}", k["category"], k["name"]])
    write_text_atomic(Path(path), table.getvalue())


def summarize_kernels(kernels: list[tuple[str, float]], steps: int, top: int | None = 15) -> dict[str, Any]:
    """(kernel name, duration in us) of every launch over ``steps`` steps -> ms per step in total, per
    category and for the ``top`` kernels (summed over their launches; None: all of them, full names)."""
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += us / 1e3 / steps
        entry[1] += 1
    categories: dict[str, float] = {}
    for name, (ms, _) in by_name.items():
        categories[kernel_category(name)] = categories.get(kernel_category(name), 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: kv[1][0], reverse=True)[:top]  # [:None]: all
    return {
        "device_ms_per_step": sum(categories.values()),
        "kernels_per_step": len(kernels) / steps,
        "categories_ms": dict(sorted(categories.items(), key=lambda kv: kv[1], reverse=True)),
        "top_kernels": [{"name": n if top is None else n[:160], "ms": ms, "calls": calls / steps,
                         "category": kernel_category(n)} for n, (ms, calls) in ranked],
    }


def format_profile(arch: str, profile: dict[str, Any]) -> str:
    if not profile.get("device_ms_per_step"):
        return f"{arch}: profile trace {profile.get('trace')} (no device kernel times on this device)"
    total = profile["device_ms_per_step"]
    lines = [f"{arch}: kernel time {total:.1f} ms/step over {profile['kernels_per_step']:.0f} kernels/step"
             f" (trace: {profile['trace']})"]
    lines += [f"  {cat:<16}{ms:8.2f} ms {ms / total:6.1%}" for cat, ms in profile["categories_ms"].items()]
    if profile.get("idle_ms_per_step") is not None:
        lines.append(f"  idle between kernels {profile['idle_ms_per_step']:.2f} ms/step, "
                     f"{profile['idle_after_memsets_ms_per_step']:.2f} ms of it after the "
                     f"{profile['memsets_per_step']:.0f} memsets a step")
    lines.append("  top kernels:")
    lines += [f"  {k['ms']:8.2f} ms x{k['calls']:<6.0f} {k['category']:<16}{k['name'][:90]}"
              for k in profile["top_kernels"]]
    return "\n".join(lines)
