"""One-call speed setup for a model outside ``hydra-lm train``: ``optimize_for_gpu`` prepares a model
and ``create_optimized_training_setup`` adds the optimizer and the training step. Both only detect the
device and then defer to the trainer's own code: the speed policy (``compile_policy``), the parameter
groups and optimizers (``optim``) and the step (``step.TrainStep``), so a model trained here runs the
same kernels, graphs and loss path as under ``hydra-lm train`` with the same settings."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.hydra import HydraModel
from .compile_policy import SpeedPlan, apply_speed_plan, enable_tf32, resolve_speed_options
from .moe_training import hold_routers
from .optim import build_optimizer, check_optimizer_device, set_lr
from .model_features import MODEL_SIDE, apply_model_features
from .options import FIELDS, KEY_ALIASES, TrainConfig, normalize, resolve
from .run import pick_device
from .step import TrainStep

# What a setup's optimizer and step take when not given: the trainer's per-preset values (all presets
# clip at 1.0), one micro-batch per step, and a learning rate usual for small models.
SETUP_DEFAULTS = dict(lr=3e-4, grad_clip=1.0, grad_accum=1)
# The train flags a setup acts on: its speed plan, model features, optimizer and step. The rest (the LR schedule, the
# curriculum, evaluation, checkpoints, safety nets) are the trainer's loop, which a setup's caller writes: refused
# rather than silently dropped.
SETUP_OPTIONS = frozenset({
    "seed", "batch_size", "seq_len", "grad_accum", "lr", "weight_decay", "beta1", "beta2", "grad_clip", "optimizer",
    "adamw_lr", "sophia_update_period", "moe_warmup_steps", "moe_expert_lr_scale", "moe_router_lr_scale",
    "moe_expert_wd_scale", "cuda_graphs_warmup", "experimental_fa3", "experimental_fp8", "fp8_format", "fp8_recipe",
    "fp8_min_tokens", "compile", "parallel_compile", "cuda_graph", "gradient_checkpointing", "checkpoint_every",
    "chunked_ce", "chunked_ce_size", "ce_impl", "model"})


@dataclass(frozen=True)
class DeviceCapabilities:
    """What the device offers to the speed options, each field named for what was detected."""

    device: torch.device
    name: str
    compute_capability: tuple[int, int] | None  # CUDA only
    tf32_matmul: bool  # tensor cores with TF32 (compute capability 8.0 and newer)
    bf16_autocast: bool  # bf16 kernels (the training step's autocast on CUDA)
    triton_compile: bool  # torch.compile can generate GPU kernels (Triton is installed and supports the GPU)
    cuda_graphs: bool  # steps can be captured and replayed as CUDA graphs

    def describe(self) -> str:
        if self.device.type != "cuda":
            return f"{self.name}: no CUDA device"
        major, minor = self.compute_capability
        have = [n for n, ok in (("TF32", self.tf32_matmul), ("bf16", self.bf16_autocast),
                                ("Triton compile", self.triton_compile), ("CUDA graphs", self.cuda_graphs)) if ok]
        return f"{self.name} (sm_{major}{minor}): {', '.join(have) or 'none of TF32, bf16, Triton compile'}"


def detect_device_capabilities(device: torch.device | str | None = None) -> DeviceCapabilities:
    device = pick_device("auto" if device is None else str(device))
    if device.type != "cuda":
        return DeviceCapabilities(device, "cpu", None, False, False, False, False)
    capability = torch.cuda.get_device_capability(device)
    try:
        from torch.utils._triton import has_triton

        triton = has_triton()
    except ImportError:
        triton = False
    return DeviceCapabilities(device, torch.cuda.get_device_name(device), capability, capability >= (8, 0),
                              torch.cuda.is_bf16_supported(), triton, True)


@dataclass
class OptimizedModel:
    """``model`` (on the device, its units compiled in place when the plan says so) and ``module``: what a
    forward calls (``model`` itself, or a compiled module around it). ``description``: what was applied."""

    model: nn.Module
    module: nn.Module
    plan: SpeedPlan
    capabilities: DeviceCapabilities
    applied: list[str]

    @property
    def device(self) -> torch.device:
        return self.capabilities.device

    @property
    def description(self) -> str:
        return f"{self.capabilities.describe()} -> " + "; ".join(self.applied)

    def autocast(self):
        """The training step's autocast (bf16 on CUDA), for forwards outside a step."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")


