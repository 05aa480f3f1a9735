"""The printed table and ``report.md`` of `hydra-lm compare`, both built from ``results.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..train.checkpoint import write_text_atomic
from .routing_health import GAP_TOLERANCE, SHARE_TOLERANCE

# "exec TFLOP/s": executed training FLOPs per training second, what a variant makes of the GPU; a routed
# model can lead per FLOP (loss vs exec FLOPs) and trail per second when this is low.
COLUMNS = ("variant", "params", "tokens", "exec FLOPs", "train s", "exec TFLOP/s", "causal", "top-k", "gap", "agree",
           "tok/s", "peak MB")


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _tflops(v: dict[str, Any]) -> float | None:
    if v["executed_flops"] is None or not v["train_s"]:
        return None
    return v["executed_flops"] / v["train_s"] / 1e12


def _loss(final: dict[str, Any] | None, key: str, spec: str) -> str:
    """A final evaluation's loss (or gap): "nan" where it was not finite (stored as null), "-" without one."""
    if final is None:
        return "-"
    return "nan" if final.get(key) is None else format(final[key], spec)


def table_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for name, v in results["variants"].items():
        final = v["final"]
        label = name if v["status"] == "finished" else f"{name} ({v['status']})"
        rows.append((label, f"{v['params'] / 1e6:.2f}M", f"{v['tokens']:,}", _num(v["executed_flops"], ".3g"),
                     _num(v["train_s"], ".1f"), _num(_tflops(v), ".3g"), _loss(final, "val_loss_causal", ".4f"),
                     _loss(final, "val_loss_topk", ".4f"), _loss(final, "gap", "+.4f"),
                     _num((final or {}).get("val_agreement"), ".1%"),
                     _num(v["tokens_per_s"], ",.0f"), _num(v.get("peak_memory_mb"), ",.0f")))
    return rows


def _text_table(header: tuple[str, ...], body: list[tuple[str, ...]]) -> str:
    rows = [header, *body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def format_table(results: dict[str, Any]) -> str:
    return _text_table(COLUMNS, table_rows(results))


SEED_COLUMNS = ("variant", "seeds", "causal mean", "min", "max", "std")


def _seeds_cell(v: dict[str, Any]) -> str:
    """The seeds a summary averaged; with some left out, how many of the planned ones and why the others."""
    averaged = " ".join(str(x) for x in v["seeds"]) or "-"
    left = v.get("left_out")  # absent from results.json written before it was recorded
    if not left:
        return averaged
    why = ", ".join(f"{seed} {status}" for seed, status in left.items())
    return f"{averaged} ({len(v['seeds'])} of {len(v['planned'])}; left out: {why})"


def seed_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(name, _seeds_cell(v), _num(v["mean"], ".4f"), _num(v["min"], ".4f"),
             _num(v["max"], ".4f"), _num(v["std"], ".4f")) for name, v in results["across_seeds"].items()]


def margin_statistics(hydra: list[float], dense: list[float]) -> dict[str, Any]:
    """How far apart two sets of final losses (one per seed) are: the difference of the means (dense minus
    HYDRA: positive when HYDRA is lower), its standard error and Welch's t with its degrees of freedom
    (None below two seeds on either side), and how many HYDRA seeds end below every dense seed."""
    h, d = np.asarray(hydra, dtype=np.float64), np.asarray(dense, dtype=np.float64)
    out = {"difference": float(d.mean() - h.mean()), "se": None, "t": None, "df": None,
           "below_every_dense": int((h < d.min()).sum()), "n_hydra": len(h), "n_dense": len(d)}
    if len(h) > 1 and len(d) > 1:
        vh, vd = h.var(ddof=1) / len(h), d.var(ddof=1) / len(d)
        se = float(np.sqrt(vh + vd))
        if se > 0:
            df = (vh + vd) ** 2 / (vh**2 / (len(h) - 1) + vd**2 / (len(d) - 1))  # Welch-Satterthwaite
            out.update(se=se, t=out["difference"] / se, df=float(df))
    return out


