"""Time of one routed unit (forward + backward, compiled at dynamic token counts as evaluation compiles it;
training compiles whole blocks at static shapes) against the tokens it runs on: the fixed cost that every unit
pays however few tokens reach it, and the cost per token.

A HYDRA step runs 32 units for the 100M preset (8 blocks x 4 depths); the geometric MoR schedule leaves
its deep units a few tokens per row, so their time is almost all fixed cost. This splits a step's unit
time into the two parts: it times the compiled ``block.run_unit`` of the preset's first block at each
``--tokens_per_row``, fits time = fixed + per_token x tokens, and adds up the preset's own units (the
token counts of ``RecursiveBlock.tokens_per_depth``). On CUDA each timing replays forward + backward
captured in one CUDA graph (as the trainer's whole-step graph does, so no launch overhead is counted)
and the profiler counts the kernels of one replay; on a CPU it times eager calls (a check of the script,
not a measurement of anything a GPU does).

    python benchmarks/unit_cost.py --model_size 100M --batch_size 16 --seq_len 1024
    python benchmarks/unit_cost.py --model_size 100M --batch_size 64 --seq_len 1024 --tokens_per_row 1 2 16 128 1024
    python benchmarks/unit_cost.py --model_size 1B --fp8_min_tokens 0   # every call in float8 (H100)
    python benchmarks/unit_cost.py --batch_size 64 --tokens_per_row 1024 --kernels 25   # where a unit's time goes
    python benchmarks/unit_cost.py --batch_size 64 --tokens_per_row 1024 --kernels 25 --model arch=dense   # dense
    python benchmarks/unit_cost.py --inductor combo_kernels=True   # an inductor option's effect on the fixed cost
    python benchmarks/unit_cost.py --dynamic tokens   # only the token count symbolic: model width and batch static

``--fp8_min_tokens N`` converts the unit's layers as ``--experimental_fp8`` does: where float8 starts to pay
is where the bf16 and float8 times of the same token count cross.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hydra_lm.config import preset_config
from hydra_lm.model.hydra import HydraModel
from hydra_lm.model.block import _run_compiled_unit
from hydra_lm.model.cuda_graphs import GraphedStep
from hydra_lm.model.doc_attention import documents_for
from hydra_lm.train.compile_policy import compile_units
from hydra_lm.train.fp8 import FP8_FORMATS, FP8_RECIPES, convert_to_fp8
from hydra_lm.train.flags import parse_value


def unit_step(model: HydraModel, batch: int, n: int, device: torch.device, documents: bool, mark_tokens: bool):
    """Forward + backward of the first block's compiled unit at depth 1 on ``n`` tokens per row, with
    the gate weight and the input needing gradients, as in training (``documents``: with document ids,
    one document per row, as the trainer passes them by default). ``mark_tokens``: the token dimension of
    every input marked dynamic (for a unit compiled with ``dynamic=False``)."""
    block = model.blocks[0]
    g = torch.Generator(device="cpu").manual_seed(n)
    xc = torch.randn(batch, n, model.config.dim, generator=g).to(device).requires_grad_()
    pos = torch.sort(torch.randperm(model.config.max_seq_len, generator=g)[:n]).values.expand(batch, n).to(device)
    weight = torch.rand(batch, n, generator=g).to(device).requires_grad_()
    grad = torch.randn(batch, n, model.config.dim, generator=g).to(device)
    rec = None if block.rec_emb is None else block.rec_emb[min(1, block.recursions - 1)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda", cache_enabled=False)
    doc = None
    if documents:  # built outside the unit, once per set of entries, as the model's forward does
        with autocast:
            doc = documents_for(torch.zeros(batch, n, dtype=torch.long, device=device),
                                model.config.doc_mask_backend, model.config.head_dim, xc.dtype)

    if mark_tokens and n > 1:  # Dynamo specialises a size of 1 whatever is marked
        for t in (xc, pos, weight, *([] if doc is None else [doc.ids])):
            torch._dynamo.mark_dynamic(t, 1)
        if doc is not None and doc.mask is not None:
            torch._dynamo.mark_dynamic(doc.mask, 2)
            torch._dynamo.mark_dynamic(doc.mask, 3)
    wrt = [xc, weight, *block.layers.parameters()]

    def step():
        # autograd.grad, not backward: a leaf's gradient accumulation would tie the capture to the
        # default stream (the capture fails); the step's gradients are all computed, only not stored.
        with autocast:
            out = _run_compiled_unit(block.compiled_unit, block.layers, xc, rec, pos, model.rope, None, doc, weight)
        return torch.autograd.grad(out, wrt, grad)
    return step


def time_step(step, device: torch.device, repeats: int) -> tuple[float, int | None, list]:
    """Median seconds of one call, and on CUDA the kernels of one replay and their times: (name, total
    microseconds, launches) per kernel name, longest first."""
    if device.type != "cuda":
        step()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times), None, []
    graphed = GraphedStep(step, warmup=3)
    for _ in range(5):
        graphed()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graphed()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graphed()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    table = sorted(((name, us, n) for name, (us, n) in by_name.items()), key=lambda row: -row[1])
    return statistics.median(times), len(events) or None, table  # None: the profiler saw no kernels in the replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_size", default="100M")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--tokens_per_row", type=int, nargs="+", default=[1, 2, 16, 128, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no_documents", action="store_true",
                   help="no document ids (hydra-lm bench's setting; the trainer passes them by default)")
    p.add_argument("--fp8_min_tokens", type=int, default=None,
                   help="float8 layers (torchao) on calls of at least this many tokens; default bf16 only")
    p.add_argument("--fp8_format", default="e4m3", choices=tuple(FP8_FORMATS),
                   help="with --fp8_min_tokens: the output gradients' float8 dtype (the trainer's default e4m3)")
    p.add_argument("--fp8_recipe", default=FP8_RECIPES[0], choices=FP8_RECIPES,
                   help="with --fp8_min_tokens: torchao's scaling recipe (the trainer's default first; e5m2 needs "
                        "tensorwise)")
    p.add_argument("--fp8_mlp_only", action="store_true",
                   help="with --fp8_min_tokens: the attention projections stay bf16 (their gate set out of reach)")
    p.add_argument("--inductor", nargs="*", default=[], metavar="OPTION=VALUE",
                   help="inductor options added to the trainer's for the unit's compile, e.g. combo_kernels=True")
    p.add_argument("--dynamic", choices=("all", "tokens"), default="all",
                   help="all: every size symbolic, as compile_units compiles (dynamic=True); tokens: only the "
                        "token dimension (dynamic=False and mark_dynamic), the model width and batch static")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="on CUDA: print the N longest kernels of one replay at the largest --tokens_per_row")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="HydraConfig overrides, e.g. dim=256 n_heads=2 n_kv_heads=1 for a quick CPU check")
    args = p.parse_args()

    def settings(items: list[str]) -> dict:
        return {key: parse_value(value) for key, value in (item.split("=", 1) for item in items)}

    overrides = settings(args.model)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = HydraModel(preset_config(args.model_size, max_seq_len=max(args.seq_len, 64), **overrides)).to(device)
    if args.fp8_min_tokens is not None:
        convert_to_fp8(model, args.fp8_format, device, args.fp8_min_tokens, args.fp8_recipe)
        if args.fp8_mlp_only:
            for name, module in model.named_modules():
                if hasattr(module, "min_tokens") and ".mlp." not in name:
                    module.min_tokens = 1 << 40
    options = settings(args.inductor)
    compile_units(model, **({"options": options} if options else {}),
                  **({"dynamic": False} if args.dynamic == "tokens" else {}))

    rows = []
    for n in sorted(set(args.tokens_per_row)):
        step = unit_step(model, args.batch_size, n, device, not args.no_documents, args.dynamic == "tokens")
        seconds, kernels, table = time_step(step, device, args.repeats)
        rows.append((n, seconds, kernels))
        print(f"{n:>6} tokens/row ({args.batch_size * n:>7,} tokens): {seconds * 1e3:8.3f} ms forward + backward"
              + (f", {kernels} kernels" if kernels is not None else ""), flush=True)

    if args.kernels and table:
        total = sum(us for _, us, _ in table)
        print(f"the {args.kernels} longest kernels of one replay at {n} tokens/row "
              f"({total / 1e3:.3f} ms of kernel time):")
        for name, us, count in table[:args.kernels]:
            print(f"  {us / 1e3:8.3f} ms {us / total:6.1%} x{count:<4} {name[:110]}")

    # Least squares on (tokens, seconds): the intercept is the fixed cost of a unit.
    xs = [args.batch_size * n for n, _, _ in rows]
    ys = [s for _, s, _ in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    fixed = my - slope * mx
    print(f"fit: {fixed * 1e3:.3f} ms per unit + {slope * 1e9:.3f} ns per token")
    counts = [c for block in model.blocks for c in block.tokens_per_depth(args.seq_len)]
    units = sum(fixed + slope * args.batch_size * c for c in counts)
    share = fixed * len(counts) / units
    print(f"the {model.config.preset} preset's {len(counts)} units at batch {args.batch_size} x {args.seq_len} "
          f"(tokens per row {counts}): {units * 1e3:.2f} ms per step by the fit, {share:.0%} of it fixed cost")


if __name__ == "__main__":
    main()
