"""The model variants `hydra-lm compare` trains: built-in ones and ``--variant NAME:field=value,...``.

A variant is a set of HydraConfig fields applied on top of the model settings shared by every
variant (preset and ``--model.FIELD`` overrides). The dense baselines pick their depth so that one
quantity matches the HYDRA model built from the same shared settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..config import HYDRA_ONLY_FIELDS, HydraConfig, check_keys
from ..model.accounting import executed_flops_per_token
from ..train.flags import parse_value
from ..train.options import TrainConfig, normalize

BUILTIN_VARIANTS = {
    "hydra": "the preset as is: CCGQA attention with MoD and MoR routing",
    "dense": "dense GQA, same width, depth with the parameter count closest to hydra's",
    "dense-flops": "dense GQA, same width, depth with the executed training FLOPs/token closest to hydra's",
    "vanilla": "CCGQA with routing off: every token runs every block at full depth",
    "mod": "MoD routing only (MoR off: fixed full depth)",
    "mor": "MoR routing only (MoD off)",
}
DEFAULT_VARIANTS = ("hydra", "dense", "dense-flops")
# Trainer settings a custom variant may set too: when routing switches on is part of a routing
# setting's cost (a run that routes late spends its first steps at full depth), and the optimizer
# with its learning rates (comparing optimizers at one budget; batch and schedule stay shared).
CURRICULUM_FIELDS = ("mod_enable_pct", "mod_force_enable_pct", "mod_loss_gate", "mor_enable_pct", "mor_ramp",
                     "mor_ramp_pct", "mod_off", "mor_off")
OPTIMIZER_FIELDS = ("optimizer", "lr", "min_lr", "adamw_lr", "weight_decay")
# The matmuls' precision likewise (bf16 against float8 at one budget).
PRECISION_FIELDS = ("experimental_fp8", "fp8_format", "fp8_recipe", "fp8_min_tokens")
TRAIN_FIELDS = CURRICULUM_FIELDS + OPTIMIZER_FIELDS + PRECISION_FIELDS
MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(HydraConfig))
# Trainer settings compare sets for every variant from its own flags.
BUDGET_OWNED = ("max_steps", "time_budget_s", "stop_at_step")
# A variant's share of the shared budget (budget_scale=0.7: 70% of the seconds, tokens or FLOPs), so
# "reaches the other's loss in 0.7x its time" is one run trained, schedule and all, to that budget.
BUDGET_SCALE = "budget_scale"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # HydraConfig fields, arch included
    description: str = ""
    train: dict[str, Any] = field(default_factory=dict)  # TRAIN_FIELDS of the trainer
    swept_from: str | None = None  # --lrs: the variant this is one learning rate of
    budget_scale: float = 1.0  # its share of the shared budget

    @property
    def arch(self) -> str:
        return self.overrides.get("arch", "hydra")


def parse_custom_variant(spec: str) -> Variant:
    """``NAME:field=value,field=value``: HydraConfig fields (values parsed like ``--model.FIELD VALUE``),
    the routing curriculum's trainer settings, the optimizer's and the matmuls' precision (TRAIN_FIELDS)."""
    name, sep, body = spec.partition(":")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise ValueError(f"--variant {spec!r}: write NAME:field=value,... (NAME of letters, digits, '_', '-', "
                         "'.'; e.g. --variant cap50:mod_capacity=0.5)")
    if name in BUILTIN_VARIANTS:
        raise ValueError(f"--variant {spec!r}: {name} is a built-in variant; give the custom one another name")
    overrides: dict[str, Any] = {}
    train: dict[str, Any] = {}
    scale = 1.0
    seen: set[str] = set()
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--variant {spec!r}: {item!r} is not field=value")
        key = key.strip()
        if key in seen:
            raise ValueError(f"--variant {name}: {key} is given twice; give each field once")
        seen.add(key)
        if key == BUDGET_SCALE:
            scale = parse_value(raw.strip())
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 100:
                raise ValueError(f"--variant {name}: budget_scale={raw.strip()} must be a number in (0, 100], the "
                                 "variant's share of the budget (e.g. budget_scale=0.7)")
            continue
        (train if key in TRAIN_FIELDS else overrides)[key] = parse_value(raw.strip())
    if not overrides and not train and scale == 1.0:
        raise ValueError(f"--variant {spec!r}: no field=value given; to train the preset as is use --variants hydra")
    check_variant_keys(name, overrides)
    try:
        check_keys(overrides)  # the values' types (every key is known by now)
    except ValueError as err:
        raise ValueError(f"--variant {name}: {err}") from None
    train = normalize(train, f"--variant {name}")  # the trainer's types and choices, as for its flags
    check_fields_apply(name, overrides, train)
    described = {**overrides, **train, **({BUDGET_SCALE: scale} if scale != 1.0 else {})}
    return Variant(name, overrides, "custom: " + ", ".join(f"{k}={v}" for k, v in described.items()), train,
                   budget_scale=float(scale))