def seed_margin(results: dict[str, Any]) -> str | None:
    """The best HYDRA variant's mean final causal loss against the best dense variant's: both spreads, the
    margin in standard errors of the difference (Welch's t), and how many HYDRA seeds beat every dense one. Only
    variants trained on the whole budget with every planned seed count: one given another share (budget_scale) is
    not an equal-budget rival, and one ranked by the seeds that survived would win by its lucky ones."""
    best, unranked = {}, []
    for name, v in results["across_seeds"].items():
        arch = "hydra" if v["arch"] == "hydra" else "dense"
        if v["mean"] is None:
            continue
        if not v.get("complete", True) or v.get("budget_scale", 1.0) != 1.0:
            unranked.append(name)
        elif arch not in best or v["mean"] < best[arch][1]["mean"]:
            best[arch] = (name, v)
    if len(best) < 2:
        return None
    (h, hv), (d, dv) = best["hydra"], best["dense"]
    stats = margin_statistics(hv["causal"], dv["causal"])
    who = "below" if stats["difference"] > 0 else "above"
    text = (f"Best HYDRA variant {h} (mean {hv['mean']:.4f}, spread {hv['max'] - hv['min']:.4f} over "
            f"{_of_planned(hv)} seeds) ends {abs(stats['difference']):.4f} nats {who} the best dense variant {d} "
            f"(mean {dv['mean']:.4f}, spread {dv['max'] - dv['min']:.4f} over {_of_planned(dv)} seeds)")
    if stats["t"] is not None:
        # Welch's t over a few seeds: the two-sided 5% level is 2.8 at 4 degrees of freedom, 2.3 at 8; a
        # smaller t is a difference the seeds' own spread can make.
        text += (f": {abs(stats['t']):.1f} standard errors of the difference (Welch's t, "
                 f"{stats['df']:.1f} degrees of freedom{'; too few for t to say much' if stats['df'] < 3 else ''})")
    text += f"; {stats['below_every_dense']} of {stats['n_hydra']} HYDRA seeds end below every dense seed."
    if unranked:
        text += (f" Not ranked: {', '.join(sorted(unranked))} (another budget share, or seeds that diverged, rolled "
                 "back or did not finish).")
    return text


def _of_planned(v: dict[str, Any]) -> str:
    n, planned = len(v["seeds"]), len(v.get("planned", v["seeds"]))
    return str(n) if n == planned else f"{n} of {planned}"


def format_seed_table(results: dict[str, Any]) -> str:
    margin = seed_margin(results)
    return _text_table(SEED_COLUMNS, seed_rows(results)) + (f"\n{margin}" if margin else "")


def _lr_grid(results: dict[str, Any]) -> list[float]:
    return sorted({lr for sweep in results["lr_sweep"].values() for lr in sweep["lrs"]})


def lr_columns(results: dict[str, Any]) -> tuple[str, ...]:
    return ("variant", *(f"lr {lr:g}" for lr in _lr_grid(results)), "best lr")


def _lr_cell(mean: float | None, n: int, planned: int, failed: bool) -> str:
    """A learning rate's mean over its seeds with how many it took; "failed" where a seed diverged, rolled back
    or ended non-finite; "-" with how many finished where some are not trained yet (or raised)."""
    if failed:
        return f"failed ({planned - n} of {planned} unstable)"
    return f"{mean:.4f} (n={n})" if mean is not None else f"- ({n} of {planned} done)"