def _train_config(options: dict[str, Any]) -> TrainConfig:
    where = "the optimized setup's options"
    values = normalize(options, where)  # the flags' aliases, types and choices
    loop_only = sorted(set(values) - SETUP_OPTIONS)
    if loop_only:
        raise ValueError(f"{where}: {', '.join(loop_only)} belong to hydra-lm train's loop (schedule, curriculum, "
                         "evaluation, checkpoints), which a setup leaves to its caller: drop them (set_lr and "
                         "model.set_curriculum do those parts)")
    if values.get("model"):
        names = ", ".join(sorted(values["model"]))
        raise ValueError(f"{where}: a model's config is fixed once it is built: give {names} to hydra_lm.create_model "
                         "instead")
    unset = {k: v for k, v in SETUP_DEFAULTS.items() if values.get(k) is None}
    cfg = TrainConfig(**{**values, **unset})
    # resolve runs the trainer's checks once it has filled the fields that only `hydra-lm train` reads (run length,
    # schedule); the batch shape stays as given: without one, Sophia-G takes its token count from the first step.
    return resolve(cfg, cfg.model_size, on_cuda=False).replace(batch_size=cfg.batch_size, seq_len=cfg.seq_len)


def _prepare(model: nn.Module, cfg: TrainConfig, device: torch.device | str | None) -> OptimizedModel:
    caps = detect_device_capabilities(device)
    if caps.device.type == "cuda" and not caps.triton_compile and cfg.compile is None:
        cfg = cfg.replace(compile=False)  # no kernel generator: the policy's automatic compile cannot run
    hydra = isinstance(model, HydraModel)
    if hydra and model.gradient_checkpointing and not cfg.gradient_checkpointing:  # set on the model: plan with it
        cfg = cfg.replace(gradient_checkpointing=True, checkpoint_every=model.checkpoint_every)
    plan = resolve_speed_options(cfg, caps.device, distributed=False, moe=hydra and bool(model.moe_blocks))
    if not hydra:  # the routed units and the fused loss exist in a HydraModel only: compile the whole model
        # (nor the block layouts that parallel_compile's helpers compile)
        plan = dataclasses.replace(plan, compile="model" if plan.compile else None, ce_impl="naive",
                                   parallel_compile=False)
        # A None default resolves to False when left alone (gradient_checkpointing without checkpoint_every).
        model_side = [name for name in MODEL_SIDE if getattr(cfg, name) != FIELDS[name].default
                      and not (FIELDS[name].default is None and getattr(cfg, name) is False)]
        if model_side:
            raise ValueError(f"{', '.join(model_side)}: the setup applies these to a HydraModel only, as hydra-lm "
                             f"train does; this model is a {type(model).__name__}: drop them")
    model.to(caps.device)
    applied = ["TF32 matmul"] if enable_tf32(caps.device) and caps.tf32_matmul else []
    if caps.device.type == "cuda":
        applied.append("bf16 autocast" if caps.bf16_autocast else "bf16 autocast (not native on this GPU: slow)")
    if hydra:
        applied += apply_model_features(model, cfg, caps.device)
        if cfg.gradient_checkpointing:
            applied.append(f"gradient checkpointing (every {model.checkpoint_every} blocks)")
        module = apply_speed_plan(model, model, plan)
    else:
        module = torch.compile(model) if plan.compile else model
    applied += plan.describe()
    if caps.device.type != "cuda":
        off = [name for name, on in (("compile", plan.compile is not None), ("CUDA graphs", plan.cuda_graph),
                                     ("fused loss", plan.ce_impl != "naive")) if not on]
        listed = off[0] if len(off) == 1 else f"{', '.join(off[:-1])} or {off[-1]}"
        warnings.warn(f"no CUDA device: the model runs {'eagerly ' if plan.compile is None else ''}on {caps.device} "
                      f"(no {listed})", stacklevel=3)
    elif hydra and plan.compile is not None:
        applied.append("decoding: compiled one-token step in a CUDA graph (generate)")
    return OptimizedModel(model, module, plan, caps, applied)