def check_variant_keys(name: str, overrides: dict[str, Any]) -> None:
    """Refuse a field a variant cannot set, saying where it goes instead: a trainer setting every variant shares
    (its compare flag), the preset (--model_size), or a name that is no field at all."""
    for key in overrides:
        if key == "preset":
            raise ValueError(f"--variant {name}: preset={overrides[key]} does not resize a variant (every variant "
                             "shares the preset): pick the size for the whole compare with --model_size (e.g. "
                             "--model_size 50M), or give this variant its own dim, n_blocks, recursions, n_heads ...")
        if key in MODEL_FIELDS:
            continue
        if key in BUDGET_OWNED:
            raise ValueError(f"--variant {name}: {key} is set by compare from --budget for every variant: give this "
                             "one a share of the budget with budget_scale=F (e.g. budget_scale=0.5)")
        if key in {f.name for f in dataclasses.fields(TrainConfig)}:
            flag = "--seed, or --seeds S1 S2 ... for several" if key == "seed" else f"--{key}"
            raise ValueError(f"--variant {name}: {key} is a trainer setting every variant shares: set it once for "
                             f"the whole compare with {flag}; a variant sets model fields and, of the trainer's, only "
                             f"{', '.join(TRAIN_FIELDS)}")
        try:
            check_keys({key: overrides[key]})
        except ValueError as err:
            raise ValueError(f"--variant {name}: {err} (or one of the curriculum settings "
                             f"{', '.join(CURRICULUM_FIELDS)}, the optimizer settings {', '.join(OPTIMIZER_FIELDS)}, "
                             f"or the precision settings {', '.join(PRECISION_FIELDS)})") from None


def check_fields_apply(name: str, overrides: dict[str, Any], train: dict[str, Any]) -> None:
    """Refuse fields the variant's architecture ignores: the run would be a built-in model trained again under a
    new name."""
    if overrides.get("arch", "hydra") == "dense":
        ignored = [k for k in (*overrides, *train) if k in HYDRA_ONLY_FIELDS or k in CURRICULUM_FIELDS]
        if ignored:
            them = "it" if len(ignored) == 1 else "them"
            raise ValueError(f"--variant {name}: the dense baseline has no routing, recursion or CCGQA attention, "
                             f"so {', '.join(ignored)} would change nothing: drop {them} (dense variants take dim, "
                             "n_layers, n_heads, n_kv_heads, mlp_hidden ...), or leave arch=dense out to vary the "
                             "HYDRA model")
    elif "n_layers" in overrides:
        raise ValueError(f"--variant {name}: n_layers sets the depth of the dense baseline only (arch=dense); a HYDRA "
                         "model's depth is n_blocks x recursions: set those, or add arch=dense")


