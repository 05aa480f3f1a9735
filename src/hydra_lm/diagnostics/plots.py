"""PNG plots of `hydra-lm compare` and `hydra-lm scaling` results (matplotlib, Agg canvas, no display).

The package's only plotting code: every figure goes through ``_figure``, ``_finish`` and ``_save``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .routing_health import GAP_TOLERANCE


def _figure(width: float = 7.0, height: float = 4.5):
    # The object API with an Agg canvas: no pyplot state, no display needed, safe in any process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.tight_layout()
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _finish(ax, x_label: str, y_label: str, title: str, legend_columns: int = 1, **grid) -> None:
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(alpha=0.3, **grid)
    if ax.get_legend_handles_labels()[0]:  # an empty plot (no evaluation yet) has nothing to name
        ax.legend(fontsize=7, ncol=legend_columns)


def _colors(names: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def _empty_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _family_colors(variants: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """One colour per variant, shared by its seeds' runs (keyed by run name), and each variant's run count:
    with several seeds, a colour per run would repeat tab10's ten colours across variants."""
    family = {name: v.get("variant", name) for name, v in variants.items()}
    counts = Counter(family.values())  # first-seen order: the variants' order
    by_family = _colors(list(counts))
    return {name: by_family[f] for name, f in family.items()}, dict(counts)


def write_compare_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    variants = results["variants"]
    colors, runs_of = _family_colors(variants)
    paths = []
    for key, label, name in (("tokens", "training tokens", "loss_vs_tokens.png"),
                             ("flops", "executed training FLOPs", "loss_vs_flops.png"),
                             ("train_s", "training seconds (no eval, checkpoints or compilation)",
                              "loss_vs_seconds.png")):
        fig = _figure()
        ax = fig.add_subplot()
        labelled: set[str] = set()
        for vname, v in variants.items():
            pts = [p for p in v["evals"] if p.get(key) is not None]
            if not pts:
                continue
            family = v.get("variant", vname)
            seeds = f" ({runs_of[family]} seeds)" if runs_of[family] > 1 else ""
            first = family not in labelled
            labelled.add(family)
            x = [p[key] for p in pts]
            ax.plot(x, [p["val_loss_causal"] for p in pts], "-o", ms=3, color=colors[vname],
                    label=f"{family} causal{seeds}" if first else None)
            ax.plot(x, [p["val_loss_topk"] for p in pts], "--", color=colors[vname], alpha=0.6,
                    label=f"{family} top-k" if first else None)
        if not labelled:
            _empty_note(ax, "no evaluation yet")
        _finish(ax, label, "validation loss (nats/token)", f"validation loss vs {label.split(' (')[0]}", 2)
        paths.append(_save(fig, out_dir / name))
    paths.append(_routing_plot(variants, colors, out_dir / "routing_exec_fraction.png"))
    paths.append(_depth_plot(variants, colors, out_dir / "mor_depth_histogram.png"))
    paths.append(_gap_plot(variants, colors, out_dir / "causal_topk_gap.png"))
    return paths


def _routing_plot(variants: dict[str, Any], colors: dict[str, Any], path: Path) -> Path:
    fig = _figure(6.0, 5.0)
    ax = fig.add_subplot()
    routed = {name: v["routing"] for name, v in variants.items() if v.get("routing")}
    if not routed:
        _empty_note(ax, "no variant has routers")
    else:
        ax.plot([0, 1], [0, 1], color="black", lw=0.8, label="executed = target")
        ax.fill_between([0, 1], [-0.1, 0.9], [0.1, 1.1], color="gray", alpha=0.15, label="within 0.1")
        for name, routers in routed.items():
            ax.scatter([r["target"] for r in routers.values()], [r["exec_causal"] for r in routers.values()],
                       color=colors[name], s=25, label=name)
        ax.set_xlim(0, 1.05)
        ax.set_ylim(0, 1.05)
        _finish(ax, "target share of tokens (top-k training)", "executed share, causal routing",
                "per-router executed fraction vs target (final checkpoint)")
    return _save(fig, path)


def _depth_plot(variants: dict[str, Any], colors: dict[str, Any], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    deep = {name: v["depths"] for name, v in variants.items() if v.get("depths")}
    if not deep:
        _empty_note(ax, "no variant routes with MoR (dense, recursions = 1 or MoR off)")
    else:
        width = 0.8 / len(deep)
        for i, (name, d) in enumerate(deep.items()):
            depth = np.arange(1, len(d["causal"]) + 1)
            x = depth - 0.4 + width * (i + 0.5)
            ax.bar(x, d["causal"], width=width, color=colors[name], label=f"{name} causal")
            ax.scatter(x, d["target"], marker="_", s=200, color="black", zorder=3,
                       label="target" if i == 0 else None)
        ax.set_xticks(range(1, max(len(d["causal"]) for d in deep.values()) + 1))
        ax.set_ylim(0, 1.05)
        _finish(ax, "recursion depth", "share of a block's entered tokens reaching it",
                "MoR depth histogram (final checkpoint, mean over blocks)", axis="y")
    return _save(fig, path)


def _gap_plot(variants: dict[str, Any], colors: dict[str, Any], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    for name, v in variants.items():
        pts = v["evals"]
        if pts:
            ax.plot([p["tokens"] for p in pts], [p["gap"] for p in pts], "-o", ms=3, color=colors[name], label=name)
    if not any(v["evals"] for v in variants.values()):
        _empty_note(ax, "no evaluation yet")
    ax.axhline(GAP_TOLERANCE, color="red", lw=0.8, ls=":", label=f"warning at {GAP_TOLERANCE}")
    ax.axhline(0.0, color="black", lw=0.6)
    _finish(ax, "training tokens", "causal - top-k validation loss (nats)", "causal-minus-top-k gap over training")
    return _save(fig, path)


def write_scaling_plot(groups: dict[str, dict[str, Any]], x_label: str, path: Path,
                       predict: float | None = None) -> Path:
    """Points and fitted curves L(C) = a*C^-b + c per group, on a log compute axis."""
    fig = _figure()
    ax = fig.add_subplot()
    colors = _colors(list(groups))
    top = max([max(g["x"]) for g in groups.values()] + ([predict] if predict else []))
    low = min(min(g["x"]) for g in groups.values())
    grid = np.geomspace(low, top, 200)
    for name, g in groups.items():
        ax.scatter(g["x"], g["y"], s=12, color=colors[name], alpha=0.7, label=f"{name} ({len(g['x'])} points)")
        fit = g.get("fit")
        if fit:
            a, b, c = fit["a"], fit["b"], fit["c"]
            ax.plot(grid, a * grid ** -b + c, color=colors[name],
                    label=f"{name}: {a:.3g}*C^-{b:.3g} + {c:.3g}")
            if predict:
                ax.scatter([predict], [a * predict ** -b + c], marker="*", s=120, color=colors[name], zorder=3)
    if predict:
        ax.axvline(predict, color="gray", ls=":", lw=0.8)
    ax.set_xscale("log")
    _finish(ax, x_label, "validation loss, causal (nats/token)", "scaling fit L(C) = a*C^-b + c", which="both")
    return _save(fig, path)
