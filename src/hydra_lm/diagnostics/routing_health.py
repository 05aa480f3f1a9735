"""Routing health of a trained run: does each router execute the share of tokens it was trained for?

Training routes with top-k (every router runs exactly its target share); generation routes
causally (a token enters a unit when less than the unit's capacity share of the earlier candidates,
and of pseudo-candidates for the router's calibrated threshold, rank above its router logit:
``model.routing.rank_decision``). A router whose causal share
drifts far from its target, or a causal loss well above the top-k loss, means generation runs a
different network than the one trained. Measured here on the validation split at a checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any

import torch

from ..train.data_io import ValSet, open_data
from ..infer import load_run
from ..train.evaluate import FRAC_WARN, GAP_WARN

# The evaluation's own warning thresholds: one rule for training logs, `hydra-lm eval` and reports.
STARVATION_TOLERANCE = FRAC_WARN  # |causal executed fraction - target|, absolute
GAP_TOLERANCE = GAP_WARN  # nats of causal loss above the top-k loss


@torch.no_grad()
def measure_routing(run_dir: str | Path, max_batches: int, device: str = "auto") -> dict[str, Any]:
    """Per-router shares and agreement at the run's newest checkpoint, and the fraction of tokens
    reaching each recursion depth (causal and target), over ``max_batches`` validation batches."""
    run = load_run(run_dir, device=device)
    train_cfg = run.config.get("train", {})
    seq_len, batch_size = int(train_cfg["seq_len"]), int(train_cfg["batch_size"])
    info = open_data(train_cfg.get("data") or run.config["data"]["path"])
    use_doc_ids = train_cfg.get("document_masking", True)
    batches = ValSet(info, batch_size, seq_len)
    batches = itertools.islice(batches, max_batches) if max_batches else batches
    return routing_shares(run.model, batches, run.device, use_doc_ids)


@torch.no_grad()
def routing_shares(model, batches, device: torch.device, use_doc_ids: bool = True) -> dict[str, Any]:
    """Each router's executed share of the row with causal and with top-k routing, and its agreement,
    averaged over ``batches`` (dicts of "input_ids" and "doc_ids"). A router's target is what top-k
    ran: the trained share (an expert-choice depth's capacity; a token-choice depth's share varies
    with the tokens, its configured count is only an upper bound)."""
    names = model.router_names()
    if not names:
        return {"routers": {}, "depths": None}
    device = torch.device(device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext
    sums = {mode: torch.zeros(len(names), 3, dtype=torch.float64) for mode in ("causal", "topk")}
    count = 0
    for batch in batches:
        kwargs = {"doc_ids": batch["doc_ids"].to(device)} if use_doc_ids else {}
        for mode in sums:
            with autocast():
                out = model(batch["input_ids"].to(device), routing=mode, **kwargs)
            sums[mode] += out["routing_stats"].double().cpu()
        count += 1
    causal, topk = (sums[m] / max(1, count) for m in ("causal", "topk"))
    routers = {name: {"target": float(topk[i, 0]), "exec_causal": float(causal[i, 0]), "exec_topk": float(topk[i, 0]),
                      "agreement": float(topk[i, 2])} for i, name in enumerate(names)}
    return {"routers": routers, "depths": depth_profile(model, routers)}


def depth_profile(model, routers: dict[str, dict[str, float]]) -> dict[str, list[float]] | None:
    """Fraction of a row's tokens that reach recursion depth 1..R, averaged over the recursive blocks
    (causal routing, and the trained targets); None for a model without recursion."""
    deepest = max(block.recursions for block in model.blocks)
    if deepest < 2:
        return None
    rows: dict[str, list[list[float]]] = {"causal": [], "target": []}
    for block in (b for b in model.blocks if b.recursions == deepest):
        gated = {depth: name for name, depth in block.router_depths()}
        for kind, key in (("causal", "exec_causal"), ("target", "target")):
            row, share = [], 1.0
            for depth in range(deepest):
                if depth in gated:
                    share = routers[gated[depth]][key]
                row.append(share)
            rows[kind].append(row)
    mean = lambda rows: [sum(col) / len(col) for col in zip(*rows)]  # noqa: E731
    return {kind: mean(r) for kind, r in rows.items()}


def health_warnings(variant: str, routers: dict[str, dict[str, float]], gap: float | None) -> list[str]:
    """One line per starving (or flooding) router, and one for a large causal-vs-top-k gap."""
    lines = []
    for name, r in routers.items():
        if abs(r["exec_causal"] - r["target"]) > STARVATION_TOLERANCE:
            lines.append(f"{variant}: router {name} runs {r['exec_causal']:.2f} of the tokens with causal routing "
                         f"against a target of {r['target']:.2f} (off by more than {STARVATION_TOLERANCE})")
    if gap is not None and gap > GAP_TOLERANCE:
        lines.append(f"{variant}: causal loss is {gap:.3f} nats above the top-k loss (more than {GAP_TOLERANCE}): "
                     "generation runs worse than the teacher-forced number suggests")
    return lines
