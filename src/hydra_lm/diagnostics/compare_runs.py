"""The runs of a `hydra-lm compare`: its budget, each variant's planned run, the FLOPs a run executes
under its routing curriculum, and the marker a finished run leaves in its directory (so a later call
skips it). Shared by the planning and training (``compare``) and the results (``compare_results``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import HydraConfig
from ..model.accounting import flops_per_token_in_phase
from ..train.checkpoint import write_text_atomic
from ..train.curriculum import CurriculumPlan
from ..train.data_io import DataInfo
from ..train.metrics import METRICS_FILE
from ..train.options import TrainConfig
from .variants import Variant

BUDGET_KINDS = ("tokens", "flops", "seconds")
SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}  # tokens and flops: magnitudes
TIME_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}  # seconds: 10m is ten minutes, not ten million seconds
MARKER = "compare.json"

@dataclass(frozen=True)
class Budget:
    kind: str
    value: float

    def __str__(self) -> str:
        return f"{self.kind}={self.value:g}"


def parse_budget(text: str) -> Budget:
    """``tokens=2e6``, ``flops=5e15``, ``seconds=600``; tokens and flops take k/M/G/T/P suffixes (``tokens=2M``),
    seconds the units s/m/h (``seconds=10m``: 600)."""
    kind, eq, raw = str(text).partition("=")
    kind = kind.strip().lower()
    hint = "write --budget KIND=N with KIND one of tokens, flops, seconds (e.g. --budget tokens=2e6)"
    if not eq or kind not in BUDGET_KINDS:
        raise ValueError(f"--budget {text!r}: {hint}")
    raw = raw.strip().replace("_", "")
    units, named = (TIME_UNITS, "s, m or h (seconds=10m)") if kind == "seconds" else \
        (SUFFIXES, "k, M, G, T or P (tokens=2M)")
    # A letter after a number's digits (not an exponent's "e").
    suffix = raw[-1].lower() if raw[-2:-1] in set("0123456789.") and raw[-1:].isalpha() and raw[-1] not in "eE" else ""
    if suffix and suffix not in units:
        raise ValueError(f"--budget {text!r}: {kind} takes the suffixes {named}, not {raw[-1]!r}")
    try:
        value = float(raw[:-1] if suffix else raw) * units.get(suffix, 1.0)
    except ValueError:
        raise ValueError(f"--budget {text!r}: {raw!r} is not a number; {hint}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--budget {text!r}: the budget must be a positive finite number")
    return Budget(kind, value)


@dataclass
class VariantRun:
    variant: Variant
    run_dir: Path
    values: dict[str, Any]  # the trainer settings of this variant
    model_cfg: HydraConfig
    name: str  # the run's key in results.json: the variant's name, with ".seedS" under --seeds
    seed: int | None = None  # --seeds: the seed of this run


@dataclass
class ComparePlan:
    out: Path
    budget: Budget
    runs: list[VariantRun]
    data: DataInfo
    base: TrainConfig  # the settings shared by every variant, resolved
    evals: int | None  # None: --eval_every given instead
    tokens_per_step: int
    seeds: list[int] | None = None  # --seeds


# ---------------------------------------------------------------------------- FLOPs accounting
def planned_flops(model_cfg: HydraConfig, cfg: TrainConfig, steps: int, tokens_per_step: int) -> float:
    """Executed FLOPs of a run of ``steps`` steps: routing starts off and switches on as the
    curriculum plans it (MoD at the latest step the plan allows: its loss gate may open earlier), and
    ``--mor_ramp`` moves the MoR capacities through their levels, each counted for its own steps."""
    routable = (model_cfg.arch == "hydra" and model_cfg.mod_enabled,
                model_cfg.arch == "hydra" and model_cfg.mor_enabled and model_cfg.recursions > 1)
    plan = CurriculumPlan.from_config(cfg.replace(max_steps=steps), routable)
    mod_on = plan.mod_gate_step if plan.loss_gate is None else plan.mod_force_step
    changes = (mod_on, plan.mor_step, *plan.ramp_steps())
    switches = sorted({0, steps, *(min(s, steps) for s in changes if s is not None)})
    cache: dict = {}
    total = 0.0
    for start, end in zip(switches, switches[1:]):
        mod = mod_on is not None and start >= mod_on
        mor = plan.mor_step is not None and start >= plan.mor_step
        fpt = flops_per_token_in_phase(model_cfg, cfg.seq_len, mod, mor, plan.ramp_level(start), cache)
        total += (end - start) * fpt
    return total * tokens_per_step


def steps_for_flops(budget: float, model_cfg: HydraConfig, cfg: TrainConfig, tokens_per_step: int) -> int:
    """The fewest steps whose planned executed FLOPs reach ``budget`` (planned FLOPs grow with steps)."""
    # The ramp only adds tokens to MoR's configured capacities: its levels are never the cheapest.
    cheapest = min(flops_per_token_in_phase(model_cfg, cfg.seq_len, m, r) for m in (False, True) for r in (False, True))
    lo, hi = 1, max(1, math.ceil(budget / (cheapest * tokens_per_step)))
    while lo < hi:
        mid = (lo + hi) // 2
        if planned_flops(model_cfg, cfg, mid, tokens_per_step) >= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def executed_flops_at(steps: list[int], train_records: list[dict], model_cfg: HydraConfig, seq_len: int,
                      tokens_per_step: int) -> list[float]:
    """Cumulative executed FLOPs at ``steps``, from the curriculum state logged with each train record
    (a logged window is counted in the state at its end; records written before the MoR ramp was logged
    count its configured capacities)."""
    cache: dict = {}
    marks, totals, total, previous = [0], [0.0], 0.0, 0
    for r in train_records:
        fpt = flops_per_token_in_phase(model_cfg, seq_len, bool(r.get("mod_active", True)),
                                       bool(r.get("mor_active", True)), float(r.get("mor_ramp", 1.0)), cache)
        total += (r["step"] - previous) * fpt * tokens_per_step
        previous = r["step"]
        marks.append(previous)
        totals.append(total)
    return [float(x) for x in np.interp(steps, marks, totals)]


# ---------------------------------------------------------------------------- run bookkeeping
def _fingerprint(values: dict[str, Any]) -> dict[str, Any]:
    """The settings that define a variant's run (not where it is written, on which device, or how often it
    saves checkpoints and how many it keeps)."""
    return json.loads(json.dumps({k: v for k, v in values.items()
                                  if k not in ("out", "device", "resume", "keep_checkpoints", "save_every")}))


def read_marker(run: VariantRun) -> dict[str, Any] | None:
    """The marker a compare left in a run's directory, whatever its status; None for a run never started. A run
    started or finished under other settings is an error: resumed or reported, it would mix two studies. So is a
    directory that holds a run's checkpoints or metrics without a marker to read (a `hydra-lm train` run left
    there, say): compare writes its marker before the trainer writes either, so such a run is not one of its own."""
    path = run.run_dir / MARKER
    marker = None
    if path.is_file():
        try:
            marker = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            pass
    if not isinstance(marker, dict):
        checkpoints = run.run_dir / "checkpoints"
        held = [what for what, there in (("checkpoints", checkpoints.is_dir() and any(checkpoints.iterdir())),
                                         (METRICS_FILE, (run.run_dir / METRICS_FILE).is_file())) if there]
        if held:
            why = "an unreadable" if path.is_file() else "no"
            raise ValueError(f"{run.run_dir} holds a run ({' and '.join(held)}) with {why} compare marker ({MARKER}), "
                             "e.g. one `hydra-lm train` left there: compare would resume it under its own settings and "
                             "mix its steps into the results; use a new --out directory, or remove that run directory "
                             "to train it again")
        return None
    was, now = _fingerprint(marker.get("settings", {})), _fingerprint(run.values)
    if was != now:
        diff = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
        raise ValueError(f"{run.run_dir} was trained by an earlier compare with other settings ({', '.join(diff)}): "
                         "use a new --out directory, or remove that run directory to train it again")
    return marker


def finished_marker(run: VariantRun) -> dict[str, Any] | None:
    """The marker of a run that finished (or diverged); None for one not trained yet, cut short or failed (the next
    call trains those)."""
    marker = read_marker(run)
    return None if marker is None or marker.get("status") in ("started", "failed") else marker


def write_marker(run: VariantRun, status: str) -> None:
    """Record a variant's run as started, finished, diverged or failed (it raised) with its settings (its routing
    health is its last evaluation's, in its metrics)."""
    marker = {"status": status, "variant": run.variant.overrides, "settings": _fingerprint(run.values)}
    run.run_dir.mkdir(parents=True, exist_ok=True)  # a run that failed before the trainer made it
    write_text_atomic(run.run_dir / MARKER, json.dumps(marker, indent=1))