def optimize_for_gpu(model: nn.Module, device: torch.device | str | None = None, **options: Any) -> OptimizedModel:
    """Prepare ``model`` as ``hydra-lm train`` would on this device (default: CUDA if present): TF32
    matmuls, the speed plan of ``compile_policy`` (a HydraModel: its routed units compiled, fused chunked
    loss; any other module: compiled whole) and the plan's CUDA graphs, which a training step captures
    (``create_optimized_training_setup``). ``options``: the train flags of the same names (``compile``,
    ``cuda_graph``, ``chunked_ce``, ``ce_impl``, ``optimizer``...), automatic when left out,
    checked as the trainer checks them; a HydraModel also gets the trainer's ``gradient_checkpointing``,
    ``experimental_fp8`` and ``experimental_fa3``. Without CUDA it warns and leaves the model eager."""
    return _prepare(model, _train_config(options), device)


@dataclass
class TrainingSetup:
    """The optimizer and the trainer's step for one model: ``step(batch)`` runs forward and backward of
    each micro-batch, clips and updates (as CUDA graphs where the plan captures them), samples Sophia-G's Hessian
    estimate when it is due and holds the MoE routers during ``moe_warmup_steps`` (as the trainer does) and returns
    device tensors (no host sync): loss, ce_loss, aux_loss, ponder_loss, moe_loss (means over the micro-batches),
    grad_norm and routing_stats."""

    optimized: OptimizedModel
    optimizer: torch.optim.Optimizer
    train_step: TrainStep
    grad_accum: int
    lr: float  # the scheduled LR (each group takes it times its LR ratio)
    seed: int = 0  # Sophia-G: with the step, seeds the labels of its Hessian estimates
    moe_warmup_steps: int = 0  # the first updates, whose MoE router LR is 0
    steps: int = 0  # updates taken
    _routing: tuple | None = None  # the blocks' curriculum switches the captured step was taken with

    @property
    def model(self) -> nn.Module:
        return self.optimized.model

    @property
    def description(self) -> str:
        return self.optimized.description

    def set_lr(self, lr: float) -> None:
        """Set the learning rate (in place where a captured step reads it from the device)."""
        self.lr = lr
        set_lr(self.optimizer, lr)

    def step(self, batch: dict[str, torch.Tensor] | torch.Tensor | list) -> dict[str, torch.Tensor]:
        """``batch``: {"input_ids", "targets"[, "doc_ids"]}, or input ids alone (targets: the next token,
        the last position ignored), or a list of ``grad_accum`` such micro-batches."""
        micro = batch if isinstance(batch, list) else [batch]
        if len(micro) != self.grad_accum:
            raise ValueError(f"{len(micro)} micro-batches given; this setup accumulates {self.grad_accum} per step "
                             "(grad_accum): pass a list of that many")
        if not self.model.training:
            self.model.train()
        micro = [_as_inputs(inputs) for inputs in micro]
        routing = tuple((b.mod_active, b.mor_active, b.mor_ramp) for b in getattr(self.model, "blocks", ())
                        if hasattr(b, "mor_ramp"))
        if routing != self._routing:  # model.set_curriculum changed the control flow: capture it again, as the trainer
            if self._routing is not None and self.train_step.graphs is not None:
                self.train_step.graphs.reset()
            self._routing = routing
        if self.steps < self.moe_warmup_steps:
            hold_routers(self.optimizer)  # again each step: a set_lr since the last one restored them
        elif self.steps == self.moe_warmup_steps > 0:
            self.set_lr(self.lr)  # the warm-up is over: the routers' LR back
        if getattr(self.optimizer, "tokens_per_batch", 0) is None:  # Sophia-G without a batch shape in the options
            self.optimizer.tokens_per_batch = micro[-1]["input_ids"].numel()  # the batch its curvature samples
        parts, stats = None, None
        for inputs in micro:
            p, s = self.train_step.micro(inputs)
            parts = p.clone() if parts is None else parts + p  # CUDA graphs reuse their output memory
            stats = s.clone()
        grad_norm = self.train_step.update().detach().clone()
        self.train_step.sample_hessian_if_due(micro[-1], self.seed, self.steps)  # as the trainer: the last micro-batch
        self.steps += 1
        parts = parts / self.grad_accum
        out = dict(zip(("loss", "ce_loss", "aux_loss", "ponder_loss", "moe_loss"), parts.unbind()))
        return {**out, "grad_norm": grad_norm, "routing_stats": stats}