def lr_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per swept variant, its final causal loss (mean over seeds) at each learning rate of the grid."""
    grid = _lr_grid(results)
    rows = []
    for family, sweep in results["lr_sweep"].items():
        n_lrs = len(sweep["lrs"])
        # results.json written before these were recorded: counts unknown, nothing marked failed
        cells = zip(sweep["causal"], sweep.get("n_seeds", [None] * n_lrs), sweep.get("planned_seeds", [None] * n_lrs),
                    sweep.get("failed", [False] * n_lrs))
        at = {lr: _num(mean, ".4f") if n is None else _lr_cell(mean, n, planned, failed)
              for lr, (mean, n, planned, failed) in zip(sweep["lrs"], cells)}
        mark = {"smallest": " (the smallest tried)", "largest": " (the largest tried)"}.get(sweep["best_at_edge"], "")
        rows.append((family, *(at.get(lr, "-") for lr in grid),
                     "-" if sweep["best_lr"] is None else f"{sweep['best_lr']:g}{mark}"))
    return rows


def format_lr_table(results: dict[str, Any]) -> str:
    return _text_table(lr_columns(results), lr_rows(results))


def first_reach(evals: list[dict[str, Any]], key: str, target: float) -> tuple[float, bool] | None:
    """The ``key`` ("train_s" or "flops") at which a run's causal validation loss first reached ``target``,
    linearly interpolated between the two evaluations around the crossing, and whether that is only an upper
    bound (reached by the first evaluation after the start, e.g. one evaluation per run); None if never."""
    points = sorted((p[key], p["val_loss_causal"]) for p in evals
                    if p.get(key) is not None and p.get("val_loss_causal") is not None)
    before = None
    for x, loss in points:
        if loss <= target:
            # Not interpolated from the start (the untrained model's loss, at 0): the loss falls steeply and
            # far from linearly after it, so a straight line from there would read a time the run never showed.
            if before is None or before[0] <= 0:
                return x, x > 0
            x0, loss0 = before
            return x0 + (loss0 - target) / (loss0 - loss) * (x - x0), False
        before = (x, loss)
    return None


REACH_COLUMNS = ("variant", "dense variant", "its final loss", "train s to reach it", "x its train s",
                 "exec FLOPs to reach it", "x its exec FLOPs")


def reach_rows(results: dict[str, Any]) -> list[tuple[str, ...]]:
    """For each routed variant and each finished dense one of the same seed: the training seconds and
    executed FLOPs the routed one took to reach the dense one's final causal loss, and their ratios to
    what the dense run spent (the quality issue's "<= 0.7x dense's seconds" reads off here)."""
    variants = results["variants"]
    dense = {n: v for n, v in variants.items()
             if v["arch"] == "dense" and v["status"] == "finished" and (v["final"] or {}).get("val_loss_causal")}
    rows = []
    for name, v in variants.items():
        if v["arch"] == "dense" or not v["evals"]:
            continue
        for dname, d in dense.items():
            if d.get("seed") != v.get("seed"):
                continue
            target = d["final"]["val_loss_causal"]
            # A routed run that stopped early may still have reached the loss first: kept, with how it ended.
            row = [name if v["status"] == "finished" else f"{name} ({v['status']})", dname, f"{target:.4f}"]
            for key, total, spec in (("train_s", d["train_s"], ".1f"), ("flops", d["executed_flops"], ".3g")):
                reached = first_reach(v["evals"], key, target)
                if reached is None:
                    row += ["not reached", "-"]
                    continue
                at, bound = reached[0], "<= " if reached[1] else ""
                row += [bound + format(at, spec), bound + _num(at / total if total else None, ".2f")]
            rows.append(tuple(row))
    return rows


def _markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _own_optimizers(results: dict[str, Any]) -> str:
    """The variants trained with another optimizer or learning rate than the shared settings (under --lrs, another
    optimizer: every run has a learning rate of the grid)."""
    s, swept = results["settings"], bool(results.get("lr_sweep"))
    own = list(dict.fromkeys(  # one entry per variant, however many seeds it ran
        f"{v.get('variant', name)}: {v['optimizer']}, {v['lr']:g} -> {v['min_lr']:g}"
        for name, v in results["variants"].items()
        if "lr" in v and (v["optimizer"] != s.get("optimizer", "adamw")
                          or not swept and (v["lr"] != s["lr"] or v["min_lr"] != s["min_lr"]))))
    return f" Optimizer and learning rate of their own: {'; '.join(own)}." if own else ""


def _own_budgets(results: dict[str, Any]) -> str:
    """The variants trained for a share of the budget (``budget_scale``)."""
    own = dict.fromkeys(f"{v.get('variant', name)} x{v['budget_scale']:g}" for name, v in results["variants"].items()
                        if v.get("budget_scale", 1.0) != 1.0)
    return f" A share of the budget of their own: {', '.join(own)}." if own else ""


def eval_spacing(settings: dict[str, Any], budget_kind: str) -> str:
    """When the runs were evaluated, from the recorded settings (results.json from before ``eval_at_start`` and
    ``schedule_steps`` were recorded: the defaults, at the start and on a 1000-step clock)."""
    evals, every = settings["evals"], settings["eval_every"]
    if evals is None and every == 0:
        between, end = None, "at the end only (--eval_every 0)"
    elif evals is None and budget_kind == "seconds":
        # The trainer places --eval_every on the schedule's clock, which splits the time budget into its steps.
        clock = settings.get("schedule_steps") or 1000
        between, end = (f"every {every}/{clock} of the training-time budget (--eval_every {every} counts steps of "
                        f"the schedule, which a seconds budget divides into {clock})"), "at the end"
    elif evals is None:
        between, end = f"every {every} steps (--eval_every)", "at the end"
    elif evals == 1:
        between, end = None, "at the end"
    elif budget_kind == "seconds":
        between, end = f"every 1/{evals} of the training-time budget", "at the end"
    else:
        between, end = f"every ceil(steps / {evals}) steps", "at the end"
    points = [p for p in ("at the start" if settings.get("eval_at_start", True) else None, between) if p]
    if not points:
        return end
    return f"{points[0]} and {end}" if len(points) == 1 else f"{', '.join(points)}, and {end}"


def _steps(v: dict[str, Any], budget_kind: str) -> str:
    """A run's steps: under a seconds budget those it made in its time (its max_steps is the schedule's clock)."""
    if budget_kind == "seconds":
        return f"{v['steps']} steps in its training-time budget"
    if v["steps"] != v["max_steps"]:
        return f"{v['steps']} of {v['max_steps']} scheduled steps"
    return f"{v['max_steps']} scheduled steps"


def write_report(results: dict[str, Any], plots: list[Path], path: Path) -> None:
    s, budget = results["settings"], results["budget"]
    spacing = eval_spacing(s, budget["kind"])
    # Under --lrs no run trains at the shared learning rate: each takes one of the grid.
    lr = "peak learning rates from the --lrs grid (below)" if results.get("lr_sweep") else \
        f"learning rate {s['lr']:g} -> {s['min_lr']:g}"
    seeds = (f"seeds {', '.join(map(str, s['seed']))} (every variant once per seed)" if isinstance(s["seed"], list)
             else f"seed {s['seed']}")
    lines = [
        "# HYDRA variant comparison",
        "",
        f"Budget **{budget['kind']} = {budget['value']:g}** per variant on `{results['data']}`: preset "
        f"{s['model_size']}, batch {s['batch_size']} x {s['seq_len']} tokens x accumulation {s['grad_accum']} "
        f"({s['tokens_per_step']:,} tokens/step), {lr} ({s['schedule']}), "
        f"{seeds}" + (f", model overrides {s['model_overrides']}" if s["model_overrides"] else "") + "."
        + _own_optimizers(results) + _own_budgets(results),
        f"Validation loss is measured {spacing}, with causal routing (what "
        "generation does) and top-k routing (teacher-forced). Executed FLOPs count the tokens each routed unit "
        "really processes, following the routing curriculum; training seconds exclude evaluation, checkpoints "
        "and compilation at the start of a run.",
        "",
        "## Results",
        "",
        *_markdown_table(COLUMNS, table_rows(results)),
        "",
    ]
    reach = reach_rows(results)
    if reach:
        lines += ["## Time and compute to each dense model's final loss", "",
                  "Training seconds and executed FLOPs after which each routed variant's causal validation loss "
                  "first reached a dense variant's final one, linearly interpolated between its evaluations, and "
                  "their ratios to what the dense run spent. The routed run is read before the end of its own "
                  "schedule: a run given only that budget would decay its learning rate sooner and likely get there "
                  "earlier, so the ratios tend to overstate what it needs. \"<=\": reached by its first "
                  "evaluation after the start (nothing is interpolated from the untrained model's loss), so only "
                  "bounded (evaluate more often: --evals).", "",
                  *_markdown_table(REACH_COLUMNS, reach), ""]
    if results.get("across_seeds"):
        margin = seed_margin(results)
        lines += ["## Across seeds", "",
                  "Final causal validation loss of each variant over its seeds (finished runs with a finite loss; "
                  "where some of its seeds are left out, the seeds column says how many of them it averaged and "
                  "why the others are not).",
                  "", *_markdown_table(SEED_COLUMNS, seed_rows(results)), "", *([margin, ""] if margin else [])]
    if results.get("lr_sweep"):
        lines += ["## Learning rate per variant", "",
                  "Final causal validation loss of each variant at each peak learning rate (the mean over all of its "
                  "seeds, n of them), and its best. A rate at which any seed diverged, rolled back or ended on a "
                  "non-finite loss is marked failed and never best; one with seeds not trained yet has no mean. "
                  "Rank the variants by their best; a best at an end of the grid may not be the variant's optimum.",
                  "", *_markdown_table(lr_columns(results), lr_rows(results)), ""]
    lines += [
        "## Variants",
        "",
    ]
    for name, v in results["variants"].items():
        routed = " with routing on" if v["routing"] else ""
        on = f" on {v['device']}" if v.get("device") else ""
        lines.append(f"- **{name}** ({v['arch']}{on}, {v['params']:,} parameters, {_steps(v, budget['kind'])}, "
                     f"{v['flops_per_token']:.3g} executed training FLOPs/token{routed}; evaluation "
                     f"{_num(v['eval_s'], '.1f')} s and compilation {_num(v['startup_s'], '.1f')} s not counted as "
                     f"training time): {v['description']}; run directory `{v['run_dir']}`")
    lines += ["", "## Routing health", "",
              f"Executed share of tokens per router with causal routing against its top-k target, at the final "
              f"checkpoint; agreement is the share of tokens where the causal threshold makes the top-k choice "
              f"(\"off\": a router the curriculum kept switched off, left out of the agreement means). "
              f"Warnings: a share under 1/{SHARE_TOLERANCE:g} or over {SHARE_TOLERANCE:g} times its target, or a "
              f"causal loss more than "
              f"{GAP_TOLERANCE} nats above the top-k loss.", ""]
    routed = {name: v for name, v in results["variants"].items() if v["routing"]}
    if not routed:
        lines.append("No variant has routers.")
    for name, v in routed.items():
        # The target is what top-k ran (its share of the row), so the column beside it is the ratio the warnings judge.
        rows = [(router, f"{r['target']:.4f}", f"{r['exec_causal']:.4f}",
                 f"{r['exec_causal'] / r['target']:.2f}x" if r["target"] > 0 else "-",
                 "off" if r.get("agreement") is None else f"{r['agreement']:.3f}")
                for router, r in v["routing"].items()]
        overall = (v["final"] or {}).get("val_agreement_decisions")
        summary = [] if overall is None else [f"Agreement over all of its routing decisions (each router weighted "
                                              f"by its candidates): {overall:.1%}.", ""]
        lines += [f"**{name}**", "", *summary,
                  *_markdown_table(("router", "target (top-k)", "causal", "causal / target", "agreement"), rows), ""]
    lines += ["## Warnings", ""]
    lines += [f"- {w}" for w in results["warnings"]] or ["None."]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    write_text_atomic(path, "\n".join(lines) + "\n")
