"""Optimizer construction: parameter groups (decoupled weight decay on parameters of two or more dimensions
only, per-group LR ratios) and the optimizers behind ``--optimizer``."""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from .moe_training import MOE_ROUTER, moe_placement
from .options import TrainConfig

# Parameters that stay with AdamW under --optimizer muon: the embedding (tied to the LM head), routers,
# recursion embeddings and the MoE router. Muon orthogonalises hidden matrices only.
NOT_MUON = re.compile(r"(^|\.)(embed|lm_head|routers|depth_router|router|rec_emb)(\.|$)")


def takes_muon(name: str, p: torch.Tensor) -> bool:
    """Whether ``--optimizer muon`` gives parameter ``name`` to Muon (a hidden 2-D weight) or to AdamW."""
    return p.dim() == 2 and not NOT_MUON.search(name)


def param_groups(model: nn.Module, weight_decay: float,
                 place: Callable[[str, torch.Tensor], tuple[str, float, float]] | None = None) -> list[dict]:
    """Groups of parameters sharing (optimizer part, LR ratio, weight decay), in first-seen order.

    ``place(name, param)`` gives the part ("muon" or "main"), the group's LR as a multiple of the
    scheduled LR (``set_lr`` applies it) and a weight-decay multiplier."""
    # Norm gains and biases (1-D) are not shrunk: decaying them pulls scales toward zero without regularising
    # anything. Matrices, conv kernels, MoE experts and the recursion embeddings ([recursions, dim], added
    # per depth like a bias; their decay has not been measured against none) are.
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part, lr_ratio, wd_scale = place(name, p) if place else ("main", 1.0, 1.0)
        wd = weight_decay * wd_scale if p.dim() >= 2 else 0.0
        group = groups.setdefault((part, lr_ratio, wd), {"params": [], "weight_decay": wd, "lr_ratio": lr_ratio,
                                                         "part": part})
        group["params"].append(p)
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.optimizer`` over ``model``'s groups, each at ``cfg.lr`` times its LR ratio."""
    optimizer = _optimizer(model, cfg, device)
    # The ratios from the first step: the one-call setup steps without a set_lr of its own.
    set_lr(optimizer, cfg.lr)
    return optimizer


def _optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    kind, cuda = cfg.optimizer, device.type == "cuda"
    adamw_ratio = (cfg.adamw_lr or cfg.lr) / cfg.lr if kind == "muon" else 1.0

    def place(name: str, p: torch.Tensor) -> tuple[str, float, float]:
        if kind == "muon" and takes_muon(name, p):
            return "muon", 1.0, 1.0
        moe = moe_placement(name, cfg)
        if moe is not None:
            part, ratio, wd_scale = moe
            return part, adamw_ratio * ratio, wd_scale
        return "main", adamw_ratio, 1.0

    groups = param_groups(model, cfg.weight_decay, place)
    muon_groups = [g for g in groups if g["part"] == "muon"]
    main_groups = [g for g in groups if g["part"] != "muon"]
    for g in groups:
        if g.pop("part") == MOE_ROUTER:  # tagged for the router warm-up
            g[MOE_ROUTER] = True
    betas = (cfg.beta1, cfg.beta2)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=1e-8, fused=cuda)
    if kind == "muon":
        from .hybrid_optimizer import MuonWithAdamW

        if not muon_groups:
            raise ValueError("--optimizer muon: this model has no hidden 2-D weights for Muon; use adamw")
        return MuonWithAdamW(muon_groups, main_groups, lr=cfg.lr, adamw_lr=cfg.lr * adamw_ratio, betas=betas,
                             fused=cuda)
    if kind == "adafactor":
        # torch's Adafactor applies weight decay decoupled (scaled by lr), like AdamW; its LR is relative
        # to each parameter's RMS (hence its larger per-size default).
        return torch.optim.Adafactor(groups, lr=cfg.lr, beta2_decay=-0.8, eps=(None, 1e-3))
    if kind in ("lion", "clion"):
        from pytorch_optimizer import Lion

        # Lion's own betas (the Adam ones do not transfer); clion masks update coordinates whose sign
        # disagrees with the current gradient ("cautious" updates).
        return Lion(groups, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, cautious=kind == "clion")
    if kind == "sophia":
        from .sophia import SophiaG

        # The tokens of the one micro-batch its sampled-label loss averages over (TrainStep.sample_hessian_if_due), not
        # the step's: with grad_accum of them the curvature came out grad_accum times too large. No batch shape given
        # (create_optimized_training_setup's options may leave it out): its first step sets it.
        tokens = None if None in (cfg.batch_size, cfg.seq_len) else cfg.batch_size * cfg.seq_len
        return SophiaG(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, update_period=cfg.sophia_update_period,
                       tokens_per_batch=tokens)
    if kind == "adam8bit":
        return _adam8bit(groups, cfg, device)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def check_optimizer_features(cfg: TrainConfig, dist) -> None:
    """Refuse combinations an optimizer cannot run (one line naming what to change)."""
    kind = cfg.optimizer
    if kind == "sophia" and dist.enabled:
        raise ValueError("--optimizer sophia works in one process only (its Hessian estimate's extra backward "
                         "runs on one process's batch): pick another optimizer under torchrun")
    if kind in ("muon", "adafactor") and dist.enabled and dist.parallel == "fsdp":
        raise ValueError(f"--optimizer {kind} needs whole matrices (it factors or orthogonalises them), not FSDP2 "
                         "shards: add --parallel ddp")


