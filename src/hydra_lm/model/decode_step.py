"""The one-token decoding step of ``HydraModel.generate``: a routed unit runs only when some row's new
token enters it.

A full forward (and the prompt's prefill, ``HydraModel.forward_cached``) runs every unit, on masked
entries up to the last one any row admits (``block._admitted_prefix``). A one-token step has few entries
to mask and many units: with the presets' routing a token enters about 5 of the 100M preset's 32 units,
and a step that launches all 32 is bound by their kernels' fixed cost. So the step is a list of ops
(embedding, each router's decision, each unit, MoE blocks, head) over fixed buffers (the residual stream
``x``, each router's mask and gate), and after each router's decision the host reads whether any row's
token entered: if none did, the rest of that block is skipped. A skipped unit leaves its caches as a
masked one would (no slot marked valid, conv and value-shift state unchanged; its router's state marks no
candidate) and the residual stream unchanged, so the tokens are those of the full forward. For the same
reason a decision need not be read back at all: its units can run masked. Each read-back stalls the GPU
for a host round trip, so only decisions whose skips save enough units are read
(``MIN_UNITS_SAVED``): at batch 1 all of the presets' decisions, at batch 32 only the deep
recursions'.

On CUDA the ops between two decisions are one CUDA graph ("segment"), captured on the second call after
an eager first call that runs every op (compiling every graph the segments use). Where CUDA graph IF nodes
can be built (``graph_conditionals``: the ``cuda-bindings`` package and a CUDA 12.4+ driver) the segments
are composed into one graph whose IF nodes take every decision on the device, so a step is one launch and
no read-back; elsewhere the host reads each decision back and replays the segment it leads to. Under
autocast the units and the head run on copies whose Linear weights are cast once (``decode_weights``).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import graph_conditionals
from .attention import CCGQAttention, decode_kernels_run
from .block import run_cached_unit, run_prefill_block
from .cuda_graphs import capture
from .routing import RANK_PRIOR, ExpertChoiceRouter


# A decision may skip units (read back, or an IF node) only if the units it skips, on average, are at least
# this many: the chance that no row's token enters it ((1 - f)^B for B rows that each enter with the
# probability f, the share of a row its depth runs in training) times the units a skip leaves out (its depth
# to the block's last). A read-back costs most of a unit: at batch 8 the MoD-only form's four read-backs,
# each skipping one unit a third of the time, cost more than running every unit (1.18 ms a step against the
# same graph's 1.01 ms at batch 32 without them), while at batch 1 skipping 0.875 of a unit per read-back
# paid (benchmarks/BENCHMARKS.md, twenty-sixth and twenty-seventh sessions). An IF node costs less but not
# nothing: 0.1 and 0 gave the same tokens/s as 0.5 at batch 1 and 8 and 0.5-4% less at 32 and 128
# (thirty-seventh session), so one threshold serves both.
MIN_UNITS_SAVED = 0.5


def decode_compiles(device: torch.device, compile_step: bool | None) -> bool:
    """Whether a decode step on ``device`` runs compiled units: ``compile_step``, or by default on CUDA
    (faster there at every batch size measured, benchmarks/BENCHMARKS.md) and not on the CPU, where the
    unit compiles without code generation (``compiled_decode_unit``), so it would buy nothing."""
    return torch.device(device).type == "cuda" if compile_step is None else compile_step


_compiled_decode_fns: dict = {}


def _compile_for_decode(fn, device: torch.device, dynamic: bool | None = False):
    # Inductor generates Triton on CUDA; on the CPU "aot_eager" (Dynamo's trace and AOT's functionalized
    # cache updates, no code generation): inductor's C++ codegen fails on some of these graphs in some builds.
    backend = "inductor" if torch.device(device).type == "cuda" else "aot_eager"
    key = (fn.__name__, backend)
    if key not in _compiled_decode_fns:
        # Python floats (norm eps, capacities) as constants, as in compile_policy.compile_units: no restart
        # of the analysis. Each (batch, cache length, dtype, layer stack or router kind) is a graph of its
        # own; past Dynamo's default limit of 8 per function a bench over several batch sizes would
        # silently fall back to eager.
        _compiled_decode_fns[key] = torch._dynamo.config.patch(specialize_float=True, recompile_limit=64)(
            torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True))
    return _compiled_decode_fns[key]


def compiled_decode_unit(device: torch.device):
    """``run_cached_unit`` (a routed unit's layer stack on new tokens, appending to its caches in
    place) under ``torch.compile`` with static shapes and ``fullgraph=True``: every unit runs on [B, 1]
    entries, so one graph per (batch, cache length, dtype, layer stack) serves every unit of every block
    and every position. The layers, the caches and the unit's inputs are arguments, not constants:
    Dynamo guards on their types and shapes, not on which unit they belong to. One compiled callable per
    device type."""
    return _compile_for_decode(run_cached_unit, device)


def compiled_prefill(device: torch.device):
    """What ``HydraModel.forward_cached(compiled=True)`` runs for each block: ``block.run_prefill_block`` (the block's
    routers and units on a prompt, appending to the units' caches and writing the routers' decode states in place),
    compiled like ``compiled_decode_unit`` but with the prompt's length a symbol (``HydraModel.forward_cached``
    marks it), so one graph per block layout serves every block of it and every prompt length; a second batch size
    compiles once more, with the batch a symbol from then on. Every unit runs on all its candidates, those not
    admitted masked: no host sync, and the masked entries' GPU work (15.9 against 7.9 ms for an 8 x 1,024 prompt on
    an H200) costs less than the syncs and calls it removes (benchmarks/BENCHMARKS.md, forty-fourth session). Eager,
    the 100M preset's prefill of one 128-token prompt dispatches about 8,200 ATen ops and its time is the host's;
    compiled per unit and per router it still made about 60 calls and 28 host syncs (benchmarks/BENCHMARKS.md,
    forty-third session)."""
    return _compile_for_decode(run_prefill_block, device, dynamic=None)


def decide_entries(router, x, valid, mode: str, depth: int, decision, state, capacity: float, pos, weight, mask):
    """A router's decision on the step's new tokens (``Router.decide_new``), written into the step's
    buffers: the gate into ``weight`` and, routing causally, whether each row's token enters (and was a
    candidate, ``valid``) into ``mask``. What a decoded token needs and no more: a selection
    (``Router.select``) also orders the entries and computes statistics, ten kernels more per router on an
    H200. An expert-choice router's causal decision on CUDA runs as one Triton kernel instead
    (``kernels/route_decode.py``, ``DecodeStep``)."""
    gate, admitted = router.decide_new(x, valid, mode, depth, decision, state, capacity, pos)
    weight.copy_(gate)
    if admitted is not None:  # None: static routing, every token runs the unit weighted by its gate
        mask.copy_(admitted if valid is None else admitted & valid)


def compiled_decode_decision(device: torch.device):
    """``decide_entries`` compiled like ``compiled_decode_unit``: the router's logit, its causal rank among
    the earlier candidates kept in the decode state (updated in place), the gate and the buffers' writes as a
    few fused kernels; one graph per router kind, capacity and whether an earlier depth masked the router's
    candidates."""
    return _compile_for_decode(decide_entries, device)


def decode_weights(module: nn.Module, dtype: torch.dtype | None, conv_taps: bool) -> nn.Module:
    """``module`` as the decode step runs it: a copy sharing every parameter and buffer with ``module``, except

    - under autocast to ``dtype`` (None: no autocast), its ``nn.Linear`` weights (and biases) cast to ``dtype``
      once. The step runs without autocast's weight cache (it would hold tensors across a graph capture), so
      autocast would otherwise cast every fp32 weight the step reads, at every step. Exact: autocast feeds a
      linear layer's GEMM the very values cast here; the layers it keeps in their own precision (norms, convs,
      embeddings) stay untouched;
    - with ``conv_taps`` (the CCGQA decode kernel runs), each CCGQA layer's grouped-conv weight laid out by tap,
      [KC, C, D], as the buffer ``conv_ch_taps``: the kernel reads each tap's weights contiguously, where the
      conv's own layout [C, D, KC] strides them (3.8 of the kernel's 10.6 us at batch 1 on an H200,
      benchmarks/BENCHMARKS.md, fortieth session).

    ``module`` itself when there is nothing to change."""
    def lays_out(m: nn.Module) -> bool:  # a CCGQA layer whose conv weight is still to be laid out by tap
        return conv_taps and isinstance(m, CCGQAttention) and not hasattr(m, "conv_ch_taps")

    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.dtype != dtype] if dtype else []
    if not linears and not any(lays_out(m) for m in module.modules()):
        return module
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}  # shared, not copied
    for m in linears:
        for t in (m.weight, m.bias):
            if t is not None:
                memo[id(t)] = nn.Parameter(t.detach().to(dtype), requires_grad=False)
    copied = copy.deepcopy(module, memo)
    for m in copied.modules():
        if lays_out(m):
            m.register_buffer("conv_ch_taps", m.conv_ch.weight.detach().permute(2, 0, 1).contiguous(),
                              persistent=False)
    return copied


@dataclass
class _Op:
    kind: str  # "embed", "route", "enter", "unit", "moe" or "head" (benchmarks/decode_profile.py groups by it)
    run: Callable[[], torch.Tensor | None]  # a decision returns its mask [B, 1]: some row's token entered if any
    decides: bool = False
    skip_to: int = -1  # a decision's next op when no token entered: the first after its block's units

    @property
    def unit(self) -> bool:  # runs a routed unit (counted in DecodeStep.unit_calls)
        return self.kind == "unit"


class DecodeStep:
    """One-token decoding step on fixed input buffers (token, position): ``step(ids [B, 1], position)``
    returns the logits [B, V] of the new tokens, overwritten by the next call. Positions are consumed in
    order, each once per cache (the conv and value-shift states advance with every token).

    ``compiled``: every unit runs one compiled ``run_cached_unit`` and every router one compiled
    ``decide_entries`` (``compiled_decode_unit``, ``compiled_decode_decision``). ``graphed`` (CUDA): the
    ops between two decisions replay as one CUDA graph each; the first call runs every op eagerly (and
    compiles), the second captures the segments. ``device_decisions`` (with ``graphed``; default: where
    ``graph_conditionals`` can build IF nodes): the segments form one graph that decides on the device.
    ``unit_calls`` counts the units run so far (with device decisions, counted on the device and read when
    asked), ``readbacks`` the decisions read back to the host.
    """

    def __init__(self, model, caches: list, batch: int, device: torch.device, graphed: bool, compiled: bool,
                 device_decisions: bool | None = None):
        device = torch.device(device)
        self.device, self.graphed = device, graphed
        reason = graph_conditionals.unavailable_reason(device) if graphed else "the step is not graphed"
        if device_decisions and reason is not None:
            raise ValueError(f"device_decisions=True needs CUDA graph IF nodes, unavailable here: {reason}")
        self.device_decisions = reason is None if device_decisions is None else device_decisions
        self._decisions_asked = bool(device_decisions)
        self.length = caches[0][0][0].k.shape[2]  # positions the caches hold
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._behind, self._behind_most = None, 0  # rows behind the longest prompt's (set_prompt_lengths)
        self._autocast_state = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
        weight = model.embed.weight
        self.x = torch.zeros(batch, 1, weight.shape[1], dtype=weight.dtype, device=device)  # the residual stream
        self.logits: torch.Tensor | None = None  # allocated by the first call (the head's output dtype)
        self._unit_calls = 0
        self._device_units = torch.zeros((), dtype=torch.long, device=device)  # counted by the composed graph
        self.readbacks = 0  # decisions read back to the host so far
        self._unit = compiled_decode_unit(device) if compiled else run_cached_unit
        self._rope = model.rope
        self._decide = compiled_decode_decision(device) if compiled else decide_entries
        self._kernels = decode_kernels_run(model.config.decode_kernel, device)  # the Triton decode kernels
        self._root_units = 0  # units a composed step runs outside any IF node (counted on the host)
        self._mode = "static" if model.config.static_routing_mode else "causal"
        enabled, dtype = self._autocast_state
        self._cast = lambda m: decode_weights(m, dtype if enabled else None, self._kernels)
        self._lm_head = self._cast(model.lm_head)
        self._ops = self._build(model, caches, batch)
        # A segment runs from its first op to the first decision at or after it (or to the head).
        self._ends, end = [0] * len(self._ops), len(self._ops) - 1
        for i in reversed(range(len(self._ops))):
            end = i if self._ops[i].decides else end
            self._ends[i] = end
        self._units = [sum(op.unit for op in self._ops[i:self._ends[i] + 1]) for i in range(len(self._ops))]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] | None = None
        self._composed: graph_conditionals.ConditionalGraph | None = None
        self._flag = torch.zeros((), dtype=torch.bool, pin_memory=graphed)

    @property
    def unit_calls(self) -> int:
        return self._unit_calls + (int(self._device_units) if self._composed is not None else 0)

    # ------------------------------------------------------------------ the ops
    def _build(self, model, caches: list, batch: int) -> list[_Op]:
        x, mode = self.x, self._mode
        gate_dtype = torch.promote_types(x.dtype, torch.float32)  # the routers' logits and gates
        # What a unit that no router gates takes: every entry, weight 1. Every unit then calls the
        # compiled unit with the same signature (tensors of the same dtypes), so they share one graph.
        self._all = torch.ones(batch, 1, dtype=torch.bool, device=x.device)
        self._one = torch.ones(batch, 1, dtype=gate_dtype, device=x.device)
        ops = [_Op("embed", lambda: x.copy_(model.embed(self.ids)))]
        for i, block in enumerate(model.blocks):
            layers = self._cast(block.layers)  # one copy for the block's depths, as they share the weights
            gates = {j: r for r in block.all_routers() for j in r.depths}
            capacities, fractions = block.depth_capacities(), block.fractions()
            decisions, valid = [], None
            decision = None  # a token-choice router's per-token depths ([B, 1, 1 + R]), set on entry
            if block.depth_router is not None and block._active(block.depth_router):
                decision = torch.zeros(batch, 1, 1 + block.recursions, dtype=gate_dtype, device=x.device)
            for j in range(block.recursions):
                router, weight = gates.get(j), None
                if router is not None and block._active(router):
                    weight = torch.zeros(batch, 1, dtype=gate_dtype, device=x.device)
                    mask = torch.zeros(batch, 1, dtype=torch.bool, device=x.device) if mode == "causal" else None
                    # A token-choice depth's share is not fixed (its fraction is an upper bound): always read.
                    saved = (1 - fractions[j]) ** batch * (block.recursions - j)
                    skips = not router.fixed_k or saved >= MIN_UNITS_SAVED
                    route = self._route_op(router, j, capacities[j], caches[i][j][0].route, valid, mask, weight,
                                           None if j == 0 else decision, reads=mask is not None and skips)
                    ops.append(route)
                    if route.decides:
                        decisions.append(route)
                    if mask is not None:
                        valid = mask
                if j == 0 and decision is not None:
                    ops.append(self._enter_op(block.depth_router, valid, decision))
                ops.append(self._unit_op(block, layers, j, caches[i][j], valid, weight))
            if str(i) in model.moe_blocks:
                moe = model.moe_blocks[str(i)]
                ops.append(_Op("moe", lambda moe=moe: x.copy_(moe(x, jitter=False)[0])))
            for route in decisions:
                route.skip_to = len(ops) - (1 if str(i) in model.moe_blocks else 0)
        ops.append(_Op("head", lambda: self._head(model)))
        return ops

    def _route_op(self, router, j: int, capacity: float, state, valid, mask, weight, decision, reads: bool) -> _Op:
        """``reads``: the step reads back whether some row's token entered (else its units run masked)."""
        x, pos, decide, mode = self.x, self.pos, self._decide, self._mode
        if self._kernels and mask is not None and isinstance(router, ExpertChoiceRouter):
            from ..kernels.route_decode import route_decode  # imports Triton: only where the kernel runs

            def route():
                route_decode(router, x, valid, pos, capacity, RANK_PRIOR, state, weight, mask)
                return mask if reads else None
        else:
            def route():
                decide(router, x, valid, mode, j, decision, state, capacity, pos, weight, mask)
                return mask if reads else None

        return _Op("route", route, decides=reads)

    def _enter_op(self, router, valid, decision) -> _Op:
        x, mode = self.x, self._mode
        return _Op("enter", lambda: decision.copy_(router.enter(x, valid, mode)[0]))

    def _unit_op(self, block, layers, j: int, caches, valid, weight) -> _Op:
        x, pos = self.x, self.pos

        def unit():
            # The recursion embedding as the training path takes it (a view from unbind): the same guards.
            rec = None if block.rec_emb is None else block.rec_emb.unbind(0)[j]
            self._unit(layers, x, rec, pos, self._rope, caches, self._all if valid is None else valid,
                       self._one if weight is None else weight)  # updates x in place

        return _Op("unit", unit)

    def _head(self, model) -> None:
        logits = self._lm_head(model.norm(self.x[:, -1]))
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)

    # ------------------------------------------------------------------ running
    def set_prompt_lengths(self, lengths: torch.Tensor | None) -> None:
        """Prompts of several lengths (``lengths`` [B] on the CPU; None: one length): from now on a call's
        ``position`` is the longest prompt's row's, and each other row runs as many positions behind it as its prompt
        is shorter. Kept on the device, so a step's positions cost no host-to-device copy (from pageable memory
        that copy would wait for the previous step)."""
        if lengths is None:
            self._behind, self._behind_most = None, 0
            return
        if lengths.shape != (self.pos.shape[0],) or lengths.device.type != "cpu":
            raise ValueError(f"prompt lengths must be a CPU tensor of {self.pos.shape[0]} values, one per row; got "
                             f"{tuple(lengths.shape)} on {lengths.device}")
        behind = lengths.max() - lengths
        self._behind, self._behind_most = behind.view(-1, 1).to(self.pos.device), int(behind.max())

    def __call__(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """``ids`` [B, 1] at ``position`` (with ``set_prompt_lengths``, the longest prompt's row's position)."""
        if not 0 <= position - self._behind_most <= position < self.length:
            raise ValueError(f"decode step: position {position} is outside the caches' {self.length} positions"
                             + (f" (or a row {self._behind_most} behind it)" if self._behind_most else "")
                             + "; allocate longer caches (HydraModel.init_cache)")
        self.ids.copy_(ids)
        self.pos.fill_(position)
        if self._behind is not None:
            self.pos.sub_(self._behind)
        if self.graphed and self._graphs is None and self._composed is None and self.logits is not None:
            self._capture_step()
        if self.logits is None:  # the first call: every op, in order (compiles what every segment runs)
            self._run_all()
            return self.logits
        if self._composed is not None:
            self._composed.launch()
            self._unit_calls += self._root_units
            return self.logits
        i = 0
        while i < len(self._ops):
            end = self._ends[i]
            self._unit_calls += self._units[i]
            entered = self._run_segment(i)
            op = self._ops[end]
            self.readbacks += op.decides
            i = end + 1 if not op.decides or entered else op.skip_to
        return self.logits

    def autocast(self):
        """The autocast the step was built under, without its weight cache: the cache would hold tensors across a
        graph capture."""
        enabled, dtype = self._autocast_state
        return torch.autocast(self.device.type, dtype=dtype, enabled=enabled, cache_enabled=False)

    def _run_all(self) -> None:
        # On the model's device, whichever is current: a stream of another device would order nothing here.
        side = torch.cuda.Stream(self.device) if self.graphed else None
        if side is not None:  # warm-up away from the default stream, as a later capture requires
            side.wait_stream(torch.cuda.current_stream(self.device))
        with (torch.cuda.stream(side) if side is not None else nullcontext()), self.autocast():
            for op in self._ops:
                op.run()
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        self._unit_calls += sum(op.unit for op in self._ops)

    def _run_segment(self, i: int) -> bool:
        """Run the ops of the segment starting at ``i``; whether its closing decision let a token in."""
        if self._graphs is not None:
            graph, flag = self._graphs[i]
            graph.replay()
            if flag is None:
                return True
            torch.cuda.current_stream(self.device).synchronize()  # the replay's stream: the flag's copy is on it
            return bool(self._flag)
        with self.autocast():
            entered = self._run_ops(i)
        return entered is None or bool(entered.any())

    def _run_ops(self, i: int) -> torch.Tensor | None:
        """The ops of the segment starting at ``i``; its closing decision's mask (None: no decision)."""
        end = self._ends[i]
        for op in self._ops[i:end]:
            op.run()
        return self._ops[end].run()

    def _capture_step(self) -> None:
        with torch.cuda.device(self.device):  # captures on the model's device, whichever is current
            if self.device_decisions:
                try:
                    return self._compose()
                except RuntimeError as err:  # the bindings, NVRTC or the driver refused an IF node
                    if self._decisions_asked:
                        raise
                    warnings.warn(f"decode step: CUDA graph IF nodes could not be built ({err}); the decisions are "
                                  "read back to the host instead (device_decisions=False skips trying)", stacklevel=3)
                    self.device_decisions = False
            self._capture()

    def _capture(self) -> None:
        """One CUDA graph per segment start (the first op, and each op after a decision or a skip), all
        in one memory pool: they replay one at a time in stream order, and everything that lives from
        one segment to the next is in buffers allocated outside them."""
        starts = sorted({0} | {i + 1 for i, op in enumerate(self._ops) if op.decides}
                        | {op.skip_to for op in self._ops if op.decides})
        pool = torch.cuda.graph_pool_handle()
        graphs = {}
        torch.cuda.synchronize()
        for i in starts:
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=pool), self.autocast():
                entered = self._run_ops(i)
                if entered is not None:
                    self._flag.copy_(entered.any(), non_blocking=True)
            graphs[i] = (graph, entered)
        self._graphs = graphs

    def composition(self, i: int = 0, stop: int | None = None) -> list[tuple[int, int, list | None]]:
        """The composed step's layout over ops ``i``..``stop - 1``: (first op, last op, guarded) per segment,
        ``guarded`` the layout of the ops an IF node on the last op's decision runs (to its block's end),
        or None where the segment ends in no decision. Walked with every decision's outcome it runs the ops
        the read-back loop of ``__call__`` runs, in its order."""
        stop = len(self._ops) if stop is None else stop
        layout = []
        while i < stop:
            end = min(self._ends[i], stop - 1)
            op = self._ops[end]
            if op.decides:
                layout.append((i, end, self.composition(end + 1, op.skip_to)))
                i = op.skip_to
            else:
                layout.append((i, end, None))
                i = end + 1
        return layout

    def _compose(self) -> None:
        """One graph for the whole step: each decision's mask sets an IF node whose body holds the ops it guards
        (to its block's end, nested decisions inside), captured as segments in one memory pool in the order of a
        step that enters every unit. A skipped body leaves its segments' memory unused, as the read-back path's
        skipped replays do. The units a step runs (``unit_calls``): those outside every IF node counted on the
        host, each IF node's own on the device by its condition kernel."""
        pool = torch.cuda.graph_pool_handle()
        composed = graph_conditionals.ConditionalGraph(self.device)
        torch.cuda.synchronize()

        def segment(i: int, end: int):  # ops i..end as one captured graph; what a closing decision returned
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with capture(graph, pool=pool), self.autocast():
                for op in self._ops[i:end]:
                    op.run()
                entered = self._ops[end].run()
            return graph, entered

        def units(plan) -> int:  # the units of a plan's own segments, not those under its IF nodes
            return sum(op.unit for start, end, _ in plan for op in self._ops[start:end + 1])

        def add(body, plan) -> None:
            for start, end, guarded in plan:
                graph, entered = segment(start, end)
                composed.add(graph, body)
                if guarded is not None:
                    add(composed.add_if(entered, body, counter=(self._device_units, units(guarded))), guarded)

        plan = self.composition()
        add(None, plan)
        composed.instantiate()
        self._composed, self._root_units = composed, units(plan)
