"""A transformer layer, and the recursive block that routes tokens through it (MoD + MoR).

A recursive block owns a stack of layers applied R times with shared weights. Depth j is a
*routed unit*: it runs the stack on a subset of the tokens active at depth j-1 (depth 0 picks from
the whole row; that choice is Mixture-of-Depths), adds a learned recursion embedding to the stack's
input, and writes ``weight * (stack(u) - u)`` back into the residual stream. Tokens are gathered
once per depth and kept compacted across deeper depths (a nested gather), then scattered back.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import HydraConfig
from .attention import AttentionCache
from .doc_attention import Documents, documents, documents_end_to_end, documents_for
from .layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from .routing import Router, Selection, build_routers, pass_through


class TransformerLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP."""

    def __init__(self, dim: int, mlp_hidden: int, attention: nn.Module, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = attention
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = SwiGLUMLP(dim, mlp_hidden)

    def forward(self, x, pos, rope: RotaryEmbedding, cache: AttentionCache | None = None, valid=None, doc=None):
        x = x + self.attn(self.attn_norm(x), pos, rope, cache, valid, doc)
        return x + self.mlp(self.mlp_norm(x))


def run_unit(layers: nn.ModuleList, xc, rec, pos, rope, caches, valid, doc, weight):
    """One routed unit: the layer stack on the unit's tokens ``xc`` (plus the recursion embedding
    ``rec``), written back as ``xc + weight * (stack(u) - u)`` for valid entries. A free function
    of its inputs, so ``train.compile_policy.compile_units`` compiles it once for every block and depth."""
    u = xc if rec is None else xc + rec.to(xc.dtype)
    h = u
    for i, layer in enumerate(layers):
        h = layer(h, pos, rope, None if caches is None else caches[i], valid, doc)
    delta = h - u
    if weight is not None:
        delta = delta * weight[..., None].to(delta.dtype)
    if valid is not None:
        delta = torch.where(valid[..., None], delta, torch.zeros_like(delta))
    return xc + delta


def run_cached_unit(layers: nn.ModuleList, xc, rec, pos, rope, caches, valid, weight):
    """``run_unit`` on new tokens ``xc`` appended to the unit's ``caches``, the result written back into
    ``xc`` (the decode step keeps its residual stream in one buffer): what the decode step runs for every unit
    (``decode_step.DecodeStep``, compiled by ``decode_step.compiled_decode_unit``). A function of its own
    so that its compiled graphs and recompile count are separate from the training units'
    (``compile_policy.compile_units``)."""
    xc.copy_(run_unit(layers, xc, rec, pos, rope, caches, valid, None, weight))


def run_prefill_block(block: "RecursiveBlock", x, pos, rope, mode: str, caches, valid=None):
    """A block's prefill of a prompt (``RecursiveBlock.route_and_run`` with ``caches``: the entries appended to the
    units' caches, the routers' decode states written) as a free function of its inputs, so that
    ``decode_step.compiled_prefill`` compiles it once for all blocks of one layout, the prompt's length a symbol
    (every length shares the graph; a second batch size compiles once more, the batch then a symbol too). Compiled,
    every unit runs on all of its candidates, the ones its router did not admit masked: no host sync to cut them
    (``_admitted_prefix``), so the block is one call."""
    return block.route_and_run(x, pos, rope, mode, caches, valid=valid)


def _row_index(order: torch.Tensor, width: int) -> torch.Tensor:
    return order[..., None].expand(-1, -1, width)


def _gather_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return x.gather(1, order if x.dim() == 2 else _row_index(order, x.shape[-1]))


class _TakeRows(torch.autograd.Function):
    """(stream [B, N, E], order [B, k]) -> (the rows ``order`` picks, the stream for ``_PutRows``).

    With ``_PutRows`` it is gather -> unit -> scatter whose backward writes the stream's gradient once:
    the incoming gradient with the routed rows replaced by theirs (the stream aliased through ``_PutRows``,
    whose backward passes its gradient on whole). Plain gather and scatter would zero the scattered rows
    in a copy of the gradient, scatter the gathered rows' gradient into a zeroed [B, N, E] tensor, and add
    the two: three full-size writes per routed depth instead of one (issue 14)."""

    @staticmethod
    def forward(ctx, stream, order):
        ctx.save_for_backward(order)
        return stream.gather(1, _row_index(order, stream.shape[-1])), stream.view_as(stream)

    @staticmethod
    def backward(ctx, grad_rows, grad_stream):
        # Autograd hands zeros for an output that reached no loss (materialize_grads), never None.
        (order,) = ctx.saved_tensors
        return grad_stream.scatter(1, _row_index(order, grad_stream.shape[-1]), grad_rows), None


class _PutRows(torch.autograd.Function):
    """The stream (``_TakeRows``' second output) with the rows ``order`` picks replaced by ``rows``. Its
    backward hands the stream's gradient on whole: the rows it replaced are overwritten by ``_TakeRows``."""

    @staticmethod
    def forward(ctx, stream, order, rows):
        ctx.save_for_backward(order)
        return stream.scatter(1, _row_index(order, stream.shape[-1]), rows)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad, None, grad.gather(1, _row_index(order, grad.shape[-1]))


def _rows_apart(ids: torch.Tensor | None, rows: int, n: int, device) -> torch.Tensor:
    """The document ids of ``rows`` rows of ``n`` entries laid end to end ([1, rows * n]; ``ids`` [rows, n],
    None: one document per row), each row's moved past the previous row's so that no two rows share one."""
    if ids is None:
        return torch.arange(rows, device=device)[:, None].expand(rows, n).reshape(1, -1)
    return documents_end_to_end(ids)


def _admitted_prefix(sel: Selection) -> Selection:
    """Causal routing (evaluation, the eager prefill) admits a varying number of candidates per row, so its
    selection keeps all of them, admitted ones first in causal order. Outside compiled and captured code
    the entries after every row's last admitted one are dropped here: no admitted entry reads them (they
    come later), their update is masked to zero, and they make up most of a deep unit's work (the 100M
    preset's deepest units admit under 1% of their candidates). Costs one host sync per router. The kept
    length is rounded up to a power of two, at least 16: a compiled unit then sees a few lengths, none
    small enough to be specialized on (a length of 2 equal to the recursions compiled a graph of its own)."""
    if torch.compiler.is_compiling() or (sel.valid.is_cuda and torch.cuda.is_current_stream_capturing()):
        return sel
    n = sel.valid.shape[1]
    keep = min(n, max(16, 1 << (int(sel.valid.sum(1).max()) - 1).bit_length()))
    if keep == n:
        return sel
    def cut(t):  # contiguous: a compiled unit guards on its inputs' strides
        return None if t is None else t[:, :keep].contiguous()
    return Selection(cut(sel.order), cut(sel.weight), cut(sel.valid), sel.aux_loss, sel.stats)


def _eval_mask(xc: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
    """What a compiled unit takes as ``valid`` without gradients (evaluation): every entry marked when none is
    masked, the same result as None, so that whole rows and masked causal entries share one graph (None and a
    tensor are two). Training keeps None: no mask to apply."""
    if valid is not None or torch.is_grad_enabled():
        return valid
    return torch.ones(xc.shape[:2], dtype=torch.bool, device=xc.device)


def _run_compiled_unit(unit, layers, xc, rec, pos, rope, valid, doc, weight):
    """A compiled ``run_unit`` on the unit's entries. One entry per row (the deepest depth of a geometric
    schedule, e.g. the 100M preset's 128/16/2/1) would make Dynamo compile the unit again, forward and
    backward, for that size alone (it specialises sizes 0 and 1): a copy of each row's entry follows it
    instead, and only the first entry's result is kept. Causal attention, convs and value shift never let
    an entry read a later one, so the kept result is the unpadded one and the copy's gradient is zero.
    Flex's documents (no mask) attend through the dense mask here: torch 2.11 failed to lower flex at these
    dynamic token counts (doc_attention's module docstring)."""
    if doc is not None and doc.mask is None:
        doc = documents_for(doc.ids, "sdpa", 0, xc.dtype)
    if xc.shape[1] != 1:
        return unit(layers, xc, rec, pos, rope, None, valid, doc, weight)

    def pad(t):
        return None if t is None else torch.cat([t, t], 1)

    valid2 = None if valid is None else torch.cat([valid, torch.zeros_like(valid)], 1)
    doc2 = None if doc is None else doc.gather(torch.zeros_like(pos).expand(-1, 2))
    # contiguous: a later router's compiled selection guards on its input's strides
    return unit(layers, pad(xc), rec, pad(pos), rope, None, valid2, doc2, pad(weight))[:, :1].contiguous()


class RecursiveBlock(nn.Module):
    """A stack of layers recursed ``len(depth_fractions)`` times on routed tokens.

    ``depth_fractions[j]`` is the fraction of the row processed at depth j (non-increasing); which
    router gates which depth is ``routing.build_routers``' decision.
    """

    def __init__(self, layers: list[nn.Module], depth_fractions: list[float], config: HydraConfig,
                 name: str = "block"):
        super().__init__()
        dim = layers[0].attn_norm.weight.shape[0]
        self.layers = nn.ModuleList(layers)
        self.depth_fractions = list(depth_fractions)
        self.recursions = len(depth_fractions)
        self.name = name
        if any(b > a + 1e-9 for a, b in zip([1.0, *self.depth_fractions], self.depth_fractions)):
            raise ValueError(f"{name}: depth fractions must not increase, got {self.depth_fractions}")
        self.rec_emb = nn.Parameter(torch.zeros(self.recursions, dim)) if self.recursions > 1 else None
        # Two attributes, not one list: their names are the checkpoints' state-dict keys.
        self.routers, self.depth_router = build_routers(config, dim, self.depth_fractions)
        # Curriculum switches (training schedule): an inactive router lets every candidate through
        # with weight 1, so MoD-off is a dense block and MoR-off is fixed full depth.
        self.mod_active = True
        self.mor_active = True
        # The MoR ramp: 0 runs every block-entering token at every depth, 1 the configured fractions.
        self.mor_ramp = 1.0
        self.compiled_unit = None  # compile_policy.compile_units: a compiled run_unit, shared by all blocks
        self.compiled_select = None  # compile_policy.compile_units: a compiled routed_selection, likewise
        self.compiled_block = None  # compile_policy.compile_units: a compiled run_block (training forwards)
        # The entries of a top-k over the batch (HydraConfig.topk_over) attend as one row, rows as documents.
        self.doc_layout = (config.doc_mask_backend, config.head_dim)

    # ------------------------------------------------------------------ routers
    def all_routers(self) -> list[Router]:
        return [*self.routers.values(), *([] if self.depth_router is None else [self.depth_router])]

    def router_depths(self) -> list[tuple[str, int]]:
        """(router name, depth it gates), in the order of the block's routing statistics."""
        return [(name, j) for r in self.all_routers() for name, j in zip(r.names(self.name), r.depths)]

    def router_names(self) -> list[str]:
        return [name for name, _ in self.router_depths()]

    def _active(self, router: Router) -> bool:
        return self.mod_active if router.kind == "mod" else self.mor_active

    # ------------------------------------------------------------------ static bookkeeping
    def fractions(self) -> list[float]:
        """Fraction of the row each depth runs on now: the configured ones, moved by the MoR ramp. With MoR off
        every depth runs the block's entries; with MoD off the row enters whole and each depth keeps its share
        of the previous depth's tokens, as the causal capacities and the trainer's FLOP count have it."""
        entry = self.depth_fractions[0]
        fractions = list(self.depth_fractions)
        if not self.mor_active:
            fractions = [entry] * len(fractions)
        elif self.mor_ramp != 1.0:
            fractions = [entry] + [entry + self.mor_ramp * (frac - entry) for frac in fractions[1:]]
        return fractions if self.mod_active else [frac / entry for frac in fractions]

    def tokens_per_depth(self, seq_len: int) -> list[int]:
        """Tokens per row that each depth runs on in top-k mode (token-choice depths: an upper bound)."""
        fixed = {j for r in self.all_routers() if r.fixed_k for j in r.depths}
        counts, previous = [], seq_len
        for j, frac in enumerate(self.fractions()):
            if j in fixed:
                previous = min(previous, max(1, round(frac * seq_len)))
            counts.append(previous)
        return counts

    def depth_capacities(self) -> list[float]:
        """Share of its candidates that each depth keeps (its fraction of the row over the previous
        depth's): the causal rank rule's targets."""
        fractions = self.fractions()
        return [frac / previous for frac, previous in zip(fractions, [1.0, *fractions])]

    def new_caches(self, batch: int, length: int, device, dtype) -> list[list[AttentionCache]]:
        caches = [[layer.attn.new_cache(batch, length, device, dtype) for layer in self.layers]
                  for _ in range(self.recursions)]
        # Expert-choice routers: per position, the candidate's logit and whether it was one
        # (routing.ExpertChoiceRouter.decode_admits).
        for router in self.routers.values():
            for j in router.depths:
                caches[j][0].route = torch.zeros(batch, 2, length, device=device,
                                                 dtype=torch.promote_types(dtype or torch.float32, torch.float32))
        return caches

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: RotaryEmbedding, mode: str,
                caches: list[list[AttentionCache]] | None = None, doc: Documents | None = None,
                prefill: Callable | None = None, valid: torch.Tensor | None = None):
        """Returns (x, {"mod": [losses], "mor": [losses]}, [stats per router]).

        ``doc``: the documents of the positions (``doc_attention.Documents``); attention, convs and value
        shift then stay inside a document (gathered along with the positions when tokens are compacted,
        the mask rebuilt once for each compacted set).
        ``caches``: run the entries as new tokens appended to the units' caches (the prompt's prefill;
        the one-token steps after it run ``decode_step.DecodeStep``); ``prefill``: with ``caches``, the compiled
        ``run_prefill_block`` to run the block as (None: plain code); ``valid`` [B, N], with ``caches``: the entries
        that are tokens of the prompt, first in every row (the rest padding, computed but never stored as valid,
        never a candidate of a router, never advancing a conv or value-shift state)."""
        if self.compiled_block is not None and caches is None and torch.is_grad_enabled() and self.mor_ramp == 1.0:
            return self.compiled_block(self, x, pos, rope, mode, doc)
        if prefill is not None and caches is not None:
            return prefill(self, x, pos, rope, mode, caches, valid)
        return self.route_and_run(x, pos, rope, mode, caches, doc, compiled=True, valid=valid)

    def route_and_run(self, x, pos, rope, mode: str, caches=None, doc=None, compiled: bool = False, valid=None):
        """``forward``'s work; ``compiled``: call the compiled unit and selection where they are set
        (False: everything as plain code, which ``run_block`` hands to the compiler whole)."""
        seq_len = x.shape[1]
        counts = self.tokens_per_depth(seq_len)
        capacities = self.depth_capacities() if mode == "causal" else None
        losses: dict[str, list[torch.Tensor]] = {"mod": [], "mor": []}
        stats: list[torch.Tensor] = []
        parents: list[tuple[torch.Tensor, torch.Tensor]] = []
        xc, pc, vc = x, pos, valid
        decision = None  # per-entry routing state a router decided on entry (Router.enter)

        routers = self.all_routers()
        # Without gradients (evaluation) the selections run eager: each routing mode's compiled selection is a
        # graph of its own to compile at the first evaluation, for kernels that take a small share of its time.
        select = self.compiled_select if compiled and caches is None and torch.is_grad_enabled() else None
        unit = self.compiled_unit if compiled and caches is None else None
        gates = {j: r for r in routers for j in r.depths}
        # One view per depth from one op: backward stacks the depths' gradients once, where indexing per
        # depth would write each into a zeroed [R, E] tensor and add the R of them.
        recs = None if self.rec_emb is None else self.rec_emb.unbind(0)
        rows = 1  # rows laid end to end in each entry row: x.shape[0] // topk_groups after a top-k over the batch
        for j in range(self.recursions):
            router, sel = gates.get(j), None
            ids = None if doc is None else doc.ids
            if router is not None and not self._active(router):
                sel = pass_through(xc, vc, seq_len * rows)
            elif router is not None:
                state = None if caches is None else caches[j][0].route
                capacity = None if capacities is None else capacities[j]
                k, row_len = counts[j] * rows, seq_len * rows
                if select is None:
                    sel = router.select(xc, vc, k, mode, row_len, depth=j, decision=decision, state=state,
                                        capacity=capacity, doc=ids, pos=pc)
                else:  # compiled: with gradients only (a MoR ramp in training), so never an evaluation's mask
                    sel = Selection(*select(router, xc, vc, k, mode, row_len, j, decision, state, capacity, ids, pc))
                if sel.aux_loss is not None:
                    losses[router.kind].append(sel.aux_loss)
            if sel is not None:
                stats.append(sel.stats)
                if mode == "causal" and sel.order is not None and sel.valid is not None:
                    sel = _admitted_prefix(sel)
                if sel.order is not None:
                    shape = None
                    if sel.order.shape[0] < xc.shape[0]:  # a top-k over the batch: each group's rows as one row
                        groups = sel.order.shape[0]
                        shape, rows = xc.shape, xc.shape[0] // groups * rows
                        ids = _rows_apart(ids, xc.shape[0], xc.shape[1], xc.device).reshape(groups, -1)
                        ids = ids.gather(1, sel.order)
                        doc = documents_for(ids, *self.doc_layout, xc.dtype) if doc is None else \
                            documents(ids, None if doc.mask is None else doc.mask.dtype)
                        xc, pc = xc.reshape(groups, -1, xc.shape[-1]), pc.reshape(groups, -1)
                        vc = None if vc is None else vc.reshape(groups, -1)
                    elif doc is not None:
                        doc = doc.gather(sel.order)
                    entries, stream = _TakeRows.apply(xc, sel.order)
                    parents.append((stream, sel.order, shape))
                    xc, pc = entries, pc.gather(1, sel.order)
                    if decision is not None:
                        decision = _gather_rows(decision, sel.order)
                vc = sel.valid
            if j == 0:  # the entries of the block's first unit: routers deciding once per block
                for r in routers:
                    if self._active(r):
                        d, loss = r.enter(xc, vc, mode)
                        decision = d if d is not None else decision
                        if loss is not None:
                            losses[r.kind].append(loss)

            rec = None if recs is None else recs[j]
            weight = None if sel is None else sel.weight
            if mode == "topk" and router is not None and router.gates_entries and sel.order is not None:
                weight = router.entry_gate(xc)
            if unit is not None:
                if weight is None:  # weight 1, exactly, and like a gate's: every unit shares one graph
                    weight = xc.new_ones(xc.shape[:2], dtype=torch.float32, requires_grad=torch.is_grad_enabled())
                xc = _run_compiled_unit(unit, self.layers, xc, rec, pc, rope, _eval_mask(xc, vc), doc, weight)
            else:
                xc = run_unit(self.layers, xc, rec, pc, rope, None if caches is None else caches[j], vc, doc, weight)

        for stream, order, shape in reversed(parents):
            xc = _PutRows.apply(stream, order, xc)
            if shape is not None:
                xc = xc.reshape(shape)
        return xc, losses, stats


def run_block(block: RecursiveBlock, x, pos, rope, mode: str, doc):
    """A block's training forward (``RecursiveBlock.route_and_run`` without caches) as a free function of its
    inputs, so that ``train.compile_policy.compile_units`` compiles it once for all blocks of one layout:
    the routing between the units (gathers, scatters, router losses) then fuses with them, and autograd
    sums each shared weight's gradient over the recursions inside the compiled backward."""
    return block.route_and_run(x, pos, rope, mode, None, doc)