def _as_inputs(batch: dict[str, torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        if batch.dim() != 2:
            raise ValueError(f"input ids of shape {tuple(batch.shape)}: a batch is [rows, length] (unsqueeze(0) a "
                             "single row)")
        targets = torch.roll(batch, -1, 1)
        targets[:, -1] = -100  # no next token to predict
        return {"input_ids": batch, "targets": targets}
    unknown = set(batch) - {"input_ids", "targets", "doc_ids"}
    if unknown or "input_ids" not in batch or "targets" not in batch:
        raise ValueError(f"a batch is {{'input_ids', 'targets'[, 'doc_ids']}}, got keys {sorted(batch)}")
    return dict(batch)


def create_optimized_training_setup(model: nn.Module, lr: float = SETUP_DEFAULTS["lr"], optimizer: str = "adamw",
                                    device: torch.device | str | None = None, **options: Any) -> TrainingSetup:
    """``optimize_for_gpu`` plus the trainer's optimizer (``optim.build_optimizer``: decoupled weight
    decay on 2-D weights, fused AdamW on CUDA) and its step (``step.TrainStep``). ``options``: train
    flags such as ``weight_decay``, ``beta1``, ``beta2``, ``grad_clip`` (1.0), ``grad_accum`` (1),
    ``cuda_graphs_warmup``, the MoE settings (``moe_expert_lr_scale``, ``moe_warmup_steps``...) and the flags
    of ``optimize_for_gpu``. The model must return the
    HydraModel's output dict (``loss``, ``ce_loss``, the router losses, ``routing_stats``) when given
    targets."""
    picks = [(key, KEY_ALIASES[key][1]) for key in options if KEY_ALIASES.get(key, ("",))[0] == "optimizer"]
    if picks:  # the argument would silently override the flag's alias
        raise ValueError(f"{picks[0][0]}: pass optimizer={picks[0][1]!r} to create_optimized_training_setup instead")
    cfg = _train_config({**options, "lr": lr, "optimizer": optimizer})
    check_optimizer_device(cfg.optimizer, detect_device_capabilities(device).device)  # before the model changes
    optimized = _prepare(model, cfg, device)
    opt = build_optimizer(model, cfg, optimized.device)
    train_step = TrainStep(model, optimized.module, opt, optimized.device, optimized.plan, cfg.grad_accum,
                           cfg.grad_clip, cfg.cuda_graphs_warmup)
    model.train()
    return TrainingSetup(optimized, opt, train_step, cfg.grad_accum, cfg.lr, cfg.seed, cfg.moe_warmup_steps)


__all__ = ["DeviceCapabilities", "OptimizedModel", "TrainingSetup", "create_optimized_training_setup",
           "detect_device_capabilities", "optimize_for_gpu"]
