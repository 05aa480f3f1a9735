"""`hydra-lm scaling`: fit L(C) = a*C^-b + c to the evaluation points of `hydra-lm compare` results,
predict the loss at a larger budget, and measure how much compute each group needs for the same
loss as the reference group (HYDRA vs dense), with a bootstrap interval.

By default a group's fit takes its frontier: the seeds of each variant averaged, then only the points
that no point at less or equal compute beats. A family compared at several depths and learning rates
is then the curve of its best model at each compute ("the best dense model of any size"), not a fit
through its worst settings too.

The fit uses numpy only: scipy is not a dependency, and for a fixed floor c the model is a straight
line in log-log space, so a search over c with exact least squares for (a, b) at each candidate
needs no starting guess and cannot diverge the way an iterative curve fit can.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..train.checkpoint import write_text_atomic

MIN_DISTINCT = 4  # three parameters: fewer distinct compute values leave nothing to check the fit against
X_KEYS = {"flops": ("flops", "executed training FLOPs"), "seconds": ("train_s", "training seconds")}


def fit_power_law(x, y) -> dict[str, float]:
    """Least-squares fit of y = a * x^-b + c with b > 0 and 0 <= c < min(y)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0)
    x, y = x[keep], y[keep]
    distinct = len(np.unique(x))
    if distinct < MIN_DISTINCT:
        raise ValueError(f"{distinct} distinct compute values: the fit needs at least {MIN_DISTINCT}")
    scale = float(np.exp(np.mean(np.log(x))))  # fit in units of the points' geometric mean: a stays O(y)
    lx = np.log(x / scale)
    floor = float(y.min())
    if floor <= 0:
        raise ValueError("losses must be positive to fit a power law")
    best = None
    lo, hi = 0.0, floor
    for _ in range(3):  # a coarse grid over c, then two finer ones around the best candidate
        cs = np.linspace(lo, hi, 200, endpoint=False)
        ly = np.log(y[None, :] - cs[:, None])
        mx, my = lx.mean(), ly.mean(axis=1, keepdims=True)
        slope = ((lx - mx)[None, :] * (ly - my)).sum(axis=1) / ((lx - mx) ** 2).sum()
        log_a = my[:, 0] - slope * mx
        pred = np.exp(log_a[:, None] + slope[:, None] * lx[None, :]) + cs[:, None]
        sse = ((pred - y[None, :]) ** 2).sum(axis=1)
        sse[~np.isfinite(sse) | (slope >= 0)] = np.inf
        i = int(np.argmin(sse))
        if not np.isfinite(sse[i]):
            break
        if best is None or sse[i] <= best[0]:
            best = (float(sse[i]), float(np.exp(log_a[i])), float(-slope[i]), float(cs[i]))
        step = (hi - lo) / 200
        lo, hi = max(0.0, cs[i] - step), min(floor, cs[i] + step)
    if best is None:
        raise ValueError("the fit failed: the loss does not fall with compute")
    sse, a, b, c = best
    return {"a": a * scale ** b, "b": b, "c": c, "rmse": math.sqrt(sse / len(y)), "points": int(len(y))}


def loss_at(fit: dict[str, float], compute: float) -> float:
    return fit["a"] * compute ** -fit["b"] + fit["c"]


def compute_for(fit: dict[str, float], loss: float) -> float:
    """Compute at which the fit reaches ``loss`` (inf when the loss is at or below its floor c)."""
    if loss <= fit["c"]:
        return math.inf
    return (fit["a"] / (loss - fit["c"])) ** (1.0 / fit["b"])


def frontier(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """The points (in increasing x) whose y is below every y at a smaller or equal x."""
    kept_x, kept_y, best = [], [], math.inf
    for xi, yi in sorted(zip(xs, ys), key=lambda p: (p[0], p[1])):
        if yi < best:
            kept_x.append(xi)
            kept_y.append(yi)
            best = yi
    return kept_x, kept_y


def load_points(dirs: list[str | Path], x: str, group: str,
                points: str = "frontier") -> dict[str, dict[str, list[float]]]:
    """Evaluation points after the start of every variant in ``dirs``, grouped by family (hydra: CCGQA
    variants; dense: dense variants) or by variant name. ``points="frontier"``: the runs of one variant
    (its seeds) averaged point by point, then the group's ``frontier``; ``"all"``: every run's points."""
    if points not in ("frontier", "all"):
        raise ValueError(f"points={points!r}: choose 'frontier' or 'all'")
    key = X_KEYS[x][0]
    runs: dict[tuple[str, str, str], list[list[tuple[float, float]]]] = {}
    for n, d in enumerate(dirs):
        path = Path(d).expanduser() / "results.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist: pass directories written by `hydra-lm compare --out DIR`")
        try:
            results = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err}): run the compare again") from None
        # Seeds of one experiment: the same variant, budget and settings, in this directory or another
        # (seeds run apart), and for a seconds budget the same device; without a recorded budget, only
        # within the directory.
        settings = {k: v for k, v in results.get("settings", {}).items() if k != "seed"}
        budget = results.get("budget")
        for name, v in results.get("variants", {}).items():
            device = v.get("device") if budget is not None and budget.get("kind") == "seconds" else None
            experiment = json.dumps([budget, settings, device], sort_keys=True) if budget is not None else str(n)
            variant = v.get("variant", name)  # a compare with --seeds: NAME.seedS is a run of NAME
            label = variant if group == "variant" else ("hydra" if v.get("arch", "hydra") == "hydra" else "dense")
            # By evaluation, None where it has no finite loss (a run that diverged): seeds stay aligned.
            pts = [(float(p[key]), float(p["val_loss_causal"])) if p.get(key) and p.get("val_loss_causal") is not None
                   else None for p in v.get("evals", [])]
            runs.setdefault((label, variant, experiment), []).append(pts)
    groups: dict[str, dict[str, list[float]]] = {}
    for (label, _, _), seeds in runs.items():
        g = groups.setdefault(label, {"x": [], "y": []})
        if points == "all":
            for pts in seeds:
                g["x"] += [p[0] for p in pts if p is not None]
                g["y"] += [p[1] for p in pts if p is not None]
            continue
        # Seeds of one budget share their evaluation schedule: average the i-th points where every seed has one. A
        # mean over the seeds that got there would fall where one diverged or stopped, as the fit's floor is decided.
        for i in range(min(len(pts) for pts in seeds)):
            at = [pts[i] for pts in seeds]
            if None not in at:
                g["x"].append(sum(p[0] for p in at) / len(at))
                g["y"].append(sum(p[1] for p in at) / len(at))
    if points == "frontier":
        for g in groups.values():
            g["x"], g["y"] = frontier(g["x"], g["y"])
    return groups


