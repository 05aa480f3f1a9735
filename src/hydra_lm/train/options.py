"""The trainer's settings: one typed dataclass whose fields are the CLI flags and the config-file keys.

``None`` on a field means "automatic": ``resolve`` fills it from the per-size table, the
run mode and the device, after the layers (defaults < saved run < config file < CLI) are merged.
The speed settings (compile, cuda_graph, chunked_ce) stay None in the saved config, so a resumed run
follows the device it resumes on; ``compile_policy.resolve_speed_options`` decides them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import ARCHS
from .fp8 import FP8_FORMATS, FP8_RECIPES, check_fp8_setting
from .seq_len_schedule import SeqLenSchedule

MODES = ("testing", "production")
SCHEDULES = ("cosine", "wsd")
OPTIMIZERS = ("adamw", "adam8bit", "adafactor", "lion", "clion", "muon", "sophia")
# What --beta1/--beta2 set (muon: its AdamW part); Lion and Sophia-G have betas of their own, Adafactor none.
ADAM_OPTIMIZERS = ("adamw", "adam8bit", "muon")
CE_IMPLS = ("auto", "chunked", "liger")

# Runs shorter than this skip the MoD loss gate unless --no_short_run_override (see curriculum.py).
SHORT_RUN_STEPS = 1000


def opt(default: Any, help: str, *, type: Any = None, choices: tuple | None = None) -> Any:
    return field(default=default, metadata=dict(help=help, type=type, choices=choices))


@dataclass
class TrainConfig:
    # --- what to train on, where to write
    data: str | None = opt(None, "prepared data directory (from `hydra-lm prepare`)", type=str)
    dataset: str | None = opt(None, "'default' (the embedded corpus), a prepared data directory, or a corpus "
                                    "as `hydra-lm prepare --input` takes it (files, directories, globs, named "
                                    "sets, hf:NAME; records' text in their 'text' field), prepared once into "
                                    "a cache", type=str)
    out: str | None = opt(None, "run directory: config, metrics, logs, checkpoints", type=str)
    model_size: str = opt("debug", "model preset (debug, 50M, 100M, 250M, 500M, 750M, 1B, 1.5B)", type=str)
    arch: str = opt("hydra", "hydra (CCGQA + MoD/MoR) or the dense GQA baseline", type=str, choices=ARCHS)
    mode: str = opt("testing", "testing: short-run defaults; production: long-run defaults", type=str,
                    choices=MODES)
    seed: int = opt(0, "seeds model init, data order and every RNG", type=int)
    device: str = opt("auto", "auto (cuda if available), cpu or cuda[:N]", type=str)

    # --- length of the run and batch shape (None: per-size / per-mode defaults)
    max_steps: int | None = opt(None, "optimizer steps of the whole run (the schedule and curriculum scale "
                                      "with it)", type=int)
    stop_at_step: int | None = opt(None, "save and exit after this step, keeping the schedule of max_steps "
                                         "(train a long run in chunks)", type=int)
    batch_size: int | None = opt(None, "sequences per micro-batch", type=int)
    grad_accum: int | None = opt(None, "micro-batches per optimizer step", type=int)
    seq_len: int | None = opt(None, "tokens per sequence", type=int)
    time_budget_s: float | None = opt(None, "end the run after this many seconds of training steps (evaluation, "
                                            "checkpoints and compilation at the start not counted); the schedule, "
                                            "curriculum, eval_every and save_every then count the fraction of the "
                                            "budget spent, in units of max_steps (one process only)", type=float)

    # --- optimisation
    lr: float | None = opt(None, "peak learning rate", type=float)
    min_lr: float | None = opt(None, "final learning rate (default lr/10)", type=float)
    warmup_steps: int | None = opt(None, "linear warm-up steps (default max_steps/10, at most 1000)", type=int)
    weight_decay: float = opt(0.1, "decoupled weight decay (weights of two or more dimensions, not norms or "
                                   "biases)", type=float)
    beta1: float = opt(0.9, "Adam beta1 (adamw, adam8bit, muon's AdamW part; the others keep their own)", type=float)
    beta2: float = opt(0.95, "Adam beta2 (adamw, adam8bit, muon's AdamW part; the others keep their own)", type=float)
    grad_clip: float | None = opt(None, "clip the global gradient norm to this (0: no clipping)", type=float)
    schedule: str = opt("wsd", "learning-rate schedule after warm-up", type=str, choices=SCHEDULES)
    wsd_decay_pct: float = opt(0.2, "WSD: fraction of the run spent decaying to min_lr", type=float)
    optimizer: str = opt("adamw", "adamw (fused on CUDA), adam8bit (torchao, or bitsandbytes on CUDA), adafactor, "
                                  "lion, clion (cautious Lion), muon (hidden matrices; AdamW for the rest) or sophia "
                                  "(Sophia-G); the per-size --lr default depends on it", type=str,
                         choices=OPTIMIZERS)
    adamw_lr: float | None = opt(None, "--optimizer muon: peak LR of the AdamW part (embedding, norms, routers); "
                                       "default: --lr", type=float)
    sophia_update_period: int = opt(10, "--optimizer sophia: steps between Hessian estimates (each costs one more "
                                        "forward + backward, on labels sampled from the model)", type=int)
    adaptive_lr: bool = opt(False, "cut the LR for a cool-down period after a loss spike", type=bool)
    adaptive_lr_spike: float = opt(2.0, "a logged loss above this multiple of its EMA is a spike", type=float)
    adaptive_lr_factor: float = opt(0.5, "LR multiplier during a cool-down", type=float)
    adaptive_lr_cooldown: int = opt(100, "cool-down length in steps", type=int)
    max_rollbacks: int = opt(2, "on a non-finite loss or gradient: reload the last good checkpoint with a lower LR "
                                "at most this many times, then stop (0: stop at once)", type=int)
    rollback_lr_factor: float = opt(0.5, "LR multiplier applied at each rollback", type=float)
    experimental_safety_window: int = opt(100, "steps within which 3 anomalies (loss spike, non-finite gradients, "
                                               "throughput drop) switch an optimization off; also the clean "
                                               "stretch after which it is switched on again", type=int)
    experimental_loss_spike_threshold: float = opt(2.0, "a logged loss above this multiple of its average is an "
                                                        "anomaly", type=float)
    experimental_throughput_drop_threshold: float = opt(0.0, "throughput below this fraction of its average is an "
                                                             "anomaly", type=float)
    experimental_skip_pretest: bool = opt(False, "do not pretest the enabled optimizations (--chunked_ce) "
                                                 "against the plain path before training", type=bool)

    batch_filter: bool = opt(False, "zero the gradients of a batch whose loss is an outlier (> mean + k std of "
                                    "the recent losses; decided on the device, counted in the log); optimizers "
                                    "with momentum (AdamW) still step by their momentum and weight decay",
                             type=bool)
    batch_filter_k: float = opt(4.0, "--batch_filter: outlier threshold in standard deviations", type=float)
    batch_filter_warmup: int = opt(20, "--batch_filter: steps that only gather statistics", type=int)

    # --- weight averaging
    swa: bool = opt(False, "also keep an equal-weight average of the weights over the end of the run (saved as "
                           "swa.safetensors in each checkpoint, evaluated beside the trained weights at the end)",
                    type=bool)
    swa_start_pct: float = opt(0.75, "--swa: fraction of the run after which every step's weights join the average",
                               type=float)

    # --- sequence-length curriculum
    seq_len_schedule: str | None = opt(None, "LENGTH:START,... e.g. 512:0,1024:0.3,2048:0.7: row length from each "
                                             "fraction of the run on, tokens per step kept at batch_size x seq_len "
                                             "(rows scale inversely); --seq_len defaults to the longest", type=str)

    # --- mixture of experts (the layers themselves: --moe, --moe_num_experts, ... below)
    moe_warmup_steps: int = opt(0, "MoE routers keep their initial routing (LR 0) for this many steps while the "
                                   "experts learn", type=int)
    moe_expert_lr_scale: float = opt(1.0, "LR multiplier of the MoE experts' weights", type=float)
    moe_router_lr_scale: float = opt(1.0, "LR multiplier of the MoE routers", type=float)
    moe_expert_wd_scale: float = opt(1.0, "weight-decay multiplier of the MoE experts' weights", type=float)

    # --- experimental
    cuda_graphs_warmup: int = opt(2, "--cuda_graph: eager steps before each capture", type=int)
    experimental_fa3: bool = opt(False, "use PyTorch's FlashAttention-3 kernel for SDPA where the installed torch "
                                        "registers one (CUDA, Hopper); logs which flash kernels torch offers",
                                 type=bool)

    experimental_fp8: bool = opt(False, "float8 matmuls (torchao) for the transformer layers' Linear weights; CUDA "
                                        "compute capability 9.0+ only", type=bool)
    fp8_format: str = opt("e4m3", "--experimental_fp8: the output gradients' float8 dtype (the forward's is "
                                  "e4m3): e4m3, or e5m2 (with --fp8_recipe tensorwise only)", type=str,
                          choices=tuple(FP8_FORMATS))
    fp8_recipe: str = opt(FP8_RECIPES[0], "--experimental_fp8: torchao's scaling recipe: rowwise_with_gw_hp (a scale "
                                          "per row, the weight gradient in bf16; the fastest measured), tensorwise "
                                          "(one scale per tensor) or rowwise", type=str, choices=FP8_RECIPES)
    fp8_min_tokens: int = opt(4096, "--experimental_fp8: a layer's call on fewer tokens (a routed depth's few) "
                                    "stays in bf16, where float8's casts cost more than its GEMM saves", type=int)

    # --- MoD / MoR curriculum. Routing from the first step is the default: at equal training time
    # it ended clearly lower than a late switch-on (benchmarks/BENCHMARKS.md); the phases stay available.
    mod_enable_pct: float = opt(0.0, "MoD may switch on from this fraction of the run (loss gate)", type=float)
    mod_force_enable_pct: float | None = opt(None, "MoD switches on here whatever the loss (default: "
                                                   f"mod_enable_pct); runs under {SHORT_RUN_STEPS} steps switch "
                                                   "MoD on exactly here", type=float)
    mod_loss_gate: float = opt(5.0, "MoD switches on early once the CE loss EMA is below this", type=float)
    mor_enable_pct: float = opt(0.0, "MoR adaptive depth switches on from this fraction of the run", type=float)
    mor_ramp: bool = opt(False, "after mor_enable_pct, move the MoR depth capacities from full depth to the "
                                "configured ones in 4 equal levels over mor_ramp_pct of the run", type=bool)
    mor_ramp_pct: float = opt(0.2, "--mor_ramp: fraction of the run the ramp spans", type=float)
    mod_off: bool = opt(False, "never route with MoD (dense blocks)", type=bool)
    mor_off: bool = opt(False, "never route with MoR (fixed full depth)", type=bool)
    no_short_run_override: bool = opt(False, f"keep the MoD loss gate in runs under {SHORT_RUN_STEPS} steps",
                                      type=bool)

    # --- speed and memory
    # None: automatic, by device and process count (compile_policy.py): on CUDA the routed units are
    # compiled, the step replayed as CUDA graphs and the loss fused; under torchrun the whole model is
    # compiled (no graphs); on the CPU everything runs eager.
    compile: bool | None = opt(None, "torch.compile the model (default: on CUDA; each block with its routing, and the "
                                     "routed units for evaluation, in one process; the whole model under "
                                     "torchrun; --no-compile: eager)", type=bool)
    parallel_compile: bool | None = opt(None, "with --compile, compile each block layout's graphs in a helper "
                                              "process of its own, all at once, before the first step and after "
                                              "a shape or curriculum switch, unless the caches hold them already "
                                              "(default: on CUDA in one process; --no-parallel_compile: one "
                                              "layout after the other in the step)", type=bool)
    cuda_graph: bool | None = opt(None, "capture the training step (forward, backward; clipping and the update "
                                        "too with adamw and muon, the others step eagerly) as CUDA graphs and "
                                        "replay them (default: on CUDA in one process, without gradient "
                                        "checkpointing)", type=bool)
    gradient_checkpointing: bool | None = opt(None, "recompute activations in the backward pass (default: on with "
                                                    "--checkpoint_every; --no-gradient_checkpointing clears that)",
                                              type=bool)
    checkpoint_every: int | None = opt(None, "gradient checkpointing every N blocks (implies "
                                             "--gradient_checkpointing unless --no-gradient_checkpointing)", type=int)
    chunked_ce: bool | None = opt(None, "fused head + cross-entropy without [B,T,V] logits (default: on CUDA; "
                                        "Liger if installed and no CUDA graphs, else chunked)", type=bool)
    chunked_ce_size: int = opt(4096, "tokens per chunk of the chunked cross-entropy", type=int)
    ce_impl: str = opt("auto", "the fused loss of --chunked_ce: auto (Liger on CUDA when installed and eager, else "
                               "chunked), chunked (pure PyTorch) or liger", type=str, choices=CE_IMPLS)
    document_masking: bool = opt(True, "keep attention, convs and value shift inside each packed document "
                                       "(--no-document_masking: attend across documents, plain causal kernels)",
                                 type=bool)
    parallel: str = opt("fsdp", "data parallelism under torchrun: fsdp (FSDP2, sharded) or ddp (replicas)", type=str,
                         choices=("fsdp", "ddp"))
    async_checkpoint: bool = opt(False, "multi-process runs: write checkpoints in a background thread", type=bool)
    experimental_prefetch_threads: int = opt(0, "background threads preparing batches (0: none)", type=int)
    prefetch_buffer_size: int = opt(8, "batches kept ready by the prefetch threads", type=int)

    # --- logging, evaluation, checkpoints
    log_every: int | None = opt(None, "steps between metric records (the only host syncs of the loop)",
                                type=int)
    eval_every: int | None = opt(None, "steps between validation runs (0: only at the end)", type=int)
    eval_batches: int | None = opt(None, "validation batches per evaluation (0: the whole split)", type=int)
    eval_at_start: bool = opt(True, "evaluate once before the first step", type=bool)
    save_every: int | None = opt(None, "steps between checkpoints", type=int)
    keep_checkpoints: int = opt(3, "checkpoints kept (older ones are deleted after a good save)", type=int)
    stall_dump_s: float = opt(900.0, "seconds without a finished step or evaluation batch after which every "
                                     "thread's stack is appended to train.log (the run goes on; 0: never)",
                              type=float)
    tensorboard: bool = opt(False, "also log to TensorBoard (RUN_DIR/tensorboard)", type=bool)
    wandb: bool = opt(False, "also log to Weights & Biases", type=bool)
    wandb_project: str = opt("hydra-lm", "W&B project name", type=str)
    resume: bool | None = opt(None, "continue from RUN_DIR's newest good checkpoint (automatic when it has one); "
                                    "--no-resume refuses a RUN_DIR that has checkpoints", type=bool)
    restart: bool = opt(False, "start again from step 0 when every checkpoint of RUN_DIR was found corrupt (they "
                               "stay as *.corrupt)", type=bool)

    # --- model config overrides: `--model.KEY VALUE` or a [model] table
    model: dict = field(default_factory=dict, metadata=dict(help="HydraConfig overrides", type=None))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

# Flags that set a field to a fixed value, as (field, value) pairs.
KEY_ALIASES: dict[str, tuple[str, Any]] = {
    "8bit_adam": ("optimizer", "adam8bit"),
    "adafactor": ("optimizer", "adafactor"),
    "compile_units": ("compile", True),  # runs saved before the routed units became what --compile compiles
    "experimental_cuda_graphs": ("cuda_graph", True),
}
# Keys that no longer exist, with what to do instead: a config file or flag that names one gets this message.
REMOVED_KEYS: dict[str, str] = {
    "compile_regions": "--compile_regions was removed: each block compiled with its routing (the default) trained "
                       "faster than the layer regions and compiles sooner (benchmarks/BENCHMARKS.md); drop the flag",
    "compile_mode": "--compile_mode was removed: torch.compile's default mode is the one the step uses. "
                    "max-autotune-no-cudagraphs autotuned the 100M preset's first block graph for over 6 minutes on "
                    "an H100, whose cuBLAS GEMMs in the step already run at 580-720 TFLOP/s at 2,048 tokens and more "
                    "(benchmarks/BENCHMARKS.md, seventy-seventh session); drop the flag",
}
# Train keys that set a model config field of the same name (as --model.NAME does), with their types.
MODEL_ALIASES: dict[str, type] = {"moe": bool, "moe_num_experts": int, "moe_top_k": int, "moe_num_layers": int,
                                  "static_routing_mode": bool}

# Changing these on resume would either not load (model; optimizer: the checkpoint holds another optimizer's state)
# or not reproduce the data order.
FROZEN_ON_RESUME = ("model_size", "arch", "model", "optimizer", "seq_len", "batch_size", "seed", "seq_len_schedule")


def check_train_keys(values: dict[str, Any], where: str) -> None:
    for key in values:
        if key in REMOVED_KEYS:
            raise ValueError(f"{where}: {REMOVED_KEYS[key]}")
        if key not in FIELDS and key not in KEY_ALIASES and key not in MODEL_ALIASES:
            close = difflib.get_close_matches(key, sorted([*FIELDS, *KEY_ALIASES, *MODEL_ALIASES]), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown training key {key!r} in {where}{hint}")


def normalize(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Map seed aliases onto fields and coerce value types; unknown keys raise ValueError."""
    check_train_keys(values, where)
    out: dict[str, Any] = {}
    model_fields: dict[str, Any] = {}
    aliased: dict[str, tuple[str, Any]] = {}  # field -> (the alias that set it, its value)
    for key, value in values.items():
        if key in KEY_ALIASES:
            name, target = KEY_ALIASES[key]
            if not isinstance(value, bool):  # "false" would read as true
                raise ValueError(f"{where}: {key}={value!r} must be true or false")
            if value:
                if name in aliased and aliased[name][1] != target:
                    raise ValueError(f"{where}: {key} contradicts {aliased[name][0]}: keep one")
                aliased[name] = (key, target)
            continue
        if key in MODEL_ALIASES:
            kind = MODEL_ALIASES[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"{where}: {key}={value!r} must be of type {kind.__name__}")
            model_fields[key] = value
            continue
        out[key] = _coerce(key, value, where)
    for name, (key, target) in aliased.items():  # whatever the keys' order: an alias and its field must agree
        if name in out and out[name] != target:
            raise ValueError(f"{where}: {key} contradicts {name}={out[name]!r}: keep one")
        out[name] = target
    if model_fields:
        model = out.setdefault("model", {})
        clash = sorted(k for k, v in model_fields.items() if k in model and model[k] != v)
        if clash:
            raise ValueError(f"{where}: {clash[0]} is given both as --{clash[0]} and as model.{clash[0]}: keep one")
        model.update(model_fields)
    return out


