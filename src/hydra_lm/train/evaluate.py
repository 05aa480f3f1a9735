"""Validation loss with causal routing (the real autoregressive number) and with top-k routing,
and the routing's health.

Top-k routing picks a row's tokens after seeing the whole row, so its loss is teacher-forced and
can look better than what the model does when it generates. Each pass states its routing mode
explicitly; the causal pass never depends on ``model.eval_routing``. Per router, the result gives
the fraction of the row each pass executed (top-k's is the router's target), and how often the
causal threshold agrees with top-k's choice. A router the curriculum keeps switched off decides
nothing: it has no agreement (None) and the agreement means leave it out.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Callable, Iterable

import torch

from ..model.layers import eval_mode
from ..model.routing import ExpertChoiceRouter

EVAL_MODES = ("causal", "topk")
# Beyond these, evaluation warns: the causal (generation) loss is worse than top-k by more than
# GAP_WARN nats, or a router's causal executed fraction is under 1/SHARE_WARN or over SHARE_WARN times its target.
# A ratio, not a difference of shares of the row: a deep MoR router's whole target is a few thousandths of the row,
# so no absolute tolerance tells it running none or several times its share. Judged only where the evaluation
# expected MIN_ADMITTED admissions or more (fewer are too noisy to tell).
GAP_WARN = 0.05
SHARE_WARN = 2.0
MIN_ADMITTED = 100


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], device: torch.device,
             max_batches: int = 0, autocast: Callable[[], Any] = contextlib.nullcontext,
             use_doc_ids: bool = False, should_stop: Callable[[], bool] = lambda: False,
             reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float] | None:
    """Token-weighted mean CE over ``batches`` (all of them when ``max_batches`` is 0).

    Returns None when ``should_stop`` interrupts it (e.g. Ctrl-C), so no partial number is logged.
    ``reduce`` sums the totals over the ranks that evaluated their shares of the data.
    """
    totals = {mode: torch.zeros((), dtype=torch.float64, device=device) for mode in EVAL_MODES}
    names = model.router_names() if model_has_routers(model) else []
    # Per router and pass: stats rows (executed fraction, mean gate, top-k/threshold agreement) summed over the
    # batches, each weighted by its real rows: a last batch that is mostly padding counts for what it holds.
    stats = {mode: torch.zeros((len(names), 3), dtype=torch.float64, device=device) for mode in EVAL_MODES}
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    n_batches = rows = 0
    config = getattr(getattr(model, "module", model), "config", None)  # DDP's model is its .module
    row_groups = config.topk_groups if getattr(config, "topk_over", "row") != "row" else 1
    with eval_mode(model):  # every submodule's own flag back after it (a router frozen with .eval() stays so)
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            if should_stop():
                return None
            batch, real = real_rows(batch, row_groups)
            x = batch["input_ids"].to(device, non_blocking=True)
            y = batch["targets"].to(device, non_blocking=True)
            kwargs = {"doc_ids": batch["doc_ids"].to(device, non_blocking=True)} if use_doc_ids else {}
            n = (y != -100).sum()
            for mode in EVAL_MODES:
                with autocast():
                    out = model(x, targets=y, routing=mode, **kwargs)
                totals[mode] += out["ce_loss"].double() * n
                if names:
                    stats[mode] += out["routing_stats"].double() * real
            tokens += n
            n_batches += 1
            rows += real
    scalars = torch.tensor([n_batches, rows], dtype=torch.float64, device=device)
    summed = reduce(torch.cat([torch.stack([totals["causal"], totals["topk"], tokens]), scalars,
                               stats["causal"].flatten(), stats["topk"].flatten()]))
    totals = {"causal": summed[0], "topk": summed[1]}
    tokens, n_batches, rows = summed[2], int(summed[3]), float(summed[4])
    per_router = summed[5:].reshape(2, len(names), 3) / max(1.0, rows)
    if n_batches == 0:
        raise ValueError("the validation split yielded no batch: it is shorter than one batch of sequences "
                         "(prepare more data, raise the validation fraction, or lower --batch_size/--seq_len)")
    count = max(1.0, float(tokens))
    out = {"val_tokens": int(tokens), "val_batches": n_batches}
    for mode in EVAL_MODES:
        loss = float(totals[mode]) / count
        out[f"val_loss_{mode}"] = loss
        out[f"val_ppl_{mode}"] = math.exp(min(loss, 700.0))
    out["val_gap"] = out["val_loss_causal"] - out["val_loss_topk"]
    if names:
        causal, topk = per_router.tolist()
        calibrated = router_calibration(model)
        # A router the curriculum keeps off lets every candidate through (NaN agreement): it decides nothing.
        active = [not math.isnan(t[2]) for t in topk]
        out["routing"] = {name: {"target": t[0], "exec_causal": c[0], "exec_topk": t[0],
                                 "agreement": t[2] if on else None, "active": on, "calibrated": calibrated[name]}
                          for name, c, t, on in zip(names, causal, topk, active)}
        out["val_exec_frac_causal"] = sum(c[0] for c in causal) / len(names)
        out["val_exec_frac_topk"] = sum(t[0] for t in topk) / len(names)
        deciding = [(w, t[2]) for w, t, on in zip(decisions_per_row(names, [t[0] for t in topk]), topk, active) if on]
        if deciding:  # else no agreement to report: every router is off
            out["val_agreement"] = sum(a for _, a in deciding) / len(deciding)
            if sum(w for w, _ in deciding) > 0:
                out["val_agreement_decisions"] = sum(w * a for w, a in deciding) / sum(w for w, _ in deciding)
        out["routing_calibrated"] = all(calibrated[name] for name, on in zip(names, active) if on)
    return out


def real_rows(batch: dict[str, torch.Tensor], groups: int = 1) -> tuple[dict[str, torch.Tensor], int]:
    """``batch`` without its rows of padding only (every target -100, as the loader fills the last batch of a pass)
    and how many real rows it holds. Their routing would count in the routers' stats (the loss ignores them); left out
    of the forward they cost nothing. Read off the targets where the loader made them, on the CPU (no device sync);
    a batch with no padding row is returned as it is, and one of padding only keeps one row (weighing nothing:
    every rank still runs its forward, as sharded weights need). ``groups``: a top-k over the batch pools the rows in
    that many equal groups (``HydraConfig.topk_groups``), so enough padding rows stay to fill the last group."""
    real = (batch["targets"] != -100).any(1)
    count = int(real.sum())
    if count == real.numel():
        return batch, count
    keep = real if count else torch.arange(real.numel()) == 0
    if count > groups and count % groups:
        padding = (~real).nonzero().flatten()[:groups - count % groups]
        keep = keep.clone()
        keep[padding] = True
    return {key: value[keep.to(value.device)] for key, value in batch.items()}, count


def router_calibration(model: torch.nn.Module) -> dict[str, bool]:
    """Per router name, whether it has a causal threshold to hold to its target: an expert-choice router once a
    training batch ran it (none does while the curriculum keeps it off); token-choice routers, causal by
    construction, need none."""
    return {name: not isinstance(router, ExpertChoiceRouter) or bool(router.threshold_weight > 0)
            for block in model.blocks for router in block.all_routers() for name in router.names(block.name)}


def decisions_per_row(names: list[str], exec_topk: list[float]) -> list[float]:
    """How many decisions each expert-choice router makes, as a fraction of the row: its candidates, the
    tokens its block's previous depth ran in top-k mode (the whole row at depth 0, or after an ungated
    depth 0). Weighting the routers' agreement by it gives the share of all routing decisions on which
    the causal rule agrees with top-k, where the plain mean counts a deep unit's two decisions per row
    as much as a first depth's thousand. Token-choice routers (causal by construction) weigh 0."""
    executed = {}
    for name, share in zip(names, exec_topk):
        if (found := _EXPERT_NAME.match(name)) is not None:
            executed[(found["block"], int(found["depth"]))] = share
    weights = []
    for name in names:
        found = _EXPERT_NAME.match(name)
        if found is None:
            weights.append(0.0)
            continue
        depth = int(found["depth"])
        weights.append(1.0 if depth == 0 else executed.get((found["block"], depth - 1), 1.0))
    return weights


