"""`hydra-lm compare`'s results: each trained variant's record read back from its run directory
(losses at every evaluation, executed FLOPs, time, memory, routing health), and what the report sums
up across variants: seeds, learning rates, throughput that wavered."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..model.accounting import executed_flops_per_token
from ..train.metrics import METRICS_FILE
from ..train.run import CONFIG_JSON
from .compare_runs import ComparePlan, VariantRun, executed_flops_at, read_marker
from .routing_health import depth_profile, health_warnings
from .variants import parameter_count


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
    return out


def collect_results(plan: ComparePlan) -> dict[str, Any]:
    base, tps = plan.base, plan.tokens_per_step
    variants, warnings = {}, []
    train_tokens = plan.data.token_counts.get("train") or 0
    for run in plan.runs:
        entry = variant_results(run, base.seq_len, tps, plan.out)
        # Passes over the training split: repeated tokens tell the smallest (fastest) models least.
        entry["epochs"] = entry["tokens"] / train_tokens if train_tokens else None
        if entry["epochs"] is not None and entry["epochs"] > 1.0:
            entry["warnings"].append(f"{run.name}: trained {entry['epochs']:.1f} passes over the training split "
                                     f"({train_tokens:,} tokens), so it saw repeated data: prepare a larger corpus "
                                     "for a comparison in which no run repeats")
        variants[run.name] = entry
        warnings += entry["warnings"]
    results = {
        "budget": {"kind": plan.budget.kind, "value": plan.budget.value},
        "data": str(plan.data.path),
        "settings": {"model_size": base.model_size, "batch_size": base.batch_size, "grad_accum": base.grad_accum,
                     "seq_len": base.seq_len, "tokens_per_step": tps, "optimizer": base.optimizer, "lr": base.lr,
                     "min_lr": base.min_lr,
                     "schedule": base.schedule, "seed": base.seed if plan.seeds is None else plan.seeds,
                     "evals": plan.evals, "eval_every": base.eval_every if plan.evals is None else None,
                     "eval_at_start": base.eval_at_start,
                     # A seconds budget's schedule clock: --eval_every counts its steps, each 1/N of the time.
                     "schedule_steps": plan.runs[0].values["max_steps"] if plan.budget.kind == "seconds" and plan.runs
                     else None,
                     "model_overrides": base.model},
        "variants": variants,
        "warnings": warnings,
    }
    if plan.budget.kind == "seconds":
        results["warnings"] += mixed_devices_warning(variants)
    if plan.seeds is not None:
        results["across_seeds"] = across_seeds(plan.runs, variants)
    if any(run.variant.swept_from for run in plan.runs):
        results["lr_sweep"] = lr_sweep(plan.runs, variants)
        results["warnings"] += lr_failure_warnings(results["lr_sweep"])
        for family, sweep in results["lr_sweep"].items():
            if sweep["best_at_edge"]:
                results["warnings"].append(
                    f"{family}: its best learning rate, {sweep['best_lr']:g}, is the {sweep['best_at_edge']} given to "
                    "--lrs, so a better one may lie beyond it: extend the grid (--lr_extend N) before ranking the "
                    "variants")
    return results


def run_device(run_dir: Path) -> str | None:
    """The device a run trained on, as its newest start recorded it (the GPU's name, or "cpu")."""
    path = run_dir / CONFIG_JSON
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if record.get("train", {}).get("device") == "cpu":  # --device cpu on a GPU host
        return "cpu"
    return record.get("versions", {}).get("gpu", "cpu")


def mixed_devices_warning(variants: dict[str, Any]) -> list[str]:
    """A seconds budget buys different work on different devices: its runs compare only on one kind."""
    by_device: dict[str, list[str]] = {}
    for name, entry in variants.items():
        if entry.get("device") is not None:
            by_device.setdefault(entry["device"], []).append(name)
    if len(by_device) < 2:
        return []
    listed = "; ".join(f"{device}: {', '.join(names)}" for device, names in sorted(by_device.items()))
    return [f"the runs of this seconds budget trained on different devices ({listed}): the same seconds buy "
            "different work on each, so their losses (and seeds' spreads) do not compare; train them all on one "
            "kind of device"]


def _final_causal(entry: dict[str, Any]) -> float | None:
    """A finished run's final causal loss; None for a run not finished or whose final loss is not finite (its
    warning says so): such a run has no loss to average over seeds or to rank a learning rate by."""
    if entry["status"] != "finished" or entry["final"] is None:
        return None
    return entry["final"]["val_loss_causal"]


def run_outcome(entry: dict[str, Any]) -> str:
    """What a run tells a learning rate: "ok" (finished with a finite final loss, no rollback), "unstable"
    (diverged, rolled back or ended on a non-finite loss: the learning rate's doing) or "missing" (not trained
    yet, cut short, or raised, e.g. out of memory: the same command trains it again)."""
    if entry["status"] == "diverged" or entry.get("rollbacks"):
        return "unstable"
    if entry["status"] != "finished" or entry["final"] is None:
        return "missing"
    return "ok" if _final_causal(entry) is not None else "unstable"


def lr_sweep(runs: list[VariantRun], variants: dict[str, Any]) -> dict[str, Any]:
    """Per variant swept over --lrs: its final causal loss at each learning rate, the mean over all of its planned
    seeds, the best learning rate and whether it is the grid's smallest or largest. A rate has no mean (and cannot
    be best) unless every planned seed finished with a finite loss and without a rollback: a mean over the seeds
    that survived would rank an unstable rate by its lucky seeds, and --lr_extend would follow it. One with a seed
    diverged, rolled back or non-finite is marked failed; ``n_seeds`` counts the seeds each mean could take."""
    cells: dict[str, dict[float, list[tuple[str, float | None]]]] = {}
    for run in runs:
        if run.variant.swept_from is None:
            continue
        entry = variants[run.name]
        cells.setdefault(run.variant.swept_from, {}).setdefault(run.values["lr"], []).append(
            (run_outcome(entry), _final_causal(entry)))
    out = {}
    for family, by_lr in cells.items():
        grid = sorted(by_lr)
        ok = {lr: [loss for outcome, loss in by_lr[lr] if outcome == "ok"] for lr in grid}
        failed = [any(outcome == "unstable" for outcome, _ in by_lr[lr]) for lr in grid]
        means = {lr: float(np.mean(ok[lr])) for lr in grid if len(ok[lr]) == len(by_lr[lr])}
        best = min(means, key=means.get) if means else None
        edge = None
        if best is not None and len(grid) > 1:
            edge = "smallest" if best == grid[0] else "largest" if best == grid[-1] else None
        out[family] = {"lrs": grid, "causal": [means.get(lr) for lr in grid], "n_seeds": [len(ok[lr]) for lr in grid],
                       "planned_seeds": [len(by_lr[lr]) for lr in grid], "failed": failed, "best_lr": best,
                       "best_causal": means.get(best), "best_at_edge": edge}
    return out


def lr_failure_warnings(sweep: dict[str, Any]) -> list[str]:
    """A line per learning rate ``lr_sweep`` marked failed."""
    out = []
    for family, entry in sweep.items():
        for lr, failed, n, planned in zip(entry["lrs"], entry["failed"], entry["n_seeds"], entry["planned_seeds"]):
            if failed:
                out.append(f"{family}: at learning rate {lr:g} {planned - n} of its {planned} seed(s) diverged, rolled "
                           "back or ended on a non-finite loss: that rate is marked failed and not ranked (its other "
                           "seeds' losses are not averaged)")
    return out


def lr_extensions(sweep: dict[str, Any]) -> dict[str, float]:
    """The next learning rate of each variant whose best is at an end of its grid (``lr_sweep``): one step
    beyond that end at the grid's ratio there, to 3 significant digits (``--lr_extend``)."""
    out = {}
    for family, entry in sweep.items():
        grid, edge = entry["lrs"], entry["best_at_edge"]
        if edge == "largest":
            out[family] = float(f"{grid[-1] * grid[-1] / grid[-2]:.3g}")
        elif edge == "smallest":
            out[family] = float(f"{grid[0] * grid[0] / grid[1]:.3g}")
    return out


def across_seeds(runs: list[VariantRun], variants: dict[str, Any]) -> dict[str, Any]:
    """Per variant, its final causal losses over the seeds (finished runs with a finite loss and no rollback only):
    mean, min, max and the sample standard deviation, with the planned seeds (``planned``), the variant's share of the
    budget (``budget_scale``) and the status of each seed left out (``left_out``, by seed: "diverged", "failed",
    "unfinished", "non-finite" or "rolled back", which trained on at a reduced learning rate), so a mean over fewer
    seeds says so (``complete`` False)."""
    out: dict[str, Any] = {}
    for run in runs:
        entry = variants[run.name]
        summary = out.setdefault(run.variant.name, {"arch": run.variant.arch, "seeds": [], "causal": [],
                                                    "planned": [], "left_out": {},
                                                    "budget_scale": run.variant.budget_scale})
        summary["planned"].append(run.seed)
        loss = _final_causal(entry)
        if loss is not None and not entry.get("rollbacks"):
            summary["seeds"].append(run.seed)
            summary["causal"].append(loss)
        else:
            summary["left_out"][str(run.seed)] = ("rolled back" if loss is not None else
                                                  "non-finite" if entry["status"] == "finished" else entry["status"])
    for summary in out.values():
        losses = np.asarray(summary["causal"], dtype=np.float64)
        n = len(losses)
        summary.update(mean=float(losses.mean()) if n else None, min=float(losses.min()) if n else None,
                       max=float(losses.max()) if n else None, std=float(losses.std(ddof=1)) if n > 1 else None,
                       complete=not summary["left_out"])
    return out


def variant_results(run: VariantRun, seq_len: int, tokens_per_step: int, out_dir: Path) -> dict[str, Any]:
    records = _records(run.run_dir)
    train_rs = [r for r in records if r.get("kind") == "train"]
    # Non-finite losses are stored as null and kept: a run whose last evaluation is not finite ended so.
    eval_rs = [r for r in records if r.get("kind") == "eval"]
    status = (read_marker(run) or {}).get("status", "unfinished")
    steps = [r["step"] for r in eval_rs]
    flops = executed_flops_at(steps, train_rs, run.model_cfg, seq_len, tokens_per_step)
    evals = []
    for r, f in zip(eval_rs, flops):
        causal, topk = r.get("val_loss_causal"), r.get("val_loss_topk")
        point = {"step": r["step"], "tokens": r["step"] * tokens_per_step, "flops": f,
                 "train_s": r.get("train_s"), "val_loss_causal": causal, "val_loss_topk": topk,
                 "gap": r.get("val_gap", None if causal is None or topk is None else causal - topk)}
        for key in ("val_agreement", "val_agreement_decisions", "val_exec_frac_causal", "routing"):  # when present
            if key in r:
                point[key] = r[key]
        evals.append(point)
    last_train = train_rs[-1] if train_rs else {}
    final_step = last_train.get("step", 0)
    train_s = last_train.get("train_s")
    final = evals[-1] if evals else None
    routers = eval_rs[-1].get("routing", {}) if eval_rs else {}
    entry = {
        "variant": run.variant.name, "seed": run.values.get("seed"), "swept_from": run.variant.swept_from,
        "budget_scale": run.variant.budget_scale,
        "description": run.variant.description, "arch": run.variant.arch, "overrides": run.variant.overrides,
        "run_dir": os.path.relpath(run.run_dir, out_dir), "status": "unfinished" if status == "started" else status,
        "device": run_device(run.run_dir),
        "params": parameter_count(run.model_cfg),
        "flops_per_token": executed_flops_per_token(run.model_cfg, seq_len, training=True),
        "max_steps": run.values["max_steps"], "steps": final_step, "tokens": final_step * tokens_per_step,
        "executed_flops": executed_flops_at([final_step], train_rs, run.model_cfg, seq_len, tokens_per_step)[0],
        "train_s": train_s, "startup_s": last_train.get("startup_s"),
        "eval_s": sum(r.get("eval_s", 0.0) for r in eval_rs),
        "tokens_per_s": final_step * tokens_per_step / train_s if train_s else None,
        # On CUDA the run's own peak allocated memory; on a CPU the process's peak RSS so far.
        "peak_memory_mb": max((r["memory_mb"] for r in train_rs if r.get("memory_mb") is not None), default=None),
        "optimizer": run.values.get("optimizer", "adamw"), "lr": run.values["lr"], "min_lr": run.values["min_lr"],
        "final": None if final is None else {k: final.get(k) for k in ("step", "val_loss_causal", "val_loss_topk",
                                                                       "gap", "val_agreement",
                                                                       "val_agreement_decisions")},
        "evals": evals,
        "routing": routers,
        "depths": depth_profile(run.model_cfg, routers) if routers else None,
    }
    rollbacks = [r for r in records if r.get("kind") == "divergence" and r.get("action") == "rollback"]
    entry["rollbacks"] = len(rollbacks)
    entry["throughput_steadiness"] = throughput_steadiness(train_rs)
    entry["warnings"] = health_warnings(run.name, eval_rs[-1] if eval_rs else None)
    lost = [label for key, label in (("val_loss_causal", "causal"), ("val_loss_topk", "top-k"))
            if final is not None and final[key] is None]
    if lost:
        entry["warnings"].append(
            f"{run.name}: its final evaluation (step {final['step']}) has a non-finite {' and '.join(lost)} validation "
            "loss, reported as such: the model diverged by then (lower the learning rate, or look for the step where "
            "its training loss left the finite numbers)")
    if rollbacks:
        entry["warnings"].append(
            f"{run.name}: diverged and rolled back {len(rollbacks)} time(s), ending at {rollbacks[-1]['lr_scale']:g}x "
            f"its learning rate {run.values['lr']:g}: its losses are not that learning rate's (a learning-rate sweep "
            "leaves it out)")
    entry["warnings"] += unsteady_warning(run.name, entry["throughput_steadiness"])
    return entry


# A run alone on its GPU logged p10/p90 tokens/s of 0.93-0.98 in a measured study; runs that shared the
# host's CPUs with other jobs' compilation 0.77-0.82 (benchmarks/BENCHMARKS.md, fifteenth session).
STEADY_THROUGHPUT = 0.9


def throughput_steadiness(train_records: list[dict[str, Any]]) -> float | None:
    """The 10th percentile of a run's logged tokens/s over its 90th (windows after the first two, which hold
    compilation and graph capture), or None with fewer than 10 such windows."""
    tps = [r["tokens_per_s"] for r in train_records[2:] if r.get("tokens_per_s")]
    if len(tps) < 10:
        return None
    low, high = np.percentile(np.asarray(tps, dtype=np.float64), [10, 90])
    return float(low / high) if high > 0 else None


def unsteady_warning(name: str, steadiness: float | None) -> list[str]:
    if steadiness is None or steadiness >= STEADY_THROUGHPUT:
        return []
    return [f"{name}: its throughput was unsteady (the 10th percentile of its logged tokens/s is {steadiness:.0%} of "
            f"the 90th; a run alone on a GPU stays above {STEADY_THROUGHPUT:.0%}): something else on the host "
            "competed for its CPU time or GPU, so a seconds budget understates it; train it again on a quiet host"]
