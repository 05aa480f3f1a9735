"""MoE in the trainer: per-part learning rates and weight decay, a router warm-up, expert load.

Warm-up (``--moe_warmup_steps N``): for the first N steps the MoE routers' learning rate is 0, so
tokens keep the routing of the initial router while the experts learn; the routers' optimizer
moments still gather statistics. (Freezing the router is the simpler of the two usual warm-ups:
running every expert on every token would change the layer's compute and shapes for a phase.)
"""

from __future__ import annotations

import torch

from .options import FIELDS, TrainConfig

MOE_ROUTER = "moe_router"
# The training settings of MoE layers (off at their defaults)
MOE_SETTINGS = ("moe_warmup_steps", "moe_expert_lr_scale", "moe_router_lr_scale", "moe_expert_wd_scale")
# An expert whose share of the assignments falls below this fraction of the uniform share is starving.
LOW_LOAD = 0.1


def check_moe_options(cfg: TrainConfig, arch: str, moe: bool) -> None:
    knobs = [f"--{name}" for name in MOE_SETTINGS if getattr(cfg, name) != FIELDS[name].default]
    if arch == "dense" and (moe or knobs):
        raise ValueError(f"{' '.join(knobs) or '--moe'}: MoE layers belong to the hydra architecture; drop the MoE "
                         "settings or use --arch hydra")
    if knobs and not moe:
        raise ValueError(f"{' '.join(knobs)} tune MoE layers, which this model has none of: add --moe")


def moe_placement(name: str, cfg: TrainConfig) -> tuple[str, float, float] | None:
    """(part, LR ratio, weight-decay multiplier) of an MoE parameter, or None for any other."""
    if not name.startswith("moe_blocks."):
        return None
    if ".router." in name:
        return MOE_ROUTER, cfg.moe_router_lr_scale, 1.0
    if name.endswith(("w_gate_up", "w_down")):
        return "main", cfg.moe_expert_lr_scale, cfg.moe_expert_wd_scale
    return None


def hold_routers(optimizer: torch.optim.Optimizer) -> None:
    """Zero the MoE routers' LR for this step (``set_lr`` restores it on the next)."""
    for group in optimizer.param_groups:
        if group.get(MOE_ROUTER):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(0.0)
            else:
                group["lr"] = 0.0


def expert_load_record(load: torch.Tensor, names: list[str]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """The logged per-expert share of assignments (from ``load`` [n_moe_layers, n_experts]) and, per
    starving expert ("layer/expert"), a warning: its share is below LOW_LOAD of the uniform one."""
    shares = load.tolist()
    record = {name: [round(x, 4) for x in row] for name, row in zip(names, shares)}
    warnings = {}
    for name, row in zip(names, shares):
        uniform = 1.0 / len(row)
        for e, share in enumerate(row):
            if share < LOW_LOAD * uniform:
                warnings[f"{name}/{e}"] = (f"MoE layer {name}: expert {e} receives {share:.4f} of the tokens, "
                                           f"under {LOW_LOAD:.0%} of the uniform {uniform:.3f}: it is starving "
                                           "(raise --model.moe_aux_weight or --model.moe_router_jitter)")
    return record, warnings
