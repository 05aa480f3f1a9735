"""Forward+backward timing of every fused op: PyTorch reference, ``torch.compile`` of the reference,
and the Triton kernel (on CUDA: device time of a CUDA-graph replay, see ``_time_ms``). A kernel
earns its place (``set_use_triton_kernels(True)``) only by beating the compiled reference on the
GPU it will train on.

On CPU the Triton column times the interpreter (labelled so): it checks that the path runs, it
says nothing about speed.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from . import ops, reference, switches


def _cases(b: int, t: int, e: int, head_dim: int, device, dtype, gen: torch.Generator):
    """name -> (reference fn, Triton fn bypassing the switches, inputs; float inputs get gradients)."""

    def rand(*shape, grad=True, as_dtype=None):
        # Leaves only: a tensor derived outside the step (e.g. by .float()) would have its backward
        # run on the stream that created it, which a CUDA-graph capture cannot record.
        x = torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=as_dtype or dtype)
        return x.requires_grad_(grad)

    heads = max(1, e // head_dim)
    kv_heads = max(1, heads // 4)
    hidden = 64 * ((8 * e // 3 + 63) // 64)
    angles = torch.outer(torch.arange(t, dtype=torch.float32), torch.rand(head_dim // 2, generator=gen))
    cos_table, sin_table = angles.cos().to(device), angles.sin().to(device)
    pos = torch.arange(t, device=device).expand(b, t).contiguous()
    cos, sin = cos_table[pos].unsqueeze(1).to(dtype), sin_table[pos].unsqueeze(1).to(dtype)
    k_sel = max(1, t // 2)
    idx = torch.sort(torch.rand(b, t, generator=gen).topk(k_sel, dim=1).indices, dim=1).values.to(device)
    gate = torch.rand(b, k_sel, generator=gen).to(device).requires_grad_(True)
    eps = 1e-6
    return {
        "rms_norm": (lambda x, w: reference.rms_norm(x, w, eps),
                     lambda x, w: ops._Norm.apply(x, w, None, eps, True), (rand(b, t, e), rand(e))),
        "swiglu": (reference.swiglu, lambda g, u: ops._SwiGLU.apply(g, u, True),
                   (rand(b, t, hidden), rand(b, t, hidden))),
        "qk_norm": (lambda x, tp: reference.qk_norm(x, tp, eps),
                    lambda x, tp: ops._Norm.apply(x, None, tp, eps, True),
                    (rand(b, t, kv_heads, head_dim), rand(kv_heads, as_dtype=torch.float32))),
        "rope": (lambda x: reference.rope(x, cos, sin), lambda x: ops._Rope.apply(x, cos, sin),
                 (rand(b, heads, t, head_dim),)),
        "qk_norm_rope": (lambda q, k, tp: reference.qk_norm_rope(q, k, tp, cos_table, sin_table, pos, eps),
                         lambda q, k, tp: ops._QKNormRope.apply(q, k, tp, cos_table, sin_table, pos, eps),
                         (rand(b, t, heads, head_dim), rand(b, t, kv_heads, head_dim), rand(kv_heads, as_dtype=torch.float32))),
        "gather_rows": (lambda x: reference.gather_rows(x, idx), lambda x: ops._GatherRows.apply(x, idx),
                        (rand(b, t, e),)),
        "scatter_add_gated": (lambda x, d, g: reference.scatter_add_gated(x, idx, d, g),
                              lambda x, d, g: ops._ScatterAddGated.apply(x, idx, d, g),
                              (rand(b, t, e), rand(b, k_sel, e), gate.float())),
    }


def _time_ms(fn: Callable, inputs, device: torch.device, warmup: int, reps: int) -> tuple[float, str]:
    """Mean milliseconds of one forward+backward, and how they were timed.

    On CUDA the step is captured once as a CUDA graph and replayed ``reps`` times, so only device
    time counts ("cuda-graph"): at these sizes the Python and launch overhead of an eager, compiled
    or Triton call is larger than its kernels, and a training step run as a graph (``GraphedStep``,
    or ``torch.compile`` with CUDA graphs) does not pay it either. Where the capture fails, and on
    CPU, back-to-back wall time ("back-to-back").
    """
    wrt = [x for x in inputs if x.requires_grad]

    def step():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs])

    if device.type == "cuda":
        try:
            return _graph_replay_ms(step, device, warmup, reps), "cuda-graph"
        except RuntimeError as exc:
            how = f"back-to-back (graph capture failed: {str(exc).splitlines()[0][:80]})"
        torch.cuda.synchronize(device)
    else:
        how = "back-to-back"
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return _cuda_ms(step, device, reps), how
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - t0) * 1e3 / reps, how


def _graph_replay_ms(step: Callable, device: torch.device, warmup: int, reps: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compilation and lazy initialisation happen outside the capture
        for _ in range(max(warmup, 1)):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize(device)
    return _cuda_ms(graph.replay, device, reps)


def _cuda_ms(run: Callable, device: torch.device, reps: int) -> float:
    """Mean milliseconds of ``reps`` calls of ``run`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


def _triton_mode(device: torch.device) -> str:
    if not switches.load_triton():
        return f"unavailable ({switches.STATE.load_error})"
    if switches.STATE.interpreter:
        return "interpreter (correctness only, not a speed measurement)"
    return "compiled" if device.type == "cuda" else "unavailable (compiled Triton needs CUDA tensors)"


def benchmark_kernels(batch_size: int = 4, seq_len: int = 512, dim: int = 768, device=None, *,
                      kernels=None, head_dim: int = 64, dtype: torch.dtype | None = None, warmup: int = 3,
                      reps: int = 10, compile: bool = True, seed: int = 0) -> dict:
    """Mean forward+backward milliseconds per op for the reference, its ``torch.compile`` and Triton.

    ``kernels``: subset of names to run (default all). Default dtype: bf16 on CUDA, fp32 elsewhere.
    Returns {"device", "device_name", "dtype", "shape", "triton_mode", "kernels": {name: {...}}};
    each kernel entry holds ``pytorch_ms``, ``compiled_ms``, ``triton_ms``, ``compiled_triton_ms``
    (the Triton op under ``torch.compile``, CUDA only; None when not run), ``speedup_vs_pytorch``
    (eager vs eager), ``speedup_vs_compiled`` (compiled reference vs compiled Triton where measured,
    else vs eager Triton), ``errors`` and ``timing`` (per variant: "cuda-graph", or "back-to-back"
    on CPU and where a capture failed; compare only numbers timed the same way).
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    mode = _triton_mode(device)
    run_triton = mode.startswith(("compiled", "interpreter"))
    gen = torch.Generator().manual_seed(seed)
    cases = _cases(batch_size, seq_len, dim, head_dim, device, dtype, gen)
    unknown = set(kernels or ()) - set(cases)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {sorted(cases)}")
    results = {}
    for name in kernels or cases:
        ref_fn, tri_fn, inputs = cases[name]
        row = {"pytorch_ms": None, "compiled_ms": None, "triton_ms": None, "compiled_triton_ms": None, "errors": {},
               "timing": {}}
        variants = [("pytorch_ms", ref_fn)]
        if compile:
            variants.append(("compiled_ms", torch.compile(ref_fn, dynamic=False)))
        if run_triton:
            variants.append(("triton_ms", tri_fn))
            if compile and device.type == "cuda":
                # How the op would run inside a compiled model: no Python overhead per launch.
                variants.append(("compiled_triton_ms", torch.compile(tri_fn, dynamic=False)))
        for key, fn in variants:
            try:
                row[key], row["timing"][key] = _time_ms(fn, inputs, device, warmup, reps)
            except Exception as exc:  # one failing variant must not hide the others' numbers
                row["errors"][key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        tri = row["triton_ms"]
        row["speedup_vs_pytorch"] = row["pytorch_ms"] / tri if tri and row["pytorch_ms"] else None
        # The fair contest: both sides compiled when both were measured.
        best = row["compiled_triton_ms"] or tri
        row["speedup_vs_compiled"] = row["compiled_ms"] / best if best and row["compiled_ms"] else None
        results[name] = row
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "shape": {"batch_size": batch_size, "seq_len": seq_len, "dim": dim, "head_dim": head_dim},
        "triton_mode": mode,
        "kernels": results,
    }


def _fmt(value, width: int, suffix: str = "") -> str:
    return ("-" if value is None else f"{value:.{2 if suffix else 3}f}{suffix}").rjust(width)


def print_benchmark_results(results: dict) -> str:
    """Print (and return) a table of ``benchmark_kernels`` output."""
    shape = results["shape"]
    lines = [f"Kernel benchmark on {results['device_name']} ({results['dtype']}, B={shape['batch_size']} "
             f"T={shape['seq_len']} E={shape['dim']} d={shape['head_dim']}); forward+backward, mean ms"
             + (" (CUDA-graph replay: device time only)" if results["device"] == "cuda" else ""),
             f"Triton: {results['triton_mode']}",
             f"{'kernel':<18}{'pytorch':>10}{'compiled':>10}{'triton':>10}{'tri+comp':>10}{'vs eager':>10}"
             f"{'vs compiled':>13}"]
    for name, row in results["kernels"].items():
        lines.append(f"{name:<18}{_fmt(row['pytorch_ms'], 10)}{_fmt(row['compiled_ms'], 10)}"
                     f"{_fmt(row['triton_ms'], 10)}{_fmt(row['compiled_triton_ms'], 10)}"
                     f"{_fmt(row['speedup_vs_pytorch'], 10, 'x')}"
                     f"{_fmt(row['speedup_vs_compiled'], 13, 'x')}")
        for key, err in row["errors"].items():
            lines.append(f"    {key}: {err}")
        for key, how in row["timing"].items():
            if results["device"] == "cuda" and how != "cuda-graph":
                lines.append(f"    {key}: timed {how}")
    text = "\n".join(lines)
    print(text)
    return text