def multiplier(fit: dict[str, float], reference: dict[str, float], at: float) -> float:
    """Reference compute / this group's compute for the loss this group's fit reaches at ``at``."""
    return compute_for(reference, loss_at(fit, at)) / at


def bootstrap_multiplier(g: dict[str, list[float]], ref: dict[str, list[float]], at: float, rounds: int,
                         rng: np.random.Generator) -> tuple[list[float], int]:
    """Multipliers refitted on points resampled with replacement in both groups; also the failed refits."""
    values, failed = [], 0
    gx, gy, rx, ry = (np.asarray(v) for v in (g["x"], g["y"], ref["x"], ref["y"]))
    for _ in range(rounds):
        i, j = rng.integers(0, len(gx), len(gx)), rng.integers(0, len(rx), len(rx))
        try:
            values.append(multiplier(fit_power_law(gx[i], gy[i]), fit_power_law(rx[j], ry[j]), at))
        except ValueError:
            failed += 1
    return values, failed


def run_scaling(dirs: list[str], out: str | None, x: str, group: str, reference: str, predict: float | None,
                bootstrap: int, seed: int, points: str = "frontier") -> int:
    from .plots import write_scaling_plot

    if predict is not None and not (math.isfinite(predict) and predict > 0):
        raise ValueError(f"--predict {predict}: must be a positive compute value")
    if bootstrap < 0:
        raise ValueError(f"--bootstrap {bootstrap}: must be >= 0")
    if seed < 0:  # numpy's own words ("expected non-negative integer") name no flag
        raise ValueError(f"--seed {seed}: must be >= 0")
    groups = load_points(dirs, x, group, points)
    if not groups:
        raise ValueError("the results hold no variants")
    for name, g in groups.items():
        try:
            g["fit"] = fit_power_law(g["x"], g["y"])
        except ValueError as err:
            kept = " on its frontier (--points all fits every run's points)" if points == "frontier" else ""
            raise ValueError(f"cannot fit {name} ({len(g['x'])} points{kept}): {err}; add evaluation points (--evals) "
                             "or compare results of more budgets or sizes") from None
    unit = X_KEYS[x][1]
    rng = np.random.default_rng(seed)
    summary: dict[str, Any] = {"x": x, "points": points, "predict": predict, "reference": reference, "groups": {}}
    print(f"L(C) = a*C^-b + c, C = {unit}, " + ("each group's frontier (seeds averaged; the best run at each compute)"
                                                  if points == "frontier" else "every run's points"))
    for name, g in groups.items():
        fit = g["fit"]
        at = predict or max(g["x"])
        row = {**fit, "compute": at, "loss": loss_at(fit, at)}
        line = (f"  {name:<12} {fit['points']:>4} points  a={fit['a']:.4g} b={fit['b']:.4g} c={fit['c']:.4g} "
                f"(rmse {fit['rmse']:.3g})  loss at {at:.3g}: {row['loss']:.4f}")
        if name != reference and reference in groups:
            point = multiplier(fit, groups[reference]["fit"], at)
            samples, failed = bootstrap_multiplier(g, groups[reference], at, bootstrap, rng)
            finite = [s for s in samples if math.isfinite(s)]
            row["multiplier"] = point if math.isfinite(point) else None
            if finite:
                lo, mid, hi = np.percentile(finite, [16, 50, 84])
                row["multiplier_interval_68"] = [float(lo), float(hi)]
                row["multiplier_median"] = float(mid)
            row["bootstrap"] = {"rounds": bootstrap, "failed_fits": failed,
                                "unreachable": len(samples) - len(finite)}
            reach = f"{point:.3g}x" if math.isfinite(point) else f"never (below {reference}'s floor c)"
            spread = f", 68% interval {row['multiplier_interval_68'][0]:.3g}-{row['multiplier_interval_68'][1]:.3g}" \
                if finite else ", no interval"
            if failed:  # resamples with too few distinct compute values cannot be fitted
                spread += f" ({failed} of {bootstrap} resamples could not be fitted)"
            line += f"\n  {'':<12} {reference} needs {reach} the compute for that loss{spread}"
        summary["groups"][name] = row
        print(line)
    if reference not in groups:
        print(f"note: no group named {reference!r}: no compute multiplier (groups: {', '.join(groups)})")
    out_dir = Path(out or dirs[0]).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = write_scaling_plot(groups, unit, out_dir / "scaling.png", predict)
    write_text_atomic(out_dir / "scaling.json", json.dumps(summary, indent=1))
    print(f"scaling: wrote {plot} and {out_dir / 'scaling.json'}")
    return 0
