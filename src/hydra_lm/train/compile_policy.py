"""Which speed options a training step runs with (``hydra-lm train`` and ``hydra-lm bench``): the
defaults per device and process count, and the one place that refuses combinations that cannot work.

The settings ``compile``, ``parallel_compile``, ``cuda_graph`` and ``chunked_ce`` are None for "automatic":

- CUDA, one process: compile each block's training forward, routing and recursions included, as one
  static graph per block layout (``compile_units``; evaluation runs one dynamic graph for every routed
  unit), capture the whole step as CUDA graphs, fuse head and loss in chunks, and compile the block
  layouts in parallel processes before a step with new shapes (``parallel_compile``). On an H100
  (100M preset) this trains 1.15x faster than compiled units with the routing between them eager
  (benchmarks/BENCHMARKS.md, thirty-fourth session); its first step with cold caches took 55-69 s on two H100
  hosts, against 68-107 s there with the layouts compiled one after the other in the step (seventy-second and
  seventy-third sessions).
- CUDA under torchrun: compile the whole model, fused loss; no CUDA graphs (FSDP2/DDP communication
  cannot be captured) and no unit compilation (one process only).
- CPU: eager, plain loss.
- Gradient checkpointing: no CUDA graphs. Optimizers other than AdamW and Muon (``CAPTURABLE_OPTIMIZERS``)
  cannot be captured: their update (and Sophia's Hessian estimate) runs eagerly between the replays
  of the forward + backward graph.

The whole model compiled with its layers as nested compile regions and inductor's own CUDA graphs
(reduce-overhead) was a third path until the thirty-fifth session: 1.11x the compiled units' steady state
against the blocks' 1.15x, a 125-183 s cold first step against 109-115 s, and wrong outputs on the CPU
with torch 2.13 in some layouts (benchmarks/BENCHMARKS.md, thirty-third and thirty-fourth sessions). Inside the
block graphs, the deep units (at most 16 entries a row) padded to one shape and shared as one nested compile region
trained 5.5% slower on an H200 and compiled no faster (forty-seventh session, branch ``shared-small-unit``). Blocks
cut into depth spans so that the two layouts' common chain of depths compiles once (five unit instances instead of
eight) took the cold first step from 74 to 64 s but trained 3.6% slower (fiftieth session, branch ``depth-spans``).
torch.compile runs in its default mode: with ``max-autotune-no-cudagraphs`` inductor had not finished autotuning the
first block graph's GEMMs after 6 minutes on an H100, where cuBLAS already runs the step's GEMMs of 2,048 tokens and
more at 580-720 TFLOP/s (seventy-seventh session, ``benchmarks/blas_library_gemms.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._functorch.config

from ..model.block import run_block, run_unit
from ..model.routing import routed_selection
from ..model.loss import resolve_impl
from ..model.moe import grouped_mm_syncs

# Optimizers whose step replays in a CUDA graph: fused AdamW, and Muon (train/muon.py) with AdamW beside it.
CAPTURABLE_OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class SpeedPlan:
    compile: str | None  # "units" (blocks and routed units), "model" (whole model) or None (eager)
    cuda_graph: bool  # the micro-batch forward + backward as a CUDA graph
    ce_impl: str  # the model's loss path: "naive", "chunked" or "auto" (Liger when installed)
    ce_chunk_size: int
    # With cuda_graph: the update (clipping, optimizer step) as a second graph, for a capturable optimizer
    # (CAPTURABLE_OPTIMIZERS, the learning rate in a device tensor); the others step eagerly between replays.
    update_graphed: bool = False
    # With compile "units": each block layout's graphs compiled in a helper process of its own before a step with
    # new shapes, all at once (train/parallel_compile.py).
    parallel_compile: bool = False

    def describe(self) -> list[str]:
        names = {"units": "blocks for training, routed units for evaluation", "model": "whole model"}
        parts = [f"torch.compile ({names[self.compile]})"] if self.compile else ["eager"]
        if self.cuda_graph:
            parts.append("whole-step CUDA graphs" if self.update_graphed else
                         "CUDA graphs of forward + backward (the optimizer steps eagerly)")
        if self.parallel_compile:
            parts.append("block layouts compiled in parallel processes")
        if self.ce_impl != "naive":
            parts.append(f"fused chunked loss ({self.ce_chunk_size} tokens per chunk)")
        return parts


def resolve_speed_options(cfg: Any, device: torch.device, distributed: bool, moe: bool = False) -> SpeedPlan:
    """``cfg``: a TrainConfig or BenchConfig (fields compile, cuda_graph,
    chunked_ce, chunked_ce_size; a bench has no optimizer or gradient_checkpointing field and runs
    fused AdamW without checkpointing); ``moe``: the model has MoE layers. Raises ValueError for what cannot run."""
    cuda = device.type == "cuda"
    optimizer = getattr(cfg, "optimizer", "adamw")
    checkpointing = getattr(cfg, "gradient_checkpointing", False)
    moe_syncs = moe and cuda and grouped_mm_syncs(device)  # its experts read offsets on the host: no capture
    compile_on = cuda if cfg.compile is None else cfg.compile

    def refuse(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    if cfg.cuda_graph:  # asked for explicitly
        refuse(not checkpointing, "--cuda_graph with gradient checkpointing is not supported (recomputation saves "
               "and restores RNG states on the host); drop one of them")
        refuse(cuda, f"--cuda_graph needs a CUDA device (this run is on {device}): drop --cuda_graph")
        refuse(not distributed, "--cuda_graph works in one process only: FSDP2/DDP communication cannot be "
               "captured; drop --cuda_graph under torchrun")
        capability = ".".join(map(str, torch.cuda.get_device_capability(device))) if moe_syncs else ""
        refuse(not moe_syncs, "--cuda_graph with MoE needs torch's grouped GEMM without a host sync, which runs on "
               f"GPUs of compute capability 9.x and 10.x only (this one is {capability}): drop --cuda_graph")
        graphs = True
    elif cfg.cuda_graph is None:  # automatic: wherever it can run
        graphs = cuda and not distributed and not checkpointing and not moe_syncs
    else:
        graphs = False
    # Checked here, where the automatic setting is known: on CUDA graphs are on without --cuda_graph.
    refuse(graphs or getattr(cfg, "cuda_graphs_warmup", 2) == 2, "--cuda_graphs_warmup sets the eager steps before "
           "a CUDA graph capture, and this run captures none (graphs need one CUDA process without gradient "
           "checkpointing, and not --no-cuda_graph): drop --cuda_graphs_warmup")
    chunked = cuda if cfg.chunked_ce is None else cfg.chunked_ce
    if not compile_on:
        scope = None
    else:  # the units' compilation works in one process only; torchrun compiles the whole model
        scope = "model" if distributed else "units"
    parallel = getattr(cfg, "parallel_compile", None)
    refuse(not parallel or scope == "units", "--parallel_compile compiles the block graphs of --compile in one "
           "process: " + ("drop it under torchrun, which compiles the whole model" if distributed else
                          "this run compiles nothing; drop --parallel_compile, or add --compile"))
    # Automatic on CUDA: on two H100 hosts the 100M preset's cold first step took 55 and 69 s with it against 68 and
    # 88-107 s without; on the 2-core CPU it does not pay (benchmarks/BENCHMARKS.md, seventy-first to seventy-third
    # sessions).
    parallel = scope == "units" and (cuda if parallel is None else parallel)
    refuse(chunked or cfg.ce_impl == "auto", "--ce_impl picks the fused loss of --chunked_ce, which is off: add "
           "--chunked_ce")
    refuse(not (graphs and cfg.ce_impl == "liger"), "CUDA graphs cannot capture Liger's loss (it reads a token "
           "count on the host): use --ce_impl chunked or auto, or --no-cuda_graph")
    if chunked:
        resolve_impl(cfg.ce_impl, device)  # --ce_impl liger without the package or CUDA: refused now
    # A CUDA graph cannot hold Liger's kernel (it reads a token count on the host): the chunked fallback.
    ce_impl = ("chunked" if graphs and cfg.ce_impl == "auto" else cfg.ce_impl) if chunked else "naive"
    return SpeedPlan(scope, graphs, ce_impl, cfg.chunked_ce_size,
                     update_graphed=graphs and optimizer in CAPTURABLE_OPTIMIZERS, parallel_compile=parallel)


def enable_tf32(device: torch.device) -> bool:
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (what bf16 autocast leaves in
    fp32: optimizer math, the loss's accumulations); True when set."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def apply_speed_plan(model, wrapped: torch.nn.Module, plan: SpeedPlan):
    """Set the model's loss path and compile what ``plan`` says; returns what a step calls: ``wrapped``
    (the model, or its FSDP2/DDP wrapper) itself, or a compiled module around it."""
    model.ce_impl, model.ce_chunk_size = plan.ce_impl, plan.ce_chunk_size
    if plan.compile == "units":
        compile_units(model)  # compiled in place
        return wrapped
    if plan.compile is not None:
        return torch.compile(wrapped)
    return wrapped


def compile_units(model, **kwargs):
    """Compile a ``HydraModel``'s blocks and routed units in place, each once for every block it serves:

    - training forwards (gradients on, no cache): ``block.run_block``, a whole block with its routers and
      recursions, at static shapes (one batch shape per run): one graph per block layout (the 100M
      preset has two: routed at depth 0 or not), so the routing between units fuses with them and
      autograd sums the shared weights' gradients over the recursions inside the compiled backward.
      Eager routing between compiled units cost the 100M preset 13% of its step on an H100;
    - evaluation and a MoR ramp in progress (each of its levels would compile the
      block graphs again): ``block.run_unit`` (recursion embedding, the layer stack, the gated residual
      update) with dynamic token counts, and, with gradients on (the ramp), the routers' selections
      (``routing.routed_selection``; evaluation runs them eagerly: each routing mode would be a graph of its own),
      with the gathers and scatters between them eager;
    - the fused chunked loss's per-chunk work (``ce_impl`` other than "naive") where its Triton kernel does not
      run (off CUDA; kernels/cross_entropy_rows.py), and MoE blocks.

    Options default to ``fullgraph=True`` (and ``dynamic=True`` for the units). Pair it with a whole-step
    CUDA graph (``hydra_lm.model.cuda_graphs.GraphedStep``) so the eager kernels cost no launch time.
    Returns the model; parameter names and the state dict are unchanged."""
    kwargs = {"fullgraph": True, "dynamic": True, **kwargs}
    if kwargs.get("backend", "inductor") == "inductor" and kwargs.get("mode") is None:
        # Inductor's mixed-order reduction fusion (norm backward) guards on the unit's token count
        # against a size threshold, which would compile the unit a second time.
        kwargs["options"] = {"triton.mix_order_reduction": False, **kwargs.get("options", {})}
    # Python floats (norm eps) as constants: traced as symbols they make Dynamo restart the whole
    # analysis of the unit. Units of one token per row run padded to two (block._run_compiled_unit) and
    # evaluation passes masks alike (block._eval_mask), but evaluation (no gradients), each routing mode
    # and the routers' one-of-two choices still add graphs: past Dynamo's default 8 graphs per function
    # the fullgraph compile would fail, so the limit is raised as for the decode unit.
    dynamo_patch = torch._dynamo.config.patch(specialize_float=True, recompile_limit=64)
    # AOTAutograd's cache skips a graph holding a custom autograd.Function (the row gathers and scatters,
    # the fused loss) unless told otherwise; without it every new process traces and partitions the block
    # graphs' joint forward and backward again (H100, 100M preset: warm first step 24.5 s against 8.7 s).
    # Such a function's forward and backward are traced into the graph, so they are part of its key.
    aot_patch = torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True)

    def patch(fn):
        return aot_patch(dynamo_patch(fn))

    unit = patch(torch.compile(run_unit, **kwargs))
    # The routers' selections likewise: eager, each is a few dozen kernels of a few microseconds (top-k,
    # calibration, router loss); compiled, the 100M preset trains ~2% faster on an H100.
    select = patch(torch.compile(routed_selection, **kwargs))
    # Whole blocks at static shapes: with dynamic shapes the 100M preset's first step took over 400 s on
    # an H100 (its depths' token counts derive from the row length), against 109-115 s static.
    compiled_block = patch(torch.compile(run_block, **{**kwargs, "dynamic": False}))
    for block in model.blocks:
        block.compiled_unit, block.compiled_select = unit, select
        # A block of one unrouted unit (dense layers, middle_cycle's ends) has no routing to fuse: its unit
        # graph serves it (on an H100 a dense model's block graphs trained no faster, with 1.2 GB more peak).
        block.compiled_block = compiled_block if block.recursions > 1 or block.all_routers() else None
    for moe in model.moe_blocks.values():
        # Not fullgraph: off the grouped GEMM (CPU, or CUDA outside bf16) the experts' loop reads their slices'
        # bounds on the host, which Dynamo cannot trace; it breaks the graph there instead of failing.
        moe.compile(**{**kwargs, "fullgraph": False})
    model.ce_compile = {"backend": kwargs.get("backend", "inductor"), "mode": kwargs.get("mode")}
    return model


def units_compile_switch(model) -> tuple[Callable[[], None], Callable[[], None]]:
    """(turn_off, turn_on) for what ``compile_units`` set on ``model``, for the trainer's anomaly monitor
    (``safe_optimizations``): off, every block, unit, selection, MoE block and loss chunk runs eagerly; on,
    the compiled ones come back with the graphs they already hold."""
    blocks = [(b, b.compiled_unit, b.compiled_select, b.compiled_block) for b in model.blocks]
    # nn.Module.compile keeps its compiled call here; clearing it is how a module runs eagerly again.
    moes = [(m, m._compiled_call_impl) for m in model.moe_blocks.values()]
    ce_compile = model.ce_compile

    def turn_off() -> None:
        for block, *_ in blocks:
            block.compiled_unit = block.compiled_select = block.compiled_block = None
        for moe, _ in moes:
            moe._compiled_call_impl = None
        model.ce_compile = None

    def turn_on() -> None:
        for block, unit, select, compiled_block in blocks:
            block.compiled_unit, block.compiled_select, block.compiled_block = unit, select, compiled_block
        for moe, call in moes:
            moe._compiled_call_impl = call
        model.ce_compile = ce_compile

    return turn_off, turn_on