# Expert-choice routers' names: block name, "mod" or "mor", the depth they gate (Router.names).
_EXPERT_NAME = re.compile(r"^(?P<block>.+)\.(?:mod|mor)(?P<depth>\d+)$")


def routing_warnings(result: dict[str, Any]) -> list[str]:
    """Plain-language warnings about an evaluation's routing health (empty when healthy)."""
    warnings = []
    gap = result.get("val_gap")  # None: a loss was not finite
    if gap is not None and gap > GAP_WARN:
        warnings.append(f"causal-routing loss is {gap:.3f} nats worse than top-k (more than "
                        f"{GAP_WARN}): generation does worse than the teacher-forced top-k number suggests")
    for name, r in result.get("routing", {}).items():
        # Off: it runs every candidate, as it should. Uncalibrated (no training batch yet): no threshold to
        # hold to. Records from before the per-router flag carry the evaluation's "routing_calibrated" only.
        if not r.get("active", True) or not r.get("calibrated", result.get("routing_calibrated", True)):
            continue
        target, executed = r["target"], r["exec_causal"]
        if target <= 0 or (result.get("val_tokens") is not None and target * result["val_tokens"] < MIN_ADMITTED):
            continue
        if not 1 / SHARE_WARN <= executed / target <= SHARE_WARN:
            warnings.append(f"router {name} executes {executed / target:.2f}x its target under causal routing "
                            f"({executed:.4f} of the tokens against {target:.4f}): generation runs "
                            f"{'less' if executed < target else 'more'} of that unit than training did")
    return warnings


def format_eval(result: dict[str, Any]) -> str:
    """One line: both losses, their gap and, for routed models, agreement and executed fractions."""
    line = (f"val loss causal {result['val_loss_causal']:.4f} (ppl {result['val_ppl_causal']:.1f}) | top-k "
            f"{result['val_loss_topk']:.4f} (ppl {result['val_ppl_topk']:.1f}) | gap {result['val_gap']:+.4f}")
    if "routing" in result:
        if "val_agreement" in result:
            line += f" | agreement {100 * result['val_agreement']:.1f}%"
            if "val_agreement_decisions" in result:
                line += f" (of decisions {100 * result['val_agreement_decisions']:.1f}%)"
        else:
            line += " | agreement - (every router off)"
        line += f" | executed {result['val_exec_frac_causal']:.3f} (top-k {result['val_exec_frac_topk']:.3f})"
    return line + f" | {result['val_tokens']:,} tokens"


def model_has_routers(model: torch.nn.Module) -> bool:
    names = getattr(model, "router_names", None)
    return bool(names()) if callable(names) else False