def _coerce(key: str, value: Any, where: str) -> Any:
    meta = FIELDS[key].metadata
    kind, choices = meta.get("type"), meta.get("choices")
    if key == "model":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: 'model' must be a table of HydraConfig fields, got {value!r}")
        return dict(value)
    if value is None:
        return None
    try:
        if kind is bool and not isinstance(value, bool):
            raise TypeError
        if kind is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise TypeError
        if kind is str and not isinstance(value, str):
            raise TypeError
        value = kind(value) if kind in (int, float) else value
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {key}={value!r} must be of type {kind.__name__}") from None
    if choices and value not in choices:
        raise ValueError(f"{where}: {key}={value!r} must be one of {list(choices)}")
    return value


# Per-size defaults: batch size and gradient accumulation from the original HYDRA release's tables for a 32 GB
# GPU; learning rates shrink with width, as usual for AdamW at these scales.
SIZE_DEFAULTS: dict[str, dict[str, Any]] = {
    "debug": dict(batch_size=32, grad_accum=1, grad_clip=1.0, lr=1e-3),
    "50M": dict(batch_size=32, grad_accum=4, grad_clip=1.0, lr=6e-4),
    "100M": dict(batch_size=32, grad_accum=4, grad_clip=1.0, lr=6e-4),
    "250M": dict(batch_size=24, grad_accum=5, grad_clip=1.0, lr=4e-4),
    "500M": dict(batch_size=8, grad_accum=8, grad_clip=1.0, lr=3e-4),
    "750M": dict(batch_size=4, grad_accum=16, grad_clip=1.0, lr=2.5e-4),
    "1B": dict(batch_size=2, grad_accum=30, grad_clip=1.0, lr=2e-4),
    "1.5B": dict(batch_size=1, grad_accum=60, grad_clip=1.0, lr=1.5e-4),
}
# Peak LR of each optimizer relative to the AdamW table above. Lion's sign updates move every
# coordinate by the full LR (3x smaller is the usual start); torch's Adafactor LR is relative to each
# weight's RMS; Sophia-G clips each coordinate's step at the LR, and its Hessian estimate starts at 0,
# so its early steps are Lion's (0.1-0.3x was best on the CPU, BENCHMARKS.md); Muon scales its update
# to AdamW's RMS yet wants more: at 100M (one minute, batch 64) 2.5x ended 0.05-0.29 below 1x for each of
# four models and within 0.024 of each one's best (5x for three of them, 2.5x for the largest; 10x worse
# for the three tried), so 2.5x, the safer side for longer runs (BENCHMARKS.md, twenty-second session).
OPTIMIZER_LR_SCALE = {"adamw": 1.0, "adam8bit": 1.0, "adafactor": 10.0, "lion": 0.3, "clion": 0.3, "muon": 2.5,
                      "sophia": 0.3}
