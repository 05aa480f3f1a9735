"""Token routing shared by MoD and MoR: expert-choice top-k with a FIXED k, causal mode (rank among
earlier candidates, calibrated threshold at a row's start), static (soft) mode, and token-choice
depth routing.

A routing variant is a ``Router`` subclass; ``build_routers`` is the one place that decides, from the
``HydraConfig``, which router gates which depth of which block. ``RecursiveBlock`` only asks routers
for selections, whatever their kind.

Causal routing (generation, and the causal eval) cannot see a row's later tokens, so it cannot take
the row's top-k. It takes top-k's rule over the past instead (``rank_admits``, ``rank_decision``): a
candidate enters the unit iff less than the unit's capacity share of what came before it ranks above it
by router logit. A rank holds the admitted share at the capacity whatever the logits do on text unlike
the training batches, where a threshold drifts with them; in distribution the threshold picks top-k's
tokens better, so it carries the weight of many earlier candidates.

The router's calibrated threshold enters as ``RANK_PRIOR`` pseudo-candidates (``rank_decision``), so
the threshold decides until a document has many more candidates than that, and their rank after.
The threshold is a running mean over training batches of the logit separating a batch's top-k from
the rest (top-k ignores a shift of all logits, so they drift freely in training and a fixed
threshold such as r > 0 would admit a share unrelated to the capacity). The logit is compared raw, not
relative to a level such as the mean of the document's earlier logits: a level moved by the very low
logits that later routers give tokens an earlier unit already ran ranked tokens by noise, and on a
grid of 18 routing settings at 100M no level beat the raw logit (docs/routing.md). Everything is
causal, so decoding keeps it exactly: each routed unit's cache holds, per position, the candidate's
logit (``AttentionCache.route``). The studies behind the rule are in docs/routing.md.

Every function here keeps shapes static (k is a Python int derived from the sequence length), so a
routed training step has no host synchronisation and compiles with ``fullgraph=True``.

A selection works on candidate entries ``x`` [B, N, E] (the tokens still active) and returns:
``order`` [B, M] indices into the candidates (sorted so causal order is kept), ``weight`` [B, M]
multiplying the unit's residual update, and ``valid`` [B, M] (None = all valid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HydraConfig

ROUTING_MODES = ("topk", "causal", "static")

# Decay of the threshold's running mean per training forward: a window of about 20 micro-batches
# follows the logits' drift while averaging out the batch-to-batch noise of the boundary.
THRESHOLD_DECAY = 0.95
# State-dict names of the threshold buffers: checkpoints written before calibration existed lack them
# and still load (threshold 0 until training calibrates it).
THRESHOLD_BUFFERS = ("threshold_sum", "threshold_weight")
# Causal rank rule: the calibrated threshold counts as this many pseudo-candidates beside the row's
# earlier candidates, so the threshold decides a document's first candidates and their rank after. 256:
# on the 19-setting grid at 100M (GPU, 1,024-token rows) its worst causal/top-k gap is +0.0096 against
# +0.0537 at 64 and +0.1036 at 16 (capacity 0.125 on every block with 2 or 4 recursions), and it has the
# lowest gap in 16 of 19 settings. Lighter weights agree with top-k on more decisions (96.2% at 16 against
# 95.6%), as on the CPU grid, where 16 also had the lower gaps: that evidence does not carry. With the first
# block unrouted, 16 breaks no setting but gives a higher causal loss in all 19 (docs/routing.md).
RANK_PRIOR = 256.0


@dataclass
class Selection:
    order: torch.Tensor | None  # None: every candidate, in place
    weight: torch.Tensor | None  # None: weight 1, or (top-k, Router.gates_entries) the block's entry_gate
    valid: torch.Tensor | None  # None: all entries are real tokens of the unit
    aux_loss: torch.Tensor | None  # router loss (BCE for expert-choice); None: adds no loss term
    # [3]: fraction of the row executed, mean gate, the causal rule's agreement with top-k (NaN: router switched off)
    stats: torch.Tensor


class Router(nn.Module):
    """What a recursive block asks of a router; a new routing variant implements this.

    A router gates the block's ``depths``: at each, ``select`` picks which candidate entries run the
    unit, in which order and with what weight. ``kind`` ("mod" or "mor") is the curriculum switch that
    turns it off (its depths then let every candidate through with weight 1) and the loss its
    ``aux_loss`` counts in. ``fixed_k``: in top-k mode it takes exactly k entries per row (the block's
    compute accounting), otherwise k is an upper bound. ``enter`` runs once on the entries of the
    block's first unit and may return a per-entry ``decision`` (gathered along with the tokens and
    handed back to ``select``) and a loss.
    """

    kind: str
    depths: tuple[int, ...]
    fixed_k: bool
    # Top-k selections leave ``weight`` None and the block gates the gathered entries with ``entry_gate``.
    gates_entries: bool = False

    def entry_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The gate [B, k] of entries ``x`` [B, k, E] a top-k selection chose (``gates_entries`` routers)."""
        raise NotImplementedError

    def names(self, block: str) -> list[str]:
        return [f"{block}.{self.kind}{j}" for j in self.depths]

    def enter(self, x: torch.Tensor, valid: torch.Tensor | None, mode: str):
        return None, None

    def decide_new(self, x: torch.Tensor, valid: torch.Tensor | None, mode: str, depth: int,
                   decision: torch.Tensor | None, state: torch.Tensor | None, capacity: float | None,
                   pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decision on a decode step's new entries ``x`` [B, n, E] in their own order, as a causal or
        static ``select`` with the decode ``state`` takes it before ordering: (gate [B, n], admitted [B, n]
        bool, not yet masked by ``valid``; None in static mode, where every entry runs weighted by its
        gate). One entry per row needs no order, so the decode step takes this alone
        (``decode_step.decide_entries``)."""
        raise NotImplementedError

    def select(self, x: torch.Tensor, valid: torch.Tensor | None, k: int, mode: str, row_len: int,
               depth: int = 0, decision: torch.Tensor | None = None, state: torch.Tensor | None = None,
               capacity: float | None = None, doc: torch.Tensor | None = None,
               pos: torch.Tensor | None = None) -> Selection:
        """``state``: the router's decode state of this depth (``AttentionCache.route``), None without a cache.
        ``capacity``: the share of this depth's candidates that top-k takes on a long row (the causal
        rule's target, the same however many tokens a decode call brings; default ``k / x.shape[1]``).
        ``doc`` [B, N]: the candidates' documents; causal statistics then look inside a document only.
        ``pos`` [B, N]: the candidates' positions (with ``state``: where the decode state keeps them)."""
        raise NotImplementedError


class ExpertChoiceRouter(Router):
    """Scalar router logit r = w^T x + b; gate = scale * sigmoid(r). Top-k of the candidates in training,
    the calibrated threshold causally, every candidate weighted by its gate in static mode.

    At depth 0 it is the block's MoD router (its loss counts in ``aux_loss``), deeper an MoR router
    (``ponder_loss``). The causal threshold is kept as a bias-corrected running mean
    (``threshold_sum / threshold_weight``) in buffers, so it is saved and restored with the weights;
    before any training batch it is 0.
    """

    fixed_k = True
    # The language-model loss reaches the router through the gates of the k chosen entries only. Taken
    # from all N logits and gathered, its backward would write an [B, N, E] input gradient, zero but for
    # k rows, and add it into the residual stream's (about 1 GB of traffic per MoD router at batch 64 x
    # 1024); taken of the gathered entries, their gradient joins the gather's own (issue 14).
    gates_entries = True

    def __init__(self, dim: int, depth: int, gate_scale: float = 1.0, over_batch: bool = False,
                 causal_choice: bool = False, groups: int = 1):
        super().__init__()
        self.causal_choice = causal_choice
        self.depths = (depth,)
        # Top-k of the batch's logits (HydraConfig.topk_over "batch"): the selection's order then indexes the
        # batch's rows laid end to end ([1, rows * k]), and the block runs the units on them as one row.
        # ``causal_choice`` ("causal"): that top-k ranks the causal rule's admissions first.
        self.over_batch = over_batch
        # ... of each of ``groups`` groups of the rows instead (HydraConfig.topk_groups): [groups, rows * k / groups].
        self.groups = groups
        self.kind = "mod" if depth == 0 else "mor"
        # A tensor, not a Python float: a compiled selection would guard on the float's value and compile
        # the MoD routers (scale 1) and the MoR routers apart. Fixed by the config, so not saved.
        self.register_buffer("gate_scale", torch.tensor(float(gate_scale)), persistent=False)
        self.proj = nn.Linear(dim, 1)
        self.register_buffer("threshold_sum", torch.zeros((), dtype=torch.float32))
        self.register_buffer("threshold_weight", torch.zeros((), dtype=torch.float32))

    def _groups_of(self, rows: int) -> int:
        groups = min(self.groups, rows)
        if rows % groups:
            raise ValueError(f"topk_groups={self.groups} pools the batch's rows in equal groups: a batch of {rows} "
                             "rows does not split so; use a batch size that it divides, or another topk_groups")
        return groups

    def threshold(self) -> torch.Tensor:
        w = self.threshold_weight
        return torch.where(w > 0, self.threshold_sum / w.clamp(min=1e-12), torch.zeros_like(w))

    @torch.no_grad()
    def calibrate(self, r: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold the top-k boundary of one batch's candidate logits ``r`` [B, N] into the running threshold,
        in place: no host sync, and a captured CUDA graph replays it. Returns (the boundary, the threshold
        after the update): what a top-k step reads next."""
        boundary = topk_boundary(r, k)
        # Each buffer: x * decay + (1 - decay) * new value. Plain ops: with a _foreach_mul_ over both
        # buffers followed by their adds, torch 2.11's inductor failed on CUDA while reordering loops
        # ("assert isinstance(snode, SchedulerNode)", which a multi-tensor node's fused parts fail;
        # pytorch/pytorch#176591); this form compiles there (benchmarks/BENCHMARKS.md, nineteenth session).
        self.threshold_sum.mul_(THRESHOLD_DECAY).add_(boundary.to(self.threshold_sum.dtype), alpha=1 - THRESHOLD_DECAY)
        self.threshold_weight.mul_(THRESHOLD_DECAY).add_(1 - THRESHOLD_DECAY)
        return boundary, self.threshold_sum / self.threshold_weight  # the weight is >= 1 - decay now

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints of the former rule (revisions up to b7b9c10) calibrated the threshold on logits
        # relative to a level near the running mean logit they saved as center_*: the raw-logit threshold
        # is about that threshold plus the center. Training recalibrates it within ~20 steps either way.
        center_sum = state_dict.pop(prefix + "center_sum", None)
        center_weight = state_dict.pop(prefix + "center_weight", None)
        key = prefix + "threshold_sum"
        if center_weight is not None and float(center_weight) > 0 and key in state_dict:
            state_dict[key] = state_dict[key] + center_sum / center_weight * state_dict[prefix + "threshold_weight"]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def decode_admits(self, r: torch.Tensor, valid: torch.Tensor | None, pos: torch.Tensor, capacity: float,
                      state: torch.Tensor) -> torch.Tensor:
        """Causal admission of new candidates at positions ``pos`` [B, n] from the unit's decode state
        ``state`` [B, 2, L] (per position: logit, 1 if a candidate), updated in place; slots are indexed
        by position, like the K/V cache's."""
        v = torch.ones_like(r) if valid is None else valid.to(r.dtype)
        # Both channels in one index_put_, done in place when compiled (a scatter_ would copy the whole state
        # twice, as attention.cached_attention explains), before the read: the new candidates count as
        # earlier ones for the new ones after them.
        at = (torch.arange(r.shape[0], device=r.device)[:, None, None], torch.arange(2, device=r.device)[None, :, None],
              pos[:, None, :])
        state.index_put_(at, torch.stack((r, v), 1).to(state.dtype))
        if capacity >= 1:  # every candidate (rank_decision): no history to read
            return torch.ones_like(r, dtype=torch.bool)
        slots = torch.arange(state.shape[2], device=r.device)
        earlier = (slots[None, None, :] < pos[..., None]) & (state[:, 1, None, :] > 0)  # [B, n, L]
        count = earlier.sum(-1).to(r.dtype)
        above = (earlier & (state[:, 0, None, :] > r[..., None].to(state.dtype))).sum(-1).to(r.dtype)
        return rank_decision(r, above, count, capacity, self.threshold())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # One fp32 (or wider) column as a product and a sum, not a one-column GEMM: autocast casts neither (a
        # GEMM would first copy the whole [B, N, E] fp32 residual stream to bf16, more memory traffic than the
        # product itself), and compiled it is one reduction kernel that fuses with its neighbours, where
        # cuBLASLt ran a split-K GEMM and its reduction (11 us against 1.2 us per decode step's router on an
        # H200, benchmarks/BENCHMARKS.md, thirty-eighth session). No autocast context: none is needed, and one
        # inside a compiled graph is a reason for AOTAutograd not to cache it (seventy-first session).
        dtype = torch.promote_types(x.dtype, torch.float32)
        return (x.to(dtype) * self.proj.weight[0].to(dtype)).sum(-1) + self.proj.bias[0].to(dtype)

    def logits_of_parameters(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``self.logits(x.detach())`` (the logits as a function of the router's weight and bias only)
        from ``r = self.logits(x)``: the same values and gradients without a second matmul over ``x``."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        return _LogitsOfParameters.apply(r, x.detach().to(dtype), self.proj.weight.to(dtype), self.proj.bias.to(dtype))

    def gate(self, r: torch.Tensor) -> torch.Tensor:
        return self.gate_scale.to(r.dtype) * torch.sigmoid(r)

    def entry_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.logits(x))

    def decide_new(self, x, valid, mode, depth, decision, state, capacity, pos):
        r = self.logits(x)
        return self.gate(r), None if mode == "static" else self.decode_admits(r, valid, pos, capacity, state)

    def select(self, x, valid, k, mode, row_len, depth=0, decision=None, state=None, capacity=None,
               doc=None, pos=None) -> Selection:
        # Top-k needs no gradient through the logits: the router loss takes the parameters' alone and the
        # block gates the chosen entries (entry_gate).
        r = self.logits(x.detach() if mode == "topk" else x)
        if mode == "static":
            weight = self.gate(r)
            frac = torch.ones((), device=x.device) if valid is None else valid.float().sum(1).mean() / row_len
            # ``valid`` kept: a padded prompt's padding must not advance the units' caches (decode_session)
            stats = torch.stack((frac, weight.mean(), frac.new_ones(())))
            return Selection(None, weight, valid, r.new_zeros(()), stats)
        if mode == "topk":
            r_fixed = r.detach()
            key = r_fixed
            if self.causal_choice:  # the rule's admissions above every other logit, in their own order
                admits = rank_admits(r_fixed, None, k / x.shape[1], self.threshold(), doc)
                key = torch.where(admits, r_fixed + (r_fixed.amax() - r_fixed.amin() + 1), r_fixed)
            # Over the batch: each group's rows laid end to end as one, so the order is [groups, rows * k / groups]
            # into them. A deeper router finds them pooled already ([groups, ...]); a batch of fewer rows than
            # groups keeps its rows.
            ranked = key.reshape(self._groups_of(key.shape[0]), -1) if self.over_batch else key
            top = torch.topk(ranked, k * r.shape[0] // ranked.shape[0], dim=1, sorted=False).indices
            order = torch.sort(top, dim=1).values
            chosen = torch.zeros_like(ranked).scatter_(1, order, 1.0).view_as(r_fixed)
            mean_gate = self.gate(r_fixed.reshape(ranked.shape).gather(1, order)).mean()
            if self.training:  # the threshold's update gives the boundary too
                boundary, threshold = self.calibrate(r_fixed, k)
            else:
                boundary, threshold = topk_boundary(r_fixed, k), self.threshold()
            # The router learns to predict its own top-k choice relative to the boundary, so that
            # r > threshold reproduces top-k causally. Shift-invariant like top-k itself, it sharpens
            # the separation without fighting the language-model loss over the logits' level.
            # Detached input: this loss trains the router only.
            r_aux = self.logits_of_parameters(x, r)
            aux = F.binary_cross_entropy_with_logits(r_aux - boundary, chosen)
            # Agreement of the causal rule with top-k: in evaluation the rank rule at the top-k's own share k/N
            # (causal mode runs it at the depth's capacity, which differs where k was rounded: a deep unit's 1 or 2
            # tokens a row); in training steps its threshold fallback only (the rank costs [B, N, N] per router).
            if self.training:
                causal = r_fixed > threshold
            else:
                causal = rank_admits(r_fixed, None, k / x.shape[1], threshold, doc)
            agree = (causal.float() == chosen).float().mean()
            frac = torch.full((), k / row_len, device=x.device)
            return Selection(order, None, None, aux, torch.stack((frac, mean_gate, agree)))
        if mode == "causal":
            capacity = k / x.shape[1] if capacity is None else capacity
            if state is None:  # a decision: no gradient
                chosen = rank_admits(r.detach(), valid, capacity, self.threshold(), doc)
            else:
                chosen = self.decode_admits(r.detach(), valid, pos, capacity, state)
            return masked_selection(chosen, self.gate(r), valid, row_len, aux_loss=r.new_zeros(()))
        raise ValueError(f"routing mode {mode!r}: must be one of {ROUTING_MODES}")


def routed_selection(router: Router, x, valid, k: int, mode: str, row_len: int, depth: int, decision, state,
                     capacity, doc, pos) -> tuple:
    """``router.select`` as a tuple of ``Selection``'s fields: a free function of its inputs, so that
    ``train.compile_policy.compile_units`` compiles it once for every router (a decode step compiles
    ``decode_step.decide_entries`` instead). Its few dozen small ops per call (logits, top-k,
    calibration, the causal rank, the router loss) then run as a handful of fused kernels."""
    sel = router.select(x, valid, k, mode, row_len, depth, decision, state, capacity, doc, pos)
    return sel.order, sel.weight, sel.valid, sel.aux_loss, sel.stats


class _LogitsOfParameters(torch.autograd.Function):
    """The router logits ``x @ weight[0] + bias`` (``ExpertChoiceRouter.logits``) for ``x`` [..., E] that needs
    no gradient, given their value ``r`` (computed already): the forward returns ``r``, the backward gives
    the weight and bias their gradients (the weight's as one GEMM over the rows of ``x``)."""

    @staticmethod
    def forward(ctx, r, x, weight, bias):
        ctx.save_for_backward(x)
        return r.view_as(r)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g = grad.reshape(-1, 1)
        grad_weight = g.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[2] else None
        grad_bias = g.sum(0) if ctx.needs_input_grad[3] else None
        return None, None, grad_weight, grad_bias


def topk_boundary(r: torch.Tensor, k: int) -> torch.Tensor:
    """The logit separating the batch's b*k highest logits ``r`` [B, N] from the rest (midpoint of the two
    values around the cut), pooled over rows: the threshold that admits exactly the capacity's fraction."""
    flat = r.reshape(-1)
    n_sel = r.shape[0] * k
    if n_sel >= flat.shape[0]:  # everything is chosen: any threshold below the smallest logit
        return flat.amin() - 1.0
    # A sort of all of them, not a top-k of n_sel + 1: CUDA's top-k of one long row runs in one thread block,
    # 1.1-2x the multi-block sort's time at the 100M preset's router sizes on an H200 (the step 1.4% faster,
    # benchmarks/BENCHMARKS.md, forty-first session).
    top = torch.sort(flat, descending=True).values
    return 0.5 * (top[n_sel - 1] + top[n_sel])


def rank_admits(s: torch.Tensor, valid: torch.Tensor | None, capacity: float, threshold: torch.Tensor,
                doc: torch.Tensor | None = None) -> torch.Tensor:
    """Causal admission [B, N] of candidates with logits ``s`` [B, N] in causal order (a full
    forward; decoding: ``ExpertChoiceRouter.decode_admits``): ``rank_decision`` over each candidate's
    earlier candidates in the row (of the same document, with ``doc`` [B, N])."""
    if capacity >= 1:  # every candidate (rank_decision): no [B, N, N] comparison to build
        return torch.ones_like(s, dtype=torch.bool)
    v = torch.ones_like(s, dtype=torch.bool) if valid is None else valid
    n = s.shape[1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=s.device).tril(-1)  # [i, j]: j before i
    past = earlier[None] & v[:, None, :]  # [B, i, j]: j is an earlier candidate of i
    if doc is not None:
        past = past & (doc[:, :, None] == doc[:, None, :])
    count = past.sum(-1).to(s.dtype)  # summed as integers: no [B, N, N] float temporary
    above = (past & (s[:, None, :] > s[:, :, None])).sum(-1).to(s.dtype)
    return rank_decision(s, above, count, capacity, threshold)


def rank_decision(s: torch.Tensor, above: torch.Tensor, count: torch.Tensor, capacity: float,
                  threshold: torch.Tensor) -> torch.Tensor:
    """Top-k's rule over the past: admit a candidate iff less than ``capacity`` of what came before it
    ranks above it, where what came before is its ``count`` earlier candidates (``above`` of them with a
    higher logit ``s``) and ``RANK_PRIOR`` pseudo-candidates standing for the calibrated
    threshold. The threshold says a token under it has more than ``capacity`` of the candidates above
    it and one over it less: the pseudo-candidates put the midpoint of each range above it,
    ``(1 + capacity) / 2`` or ``capacity / 2``. A document's first candidates thus follow the threshold
    and later ones more and more their rank: on text unlike the training batches, where the threshold
    alone drifts with the logits, the admitted share comes back towards the capacity (docs/routing.md).
    At capacity 1 (a MoR ramp's first level) top-k takes every candidate, so this does too: the threshold,
    calibrated at a lower capacity, would otherwise turn away candidates under it that rank low so far."""
    if capacity >= 1:
        return torch.ones_like(s, dtype=torch.bool)
    share_above = torch.where(s <= threshold, (1 + capacity) / 2, capacity / 2).to(above.dtype)
    return (above + RANK_PRIOR * share_above) < capacity * (count + RANK_PRIOR)


def masked_selection(chosen: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor | None, row_len: int,
                     aux_loss: torch.Tensor | None = None) -> Selection:
    """Select the ``chosen`` [B, N] candidates (and only valid ones) without changing shapes: all N
    entries are kept, chosen ones first in causal order, the rest marked invalid behind them."""
    if valid is not None:
        chosen = chosen & valid
    order = causal_order(chosen)
    valid_out = chosen.gather(1, order)
    weight = gate.gather(1, order)
    executed = valid_out.float()
    frac = executed.sum(1).mean() / row_len
    mean_gate = (weight * executed).sum() / executed.sum().clamp(min=1.0)
    return Selection(order, weight, valid_out, aux_loss, torch.stack((frac, mean_gate, frac.new_ones(()))))


def pass_through(x: torch.Tensor, valid: torch.Tensor | None, row_len: int) -> Selection:
    """Selection of an inactive router: every candidate, weight 1 (keeps the stats layout fixed). Its agreement
    is NaN: it decides nothing, so an evaluation leaves it out of the routers' agreement (``train.evaluate``)."""
    executed = torch.full((), x.shape[1] / row_len, device=x.device) if valid is None else \
        valid.float().sum(1).mean() / row_len
    one = torch.ones((), device=x.device)
    return Selection(None, None, valid, None, torch.stack((executed, one, torch.full_like(one, math.nan))))


def causal_order(chosen: torch.Tensor) -> torch.Tensor:
    """Permutation putting chosen entries first, in their original order; the rest after them.

    Un-chosen entries then sit after every chosen one, so causal attention and causal convs over
    the permuted row never let them influence a chosen entry. Shapes stay [B, N].
    """
    n = chosen.shape[1]
    key = (~chosen).long() * n + torch.arange(n, device=chosen.device)
    return torch.sort(key, dim=1).indices


class TokenChoiceRouter(Router):
    """Token-choice MoR: on entering the block each token picks how many recursions it takes (1..R)
    from a softmax; depth j then runs the tokens that picked at least j + 1. Causal by construction
    (each token decides from its own state), so training and decoding use the same rule.

    The balancing ("ponder") loss is Switch-style over depths: R * sum_j f_j * P_j, with f_j the
    fraction of tokens that chose depth j and P_j the mean probability of depth j. A routed depth's gate is the
    chosen depth's softmax probability: the expert-choice settings (``mor_gate_scale``'s alpha,
    ``mor_capacity_schedule``, ``mor_capacity``) do not apply, and the balancing loss, not a capacity, sets how many
    tokens reach each depth (uniform choices give the "paper" schedule's fractions).
    """

    kind = "mor"
    fixed_k = False

    def __init__(self, dim: int, recursions: int):
        super().__init__()
        self.recursions = recursions
        self.depths = tuple(range(1, recursions))
        self.proj = nn.Linear(dim, recursions)

    def names(self, block: str) -> list[str]:
        return [f"{block}.depth{j}" for j in self.depths]

    def enter(self, x, valid, mode):
        """(decision [B, N, 1 + R] = (chosen depth, weight at each depth), balancing loss)."""
        probs = torch.softmax(self.proj(x).to(torch.promote_types(x.dtype, torch.float32)), dim=-1)  # fp32 or wider
        depth = probs.argmax(dim=-1)
        one_hot = F.one_hot(depth, self.recursions).to(probs.dtype)
        mask = torch.ones_like(probs[..., 0]) if valid is None else valid.to(probs.dtype)
        count = mask.sum().clamp(min=1.0)
        f = (one_hot * mask[..., None]).sum((0, 1)) / count
        p = (probs * mask[..., None]).sum((0, 1)) / count
        loss = self.recursions * (f * p).sum()
        # Probability of reaching depth j = P(chosen depth >= j); the hard variant uses the chosen
        # depth's probability as the gate so the router gets gradient from the language-model loss.
        reach = probs.flip(-1).cumsum(-1).flip(-1)
        chosen_p = probs.gather(-1, depth[..., None]).squeeze(-1)
        weights = [reach[..., j] if mode == "static" else chosen_p for j in range(self.recursions)]
        return torch.stack([depth.to(probs.dtype), *weights], dim=-1), loss

    def decide_new(self, x, valid, mode, depth, decision, state=None, capacity=None, pos=None):
        weight = decision[..., 1 + depth]
        return weight, None if mode == "static" else decision[..., 0] >= depth

    def select(self, x, valid, k, mode, row_len, depth=0, decision=None, state=None, capacity=None,
               doc=None, pos=None) -> Selection:
        weight, chosen = self.decide_new(x, valid, mode, depth, decision)
        if chosen is None:  # static
            frac = (torch.ones_like(weight) if valid is None else valid.float()).sum(1).mean() / row_len
            return Selection(None, weight, valid, None, torch.stack((frac, weight.mean(), frac.new_ones(()))))
        return masked_selection(chosen, weight, valid, row_len)


def depth_fractions(cfg: HydraConfig, index: int, n_routable: int, first: bool = True) -> list[float]:
    """Fraction of the row that each depth of routed block ``index`` (of ``n_routable``) runs on:
    the MoD capacity on every ``mod_every``-th block, times the expert-choice MoR schedule. Block 0 is
    the model's first block when ``first`` (not behind middle_cycle's unshared first layer), which MoD
    routes only with ``mod_first_block``.

    MoR "paper": (R-j)/R for j = 0..R-1 (the MoR paper's balanced hierarchical filtering).
    "layer_aware": the deepest depth keeps 40% of tokens in the first block rising to 80% in the
    last (the seed's "early ~40%, late ~80% deep"), with depths in between interpolated linearly.
    "geometric": mor_capacity**j, so a few tokens reach the deep recursions and most pay for one.
    """
    routed = index % cfg.mod_every == cfg.mod_every - 1 and (index > 0 or cfg.mod_first_block or not first)
    mod = cfg.mod_capacity if cfg.mod_enabled and routed else 1.0
    r = cfg.recursions
    if not cfg.mor_enabled or cfg.mor_routing != "expert" or r == 1:
        mor = [1.0] * r
    elif cfg.mor_capacity_schedule == "paper":
        mor = [(r - j) / r for j in range(r)]
    elif cfg.mor_capacity_schedule == "geometric":
        mor = [cfg.mor_capacity**j for j in range(r)]
    else:
        position = index / max(1, n_routable - 1)
        deepest = 0.4 + 0.4 * position
        mor = [1.0 - (1.0 - deepest) * j / (r - 1) for j in range(r)]
    return [mod * f for f in mor]


def build_routers(cfg: HydraConfig, dim: int, fractions: list[float]) -> tuple[nn.ModuleDict, Router | None]:
    """The routers of a block whose depth j runs ``fractions[j]`` (non-increasing) of the row: an
    expert-choice router at each depth whose fraction drops (MoD at depth 0, MoR deeper), or with
    token-choice MoR one router deciding every token's depth. Returned as the block stores them, under
    the names its checkpoints use: (expert-choice routers keyed by depth, token-choice router or None)."""
    token_choice = cfg.mor_enabled and cfg.mor_routing == "token"
    routers = nn.ModuleDict()
    for j, frac in enumerate(fractions):
        if frac < (1.0 if j == 0 else fractions[j - 1]) - 1e-9 and (j == 0 or not token_choice):
            routers[str(j)] = ExpertChoiceRouter(dim, j, 1.0 if j == 0 else cfg.mor_gate_scale,
                                                 over_batch=cfg.topk_over in ("batch", "causal"),
                                                 causal_choice=cfg.topk_over == "causal", groups=cfg.topk_groups)
    depth_router = TokenChoiceRouter(dim, len(fractions)) if token_choice and len(fractions) > 1 else None
    return routers, depth_router
