"""Token routing shared by MoD and MoR: expert-choice top-k with a FIXED k, causal threshold mode,
static (soft) mode, and token-choice depth routing.

Every function here keeps shapes static (k is a Python int derived from the sequence length), so a
routed training step has no host synchronisation and compiles with ``fullgraph=True``.

A selection works on candidate entries ``x`` [B, N, E] (the tokens still active) and returns:
``order`` [B, M] indices into the candidates (sorted so causal order is kept), ``weight`` [B, M]
multiplying the unit's residual update, and ``valid`` [B, M] (None = all valid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROUTING_MODES = ("topk", "causal", "static")


@dataclass
class Selection:
    order: torch.Tensor | None  # None: every candidate, in place
    weight: torch.Tensor | None  # None: weight 1
    valid: torch.Tensor | None  # None: all entries are real tokens of the unit
    aux_loss: torch.Tensor  # router loss (BCE for expert-choice, balancing for token-choice)
    stats: torch.Tensor  # [3]: fraction of the row executed, mean gate, top-k/threshold agreement


class Router(nn.Module):
    """Scalar router logit r = w^T x + b; gate = scale * sigmoid(r).

    ``kind`` is "mod" (its loss counts in ``aux_loss``) or "mor" (counts in ``ponder_loss``).
    """

    def __init__(self, dim: int, kind: str, gate_scale: float = 1.0):
        super().__init__()
        self.kind = kind
        self.gate_scale = gate_scale
        self.proj = nn.Linear(dim, 1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # One fp32 column outside autocast: autocast would first copy the whole [B, N, E] fp32
        # residual stream to bf16 for it, more memory traffic than the matmul itself.
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)

    def gate(self, r: torch.Tensor) -> torch.Tensor:
        return self.gate_scale * torch.sigmoid(r)

    def select(self, x: torch.Tensor, valid: torch.Tensor | None, k: int, mode: str, row_len: int) -> Selection:
        r = self.logits(x)
        b, n = r.shape
        if mode == "static":
            weight = self.gate(r)
            frac = torch.ones((), device=x.device) if valid is None else valid.float().sum(1).mean() / row_len
            return Selection(None, weight, None, r.new_zeros(()), torch.stack((frac, weight.mean(), frac.new_ones(()))))
        if mode == "topk":
            top = torch.topk(r, k, dim=1, sorted=False).indices
            order = torch.sort(top, dim=1).values
            chosen = torch.zeros_like(r).scatter_(1, order, 1.0)
            # The router learns to predict its own top-k choice, so the causal threshold (r > 0) can
            # replace top-k at decode time. Detached input: this loss trains the router only.
            r_aux = self.logits(x.detach())
            aux = F.binary_cross_entropy_with_logits(r_aux, chosen)
            weight = self.gate(r.gather(1, order))
            agree = ((r > 0).float() == chosen).float().mean()
            frac = torch.full((), k / row_len, device=x.device)
            return Selection(order, weight, None, aux, torch.stack((frac, weight.mean(), agree)))
        if mode == "causal":
            return masked_selection(r > 0, self.gate(r), valid, row_len)
        raise ValueError(f"routing mode {mode!r}: must be one of {ROUTING_MODES}")


def masked_selection(chosen: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor | None, row_len: int) -> Selection:
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
    return Selection(order, weight, valid_out, gate.new_zeros(()), torch.stack((frac, mean_gate, frac.new_ones(()))))


def causal_order(chosen: torch.Tensor) -> torch.Tensor:
    """Permutation putting chosen entries first, in their original order; the rest after them.

    Un-chosen entries then sit after every chosen one, so causal attention and causal convs over
    the permuted row never let them influence a chosen entry. Shapes stay [B, N].
    """
    n = chosen.shape[1]
    key = (~chosen).long() * n + torch.arange(n, device=chosen.device)
    return torch.sort(key, dim=1).indices


class DepthRouter(nn.Module):
    """Token-choice MoR: each token picks how many recursions it takes (1..R) from a softmax.

    The balancing ("ponder") loss is Switch-style over depths: R * sum_j f_j * P_j, with f_j the
    fraction of tokens that chose depth j and P_j the mean probability of depth j.
    """

    kind = "mor"

    def __init__(self, dim: int, recursions: int):
        super().__init__()
        self.recursions = recursions
        self.proj = nn.Linear(dim, recursions)

    def route(self, x: torch.Tensor, valid: torch.Tensor | None, soft: bool):
        """Returns (depth [B, N] long, weight_per_depth list of [B, N], loss, depth fractions [R])."""
        probs = torch.softmax(self.proj(x).float(), dim=-1)
        depth = probs.argmax(dim=-1)
        one_hot = F.one_hot(depth, self.recursions).float()
        mask = torch.ones_like(depth, dtype=torch.float) if valid is None else valid.float()
        count = mask.sum().clamp(min=1.0)
        f = (one_hot * mask[..., None]).sum((0, 1)) / count
        p = (probs * mask[..., None]).sum((0, 1)) / count
        loss = self.recursions * (f * p).sum()
        # Probability of reaching depth j = P(chosen depth >= j); the hard variant uses the chosen
        # depth's probability as the gate so the router gets gradient from the language-model loss.
        reach = probs.flip(-1).cumsum(-1).flip(-1)
        chosen_p = probs.gather(-1, depth[..., None]).squeeze(-1)
        weights = [reach[..., j] if soft else chosen_p for j in range(self.recursions)]
        return depth, weights, loss, f