# The original release's 8-bit-Adam table (seq_len 1024/2048) trades batch for accumulation on the big sizes.
ADAM8BIT_BATCH = {"500M": (4, 15), "750M": (4, 16), "1B": (2, 30)}
# A CPU cannot afford the GPU batches; these make the debug preset learn visibly in minutes on two cores.
CPU_DEFAULTS = dict(batch_size=16, grad_accum=1, seq_len=128, lr=2e-3)
MODE_DEFAULTS = {
    "testing": dict(max_steps=1000, log_every=10, eval_batches=20),
    "production": dict(max_steps=20000, log_every=50, eval_batches=100),
}
GPU_SEQ_LEN = 1024


def derived_defaults(lr: float, max_steps: int, mode: str) -> dict[str, Any]:
    """The defaults of the settings that follow the learning rate and the run's length."""
    return {"min_lr": lr / 10, "warmup_steps": min(1000, max(1, max_steps // 10)),
            "eval_every": max(1, max_steps // 10),
            "save_every": max(1, max_steps // 4) if mode == "testing" else min(1000, max(1, max_steps // 10))}


def resolve(cfg: TrainConfig, preset: str, on_cuda: bool) -> TrainConfig:
    """Fill every automatic (None) field; validate the result."""
    size = SIZE_DEFAULTS.get(preset, SIZE_DEFAULTS["100M"])
    auto: dict[str, Any] = dict(size)
    auto["seq_len"] = GPU_SEQ_LEN
    if cfg.optimizer == "adam8bit" and preset in ADAM8BIT_BATCH:
        auto["batch_size"], auto["grad_accum"] = ADAM8BIT_BATCH[preset]
    if not on_cuda:
        auto.update(batch_size=min(auto["batch_size"], CPU_DEFAULTS["batch_size"]), grad_accum=1,
                    seq_len=CPU_DEFAULTS["seq_len"])
        if preset == "debug":
            auto["lr"] = CPU_DEFAULTS["lr"]
    auto["lr"] *= OPTIMIZER_LR_SCALE[cfg.optimizer]
    auto.update(MODE_DEFAULTS[cfg.mode])
    if cfg.seq_len_schedule:
        auto["seq_len"] = SeqLenSchedule.parse(cfg.seq_len_schedule).longest
    changes = {k: v for k, v in auto.items() if getattr(cfg, k) is None}
    cfg = cfg.replace(**changes)
    later = {k: v for k, v in derived_defaults(cfg.lr, cfg.max_steps, cfg.mode).items() if getattr(cfg, k) is None}
    # --checkpoint_every implies checkpointing unless it was turned off explicitly: an explicit off wins and drops
    # checkpoint_every (a resumed run keeps its saved value, which would otherwise turn it on again for good).
    if cfg.gradient_checkpointing is None:
        later["gradient_checkpointing"] = cfg.checkpoint_every is not None
    elif not cfg.gradient_checkpointing:
        later["checkpoint_every"] = None
    cfg = cfg.replace(**later)
    validate(cfg)
    return cfg


def check_seed(seed: int, flag: str = "--seed") -> None:
    """Here rather than in numpy's seeding, which refuses a seed outside [0, 2**32) in its own words, later."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"{flag} {seed} must lie in [0, 2**32 - 1 = {2**32 - 1}]")


def validate(cfg: TrainConfig) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    check_seed(cfg.seed)

    for name in ("max_steps", "batch_size", "grad_accum", "seq_len", "log_every", "keep_checkpoints", "save_every",
                 "chunked_ce_size", "sophia_update_period"):
        need(getattr(cfg, name) >= 1, f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("eval_every", "eval_batches", "warmup_steps", "experimental_prefetch_threads", "batch_filter_warmup",
                 "fp8_min_tokens"):
        need(getattr(cfg, name) >= 0, f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.experimental_fp8:
        check_fp8_setting(cfg.fp8_format, cfg.fp8_recipe)
    need(cfg.prefetch_buffer_size >= 1, f"prefetch_buffer_size={cfg.prefetch_buffer_size} must be >= 1")
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2", "rollback_lr_factor"):
        need(math.isfinite(getattr(cfg, name)), f"{name}={getattr(cfg, name)} must be a finite number")
    need(cfg.lr > 0, f"lr={cfg.lr} must be > 0")
    for name in ("beta1", "beta2"):
        need(0 <= getattr(cfg, name) < 1, f"{name}={getattr(cfg, name)} must lie in [0, 1)")
    need(cfg.time_budget_s is None or 0 < cfg.time_budget_s < math.inf,
         f"time_budget_s={cfg.time_budget_s} must be a finite number > 0 (inf never ends the run: leave it out)")
    # A warm-up as long as the run is not refused: a resume that shortens the run (--max_steps) keeps the warm-up
    # its first start derived from the longer one; the LR then ends inside the warm-up (docs/training.md).
    need(0 <= cfg.min_lr <= cfg.lr, f"min_lr={cfg.min_lr} must lie in [0, lr={cfg.lr}]")
    need(cfg.max_rollbacks >= 0, f"max_rollbacks={cfg.max_rollbacks} must be >= 0")
    need(0 < cfg.rollback_lr_factor <= 1, f"rollback_lr_factor={cfg.rollback_lr_factor} must lie in (0, 1]")
    need(cfg.experimental_safety_window >= 1,
         f"experimental_safety_window={cfg.experimental_safety_window} must be >= 1")
    need(cfg.experimental_loss_spike_threshold > 1,
         f"experimental_loss_spike_threshold={cfg.experimental_loss_spike_threshold} must be > 1")
    need(0 <= cfg.experimental_throughput_drop_threshold < 1,
         f"experimental_throughput_drop_threshold={cfg.experimental_throughput_drop_threshold} must lie in [0, 1) "
         "(0: off)")
    need(cfg.grad_clip >= 0, f"grad_clip={cfg.grad_clip} must be >= 0 (0 disables clipping)")
    need(cfg.adamw_lr is None or cfg.adamw_lr > 0, f"adamw_lr={cfg.adamw_lr} must be > 0")
    need(cfg.adamw_lr is None or cfg.optimizer == "muon", "--adamw_lr sets the AdamW part of --optimizer muon; "
         "with another optimizer use --lr")
    betas = " ".join(f"--{n} {getattr(cfg, n)}" for n in ("beta1", "beta2") if getattr(cfg, n) != FIELDS[n].default)
    need(not betas or cfg.optimizer in ADAM_OPTIMIZERS, f"{betas}: the betas of {', '.join(ADAM_OPTIMIZERS)} (its "
         f"AdamW part); --optimizer {cfg.optimizer} keeps its own: drop them")
    need(cfg.weight_decay >= 0, f"weight_decay={cfg.weight_decay} must be >= 0")
    need(0 < cfg.wsd_decay_pct <= 1, f"wsd_decay_pct={cfg.wsd_decay_pct} must lie in (0, 1]")
    for name in ("mod_enable_pct", "mod_force_enable_pct", "mor_enable_pct"):
        need(getattr(cfg, name) is None or 0 <= getattr(cfg, name) <= 1, f"{name}={getattr(cfg, name)} must lie in "
             "[0, 1]")
    need(not cfg.mor_ramp or 0 < cfg.mor_ramp_pct and cfg.mor_enable_pct + cfg.mor_ramp_pct <= 1,
         f"mor_ramp_pct={cfg.mor_ramp_pct} must be > 0 and end the ramp within the run (mor_enable_pct + "
         f"mor_ramp_pct <= 1)")
    need(cfg.mod_force_enable_pct is None or cfg.mod_force_enable_pct >= cfg.mod_enable_pct,
         f"mod_force_enable_pct={cfg.mod_force_enable_pct} must be >= mod_enable_pct={cfg.mod_enable_pct}")
    if cfg.seq_len_schedule:
        SeqLenSchedule.parse(cfg.seq_len_schedule).check(cfg.batch_size, cfg.seq_len)
    need(cfg.moe_warmup_steps >= 0, f"moe_warmup_steps={cfg.moe_warmup_steps} must be >= 0")
    for name in ("moe_expert_lr_scale", "moe_router_lr_scale", "moe_expert_wd_scale"):
        need(getattr(cfg, name) >= 0, f"{name}={getattr(cfg, name)} must be >= 0")
    need(cfg.cuda_graphs_warmup >= 1, f"cuda_graphs_warmup={cfg.cuda_graphs_warmup} must be >= 1")
    need(0 <= cfg.swa_start_pct < 1, f"swa_start_pct={cfg.swa_start_pct} must lie in [0, 1)")
    need(cfg.batch_filter_k > 0, f"batch_filter_k={cfg.batch_filter_k} must be > 0")
    need(cfg.adaptive_lr_spike > 1, f"adaptive_lr_spike={cfg.adaptive_lr_spike} must be > 1")
    need(cfg.adaptive_lr_cooldown >= 1,
         f"adaptive_lr_cooldown={cfg.adaptive_lr_cooldown} must be >= 1 (with fewer steps --adaptive_lr does nothing)")
    need(0 < cfg.adaptive_lr_factor <= 1, f"adaptive_lr_factor={cfg.adaptive_lr_factor} must lie in (0, 1]")
    need(cfg.stall_dump_s >= 0, f"stall_dump_s={cfg.stall_dump_s} must be >= 0 (0: never dump stacks)")
    if cfg.checkpoint_every is not None:
        need(cfg.checkpoint_every >= 1, f"checkpoint_every={cfg.checkpoint_every} must be >= 1")
    if cfg.stop_at_step is not None:
        need(1 <= cfg.stop_at_step <= cfg.max_steps,
             f"stop_at_step={cfg.stop_at_step} must lie in [1, max_steps={cfg.max_steps}]")