def resolve_variants(names: list[str], customs: list[Variant],
                     model_config: Callable[[dict[str, Any]], HydraConfig], seq_len: int) -> list[Variant]:
    """Built-in ``names`` (with the dense depths worked out) followed by the custom variants.

    ``model_config(overrides)`` builds the HydraConfig the trainer would build for a variant."""
    for name in names:
        if name not in BUILTIN_VARIANTS:
            close = difflib.get_close_matches(name, list(BUILTIN_VARIANTS), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise ValueError(f"unknown variant {name!r}{hint}; built-in variants: {', '.join(BUILTIN_VARIANTS)}; "
                             "or define one with --variant NAME:field=value,...")
    chosen = list(dict.fromkeys(names))
    taken = set(chosen)
    for custom in customs:
        if custom.name in taken:
            raise ValueError(f"variant {custom.name} is given twice: give each --variant its own name")
        taken.add(custom.name)
    hydra = model_config({}) if any(n.startswith("dense") for n in chosen) else None
    out = []
    for name in chosen:
        overrides: dict[str, Any] = {
            "hydra": {},
            "vanilla": {"mod_enabled": False, "mor_enabled": False},
            "mod": {"mor_enabled": False},
            "mor": {"mod_enabled": False},
        }.get(name, {})
        if name == "dense":
            target = parameter_count(hydra)
            depth = closest_depth(lambda n: parameter_count(model_config({"arch": "dense", "n_layers": n})), target)
            overrides = {"arch": "dense", "n_layers": depth}
        elif name == "dense-flops":
            target = executed_flops_per_token(hydra, seq_len, training=True)
            depth = closest_depth(lambda n: executed_flops_per_token(
                model_config({"arch": "dense", "n_layers": n}), seq_len, training=True), target)
            overrides = {"arch": "dense", "n_layers": depth}
        out.append(Variant(name, overrides, BUILTIN_VARIANTS[name]))
    return out + list(customs)


def sweep_learning_rates(variants: list[Variant], lrs: list[float],
                         extra: dict[str, list[float]] | None = None) -> list[Variant]:
    """Each variant once per peak learning rate, named ``NAME.lrX``, and once more per learning rate
    ``extra`` adds to it (``--lr_extend``). One shared learning rate favours whichever model it happens to
    suit (at one minute on an H100, 2.5x the default helped dense more than HYDRA; with each at its best,
    the ranking of MoD only and dense turned: benchmarks/BENCHMARKS.md, twenty-first and twenty-second
    sessions), so a fair ranking takes each model at its best."""
    if not lrs or len(set(lrs)) != len(lrs) or not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise ValueError(f"--lrs {' '.join(f'{lr:g}' for lr in lrs)}: give distinct learning rates > 0 "
                         "(e.g. --lrs 6e-4 1.5e-3 3e-3)")
    for v in variants:
        if "lr" in v.train:
            raise ValueError(f"--lrs sets every variant's learning rate and variant {v.name} sets lr itself: "
                             "drop one of them")
    extra = extra or {}
    return [replace(v, name=f"{v.name}.lr{lr:g}", description=f"{v.description}; learning rate {lr:g}",
                    train={**v.train, "lr": lr}, swept_from=v.name)
            for v in variants for lr in sorted({*lrs, *extra.get(v.name, [])})]


def parameter_count(cfg: HydraConfig) -> int:
    """Unique parameters of the model ``cfg`` builds (on the meta device: no memory, no init cost)."""
    from ..model.hydra import HydraModel

    with torch.device("meta"):
        return HydraModel(cfg).num_parameters()


def closest_depth(metric: Callable[[int], float], target: float) -> int:
    """The depth n >= 1 whose ``metric(n)`` is closest to ``target``; both metrics used here grow
    linearly with depth, so two evaluations locate it and its neighbours settle rounding."""
    first, second = metric(1), metric(2)
    slope = second - first
    guess = 1 if slope <= 0 else max(1, round(1 + (target - first) / slope))
    candidates = {n: metric(n) for n in (guess - 1, guess, guess + 1) if n >= 1}
    return min(candidates, key=lambda n: (abs(candidates[n] - target), n))
