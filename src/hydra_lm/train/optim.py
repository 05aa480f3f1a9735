"""Optimizer construction: parameter groups with decoupled weight decay on 2-D weights only."""

from __future__ import annotations

import torch
from torch import nn

from .options import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Norm gains, biases, router biases and recursion embeddings (1-D) are not shrunk: decaying
    # them pulls scales toward zero without regularising anything.
    decay, keep = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                 fused=device.type == "cuda")
    if cfg.optimizer == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise ValueError("--adafactor needs torch >= 2.5 (torch.optim.Adafactor)")
        # torch's Adafactor applies weight decay decoupled (scaled by lr), like AdamW.
        return torch.optim.Adafactor(groups, lr=cfg.lr, beta2_decay=-0.8, eps=(None, 1e-3))
    if cfg.optimizer == "adam8bit":
        if device.type != "cuda":
            raise ValueError("--8bit_adam runs on CUDA only (bitsandbytes); use adamw on this device")
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("--8bit_adam is not available: bitsandbytes is not installed "
                             "(pip install bitsandbytes)") from None
        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Prepare a fused AdamW for replay in a CUDA graph: a float learning rate would be baked into the
    captured kernels, so it moves into one device tensor that ``set_lr`` refills; step counters move to
    the device. Done after construction and any restore, so checkpoints stay portable."""
    lr = torch.tensor(float(optimizer.param_groups[0]["lr"]), device=device)
    for group in optimizer.param_groups:
        group["capturable"] = True
        group["lr"] = lr
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = state["step"].to(device, torch.float32)


def portable_optimizer_state(state: dict) -> dict:
    """A state dict that loads anywhere: a graph-captured run's device-tensor LR saved as a float and
    its groups saved as not capturable (``make_capturable`` redoes both on resume)."""
    groups = [{**g, "lr": float(g["lr"]), "capturable": False} if isinstance(g.get("lr"), torch.Tensor) else g
              for g in state["param_groups"]]
    return {**state, "param_groups": groups}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # in place: a captured optimizer step reads this tensor
        else:
            group["lr"] = lr
