"""Routing health of a trained run, as compare reports it: does each router execute the share of tokens it was
trained for, and how deep do tokens recurse?

Training routes with top-k (every router runs exactly its target share); generation routes
causally (a token enters a unit when less than the unit's capacity share of the earlier candidates,
and of pseudo-candidates for the router's calibrated threshold, rank above its router logit:
``model.routing.rank_decision``). A router whose causal share
drifts far from its target, or a causal loss well above the top-k loss, means generation runs a
different network than the one trained. The numbers are the run's last evaluation's (``train.evaluate``, on the
validation split); this module adds the depth profile and words the warnings for a variant.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import HydraConfig
from ..model.factory import create_model
from ..train.evaluate import GAP_WARN, SHARE_WARN, routing_warnings

# The evaluation's own warning thresholds: one rule for training logs, `hydra-lm eval` and reports.
SHARE_TOLERANCE = SHARE_WARN  # causal executed fraction / target, either way
GAP_TOLERANCE = GAP_WARN  # nats of causal loss above the top-k loss


def depth_profile(config: HydraConfig, routers: dict[str, dict[str, float]]) -> dict[str, list[float]] | None:
    """Share of the tokens entering a recursive block that reach its recursion depth 1..R (depth 1 is 1.0),
    averaged over the blocks of the deepest recursion (causal routing, and the trained targets; ``routers`` as an
    evaluation reports them, each a share of the row); None for a model without MoR (no recursion, MoR off, or its
    MoR routers kept off by the curriculum). Relative to the block's entries, so MoD's entry share (a MoD block
    enters 0.125 of the row) does not read as MoR sending tokens less deep."""
    if not config.mor_enabled:
        return None
    with torch.device("meta"):  # the blocks' layout only: no memory, no initialisation
        model = create_model(config)
    deepest = max(block.recursions for block in model.blocks)
    blocks = [b for b in model.blocks if b.recursions == deepest]
    mor = [name for b in blocks for name, depth in b.router_depths() if depth > 0]
    if deepest < 2 or not any(routers[name].get("active", True) for name in mor):
        return None
    rows: dict[str, list[list[float]]] = {"causal": [], "target": []}
    for block in blocks:
        gated = {depth: name for name, depth in block.router_depths()}
        for kind, key in (("causal", "exec_causal"), ("target", "target")):
            entry = routers[gated[0]][key] if 0 in gated else 1.0  # MoD's share of the row, or the whole row
            row, share = [], entry
            for depth in range(deepest):
                if depth in gated:
                    share = routers[gated[depth]][key]
                # A block no token entered (causal MoD admitted none): none of its entries reach any depth.
                row.append(share / entry if entry > 0 else 0.0)
            rows[kind].append(row)
    mean = lambda rows: [sum(col) / len(col) for col in zip(*rows)]  # noqa: E731
    return {kind: mean(r) for kind, r in rows.items()}


def health_warnings(run: str, final_eval: dict[str, Any] | None) -> list[str]:
    """``train.evaluate.routing_warnings`` of a run's last evaluation record, each line naming the run (a variant's
    name, with its seed or learning rate under --seeds or --lrs)."""
    if not final_eval:
        return []
    causal, topk = final_eval.get("val_loss_causal"), final_eval.get("val_loss_topk")
    # A non-finite loss is stored as null: no gap to judge.
    record = {"val_gap": None if causal is None or topk is None else causal - topk, **final_eval}
    return [f"{run}: {line}" for line in routing_warnings(record)]