def check_optimizer_device(kind: str, device: torch.device) -> None:
    """Refuse an optimizer this device cannot run (before any model is built)."""
    # torchao's 8-bit AdamW would run on a CPU, but builds its compiled step there for minutes, for no
    # memory worth saving.
    if kind == "adam8bit" and device.type != "cuda":
        raise ValueError("--optimizer adam8bit (--8bit_adam) runs on CUDA only: use adamw on this device")


def _adam8bit(groups: list[dict], cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """torchao's 8-bit AdamW (block-wise quantised moments), else bitsandbytes'; CUDA only."""
    check_optimizer_device("adam8bit", device)
    betas = (cfg.beta1, cfg.beta2)
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        AdamW8bit = None
    if AdamW8bit is not None:
        return AdamW8bit(groups, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("--optimizer adam8bit needs torchao (pip install 'hydra-lm[gpu]') or bitsandbytes; or use "
                         "--optimizer adamw") from None
    return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=betas)


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Prepare a capturable optimizer (``compile_policy.CAPTURABLE_OPTIMIZERS``) for replay in a CUDA graph: a
    float learning rate would be baked into the captured kernels, so it moves into a device tensor (one per
    LR ratio, and the MoE routers' apart, so that ``moe_training.hold_routers`` zeroes theirs alone) that
    ``set_lr`` refills; step counters move to the device. Done after construction and any restore, so
    checkpoints stay portable."""
    lrs: dict[tuple[float, bool], torch.Tensor] = {}
    for group in optimizer.param_groups:
        group["capturable"] = True
        key = (group.get("lr_ratio", 1.0), bool(group.get(MOE_ROUTER)))
        # The groups of one key share an LR (set_lr's lr x ratio, or a held router's 0): the first one's is theirs.
        group["lr"] = lrs.setdefault(key, torch.tensor(float(group["lr"]), device=device))
    steps_to_device(optimizer, device)


def steps_to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """A capturable optimizer's step counters live on the device (a host counter would be baked into the graph)."""
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = state["step"].to(device, torch.float32)


# Group settings a run's config sets (--weight_decay, --beta1/--beta2, --moe_expert_wd_scale) and its device
# (AdamW's fused / foreach kernels: a CPU run's checkpoint resumed on CUDA): a checkpoint's values must not override
# a resumed run's.
CONFIGURED_GROUP_KEYS = ("weight_decay", "betas", "fused", "foreach")


def load_keeping_lr(optimizer: torch.optim.Optimizer, load: Callable[[], None], device: torch.device) -> None:
    """Run ``load`` (a state-dict load into ``optimizer``) keeping this run's LR ratios and LR holders (a device
    tensor that captured updates read, ``make_capturable``, where a checkpoint holds portable floats; or torchao's)
    and its configured weight decay and betas. A rollback reloads into a live, graph-captured optimizer; the first
    restore into a fresh one."""
    held = [(g["lr"], g.get("lr_ratio", 1.0), g.get("capturable", False),
             {k: g[k] for k in CONFIGURED_GROUP_KEYS if k in g}) for g in optimizer.param_groups]
    load()
    for group, (lr, ratio, capturable, configured) in zip(optimizer.param_groups, held):
        group["lr"], group["lr_ratio"] = lr, ratio
        group.update(configured)
        if capturable:
            group["capturable"] = True
    # Fused and capturable updates read their step counters on the device; a checkpoint of neither kept them on the
    # host.
    if any(capturable or configured.get("fused") for _, _, capturable, configured in held):
        steps_to_device(optimizer, device)


def portable_optimizer_state(state: dict) -> dict:
    """A state dict that loads anywhere: a graph-captured run's device-tensor LR saved as a float and
    its groups saved as not capturable (``make_capturable`` redoes both on resume)."""
    groups = [{**g, "lr": float(g["lr"]), "capturable": False} if isinstance(g.get("lr"), torch.Tensor) else g
              for g in state["param_groups"]]
    return {**state, "param_groups": groups}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the scheduled LR: each group gets ``lr`` times its ``lr_ratio``."""
    for group in optimizer.param_groups:
        value = lr * group.get("lr_ratio", 1.0)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)  # in place: a captured optimizer step reads this tensor
        else:
            group["lr"] = value
