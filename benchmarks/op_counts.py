"""Per-step op counts of a training step (forward + backward) on CPU: a proxy for the GPU's kernel count.

Builds a preset's layout at a narrow width, runs a few warm-up steps, then profiles one step and counts
the outermost ATen ops (those called from Python or by the autograd engine, not from inside another op;
views, allocations and casts to the same dtype are skipped) by name, forward and backward apart. With
``--compile`` the routed units are compiled as the trainer does (``train.compile_policy.compile_units``) and ops
inside the compiled graphs are not counted (each call is one graph); what remains is the eager routing,
gathers, scatters and the autograd engine's gradient sums. Gradients are kept between steps, as in a
CUDA-graphed step (which zeroes them in place), so ``AccumulateGrad`` adds into them. CPU counts are a
proxy: a GPU may launch several kernels for one op (top-k, sort, an out-of-place scatter) and none for
an op on a host scalar.

    PYTHONPATH=src python benchmarks/op_counts.py --preset 100M --dim 256 --compile
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from hydra_lm.config import preset_config
from hydra_lm.model.hydra import HydraModel
from hydra_lm.train.compile_policy import compile_units

# Ops that launch no kernel (views, allocation, metadata, host scalars).
NO_KERNEL = {"view", "_unsafe_view", "expand", "t", "transpose", "reshape", "slice", "select", "split",
             "split_with_sizes", "chunk", "as_strided", "unsqueeze", "squeeze", "permute", "detach", "alias",
             "unbind", "empty", "empty_strided", "resize_", "result_type", "lift_fresh", "flatten", "contiguous",
             "narrow", "expand_as", "view_as", "empty_like", "to", "item", "_local_scalar_dense", "promote_types",
             "scalar_tensor", "is_nonzero", "set_", "numpy_T", "_reshape_alias", "squeeze_", "unsqueeze_"}
COMPILED = ("CompiledFunction", "CompiledFunctionBackward")


def _kernel_op(name: str) -> bool:
    return name.startswith("aten::") and name[6:] not in NO_KERNEL


def autocast_context(autocast: bool):
    """The same context for the warm-up and the profiled step: Dynamo guards on the autocast state (a
    disabled ``torch.autocast`` differs from none in its cache flag), and a recompile inside the profiled
    step would count the tracing's ops."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if autocast else \
        contextlib.nullcontext()


def count_step(model: HydraModel, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("PHASE_forward"), autocast_context(autocast):
            out = model(x, targets=y)
        with torch.profiler.record_function("PHASE_backward"):
            out["loss"].backward()
    counts = {"forward": collections.Counter(), "backward": collections.Counter()}
    nodes: collections.Counter = collections.Counter()
    graphs: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.name in COMPILED:
            graphs[e.name] += 1
        if not _kernel_op(e.name):
            continue
        phase, node, a = "backward", None, e.cpu_parent  # the engine may run backward on its own thread
        compiled = False
        while a is not None:
            compiled |= a.name in COMPILED or a.name.startswith("Torch-Compiled Region") or _kernel_op(a.name)
            if node is None and a.name.startswith("autograd::engine::evaluate_function"):
                node = a.name.split(": ")[-1]
            if a.name.startswith("PHASE_"):
                phase = a.name[6:]
            a = a.cpu_parent
        if compiled:  # inside a compiled graph, or inside another op that is counted
            continue
        counts[phase][e.name[6:]] += 1
        if phase == "backward":
            nodes[f"{node} -> {e.name[6:]}"] += 1
    return {"counts": counts, "nodes": nodes, "graphs": graphs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="100M")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n_heads", type=int, default=2)
    p.add_argument("--n_kv_heads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--compile", action="store_true", help="compile the routed units (compile_policy.compile_units)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU (cast cache off, as under CUDA graphs)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    torch.manual_seed(0)
    cfg = preset_config(args.preset, dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                        vocab_size=args.vocab, max_seq_len=max(args.seq_len, 64))
    model = HydraModel(cfg)
    model.ce_impl = "chunked"
    if args.compile:
        compile_units(model)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    y = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    for _ in range(3):  # warm-up (compilation), and gradients that exist
        with autocast_context(args.bf16):
            out = model(x, targets=y)
        out["loss"].backward()
    res = count_step(model, x, y, args.bf16)
    scope = "outside the compiled units" if args.compile else "in all (eager)"
    print(f"{args.preset} layout, dim {args.dim}, batch {args.batch}x{args.seq_len}, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}; outermost ATen ops {scope}")
    if res["graphs"]:
        print("compiled graph calls:", dict(res["graphs"]))
    total = 0
    for phase, c in res["counts"].items():
        total += sum(c.values())
        print(f"{phase}: {sum(c.values())}  " + ", ".join(f"{k} {v}" for k, v in c.most_common(args.top)))
    print(f"step total: {total}")
    print("backward by autograd node: " + ", ".join(f"{k} {v}" for k, v in res["nodes"].most_common(args.top)))


if __name__ == "__main__":
    main()
