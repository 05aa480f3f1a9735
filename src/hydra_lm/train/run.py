"""Setting up a run: merge the config layers, check the run directory and data, decide on resume.

Layers, lowest first: TrainConfig defaults < the run's saved ``config.json`` (when resuming) <
the ``--config`` file < command-line flags; then automatic values (per size / mode / device).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import HYDRA_ONLY_FIELDS, KERNEL_CHOICES, HydraConfig, preset_config
from .checkpoint import Checkpoint, CheckpointError, CheckpointManager, verify, write_text_atomic
from .data_io import DataInfo, dataset_dir, open_data, tokenized_alike
from .distributed import DistInfo, any_rank, broadcast_object, init_distributed, launched_rank
from .flags import to_toml
from .metrics import RunLog, check_logger_packages, git_revision, versions
from .fit_batch import first_step_peak_mb, fit_micro_batch
from .memory_estimate import FIT_ADVICE, check_fits_host
from .options import (FIELDS, FROZEN_ON_RESUME, MODE_DEFAULTS, TrainConfig, derived_defaults,
                      normalize, resolve, validate)
from .run_lock import LOCK_FILE, RunLock
from .seq_len_schedule import SeqLenSchedule

CONFIG_JSON = "config.json"
CONFIG_TOML = "config.toml"
# Settings of one invocation, not of the run: a resumed run does not inherit them.
PER_INVOCATION = ("out", "resume", "stop_at_step", "restart")


@dataclass
class RunSetup:
    cfg: TrainConfig
    model_cfg: HydraConfig
    run_dir: Path
    data: DataInfo
    device: torch.device
    manager: CheckpointManager
    resume_from: Checkpoint | None
    log: RunLog
    dist: DistInfo = field(default_factory=DistInfo)
    lock: RunLock | None = None  # held by rank 0 until the run ends

    def close(self) -> None:
        self.log.close()
        if self.lock is not None:
            self.lock.release()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: not a device this trainer runs on (use auto, cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (use cpu or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine shows {torch.cuda.device_count()} GPU(s), numbered from 0 "
                         "(CUDA_VISIBLE_DEVICES renumbers them): pick one of those")
    return device


def check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"run directory {run_dir} is not writable: {err.strerror or err}") from None


def check_one_out_for_all_ranks(run_dir: Path, info: DistInfo) -> None:
    """Each rank writes its checkpoint shards under --out and resumes from rank 0's choice there, so every rank must
    see one directory; on another node's local disk the shards would scatter and the first resume fail. Rank 0's lock
    file, read back on every rank, tells at start-up."""
    if not info.enabled:
        return

    def lock_text() -> bytes | None:
        try:
            return (run_dir / LOCK_FILE).read_bytes()
        except OSError:
            return None

    expected = broadcast_object(lock_text() if info.is_main else None, info)
    for _ in range(3):  # a network filesystem may show another node's fresh write a moment late
        if not any_rank(lock_text() != expected, info):  # the same answer on every rank: they loop in step
            return
        time.sleep(1.0)
    raise ValueError(f"--out {run_dir} is not the same directory on every rank (rank 0's {LOCK_FILE} is missing "
                     "or different on some rank): on several nodes, put --out on a filesystem they all share")


def check_outside_data(run_dir: Path, data: str | None) -> None:
    """Before the run directory is made: a run inside its data directory shares it with `hydra-lm prepare`, whose
    next run there would replace the tokenizer.json the run decodes with."""
    if data is None:
        return
    out, data_dir = run_dir.resolve(), Path(data).expanduser().resolve()
    if out == data_dir or data_dir in out.parents:
        where = "is" if out == data_dir else "is inside"
        raise ValueError(f"--out {run_dir} {where} the data directory {data}: a later `hydra-lm prepare` there "
                         "would replace the run's tokenizer.json; choose an --out outside it")


def read_saved_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / CONFIG_JSON
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return saved if isinstance(saved, dict) and "train" in saved else None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is corrupt ({err}); move it away and run again: a run with checkpoints then "
                         "resumes with the config stored in its newest checkpoint") from None


def merge_layers(file_values: dict[str, Any], cli: dict[str, Any], saved: dict[str, Any] | None,
                 built: dict[str, Any] | None = None) -> TrainConfig:
    """The run's settings: ``saved`` (a resumed run's saved train config; ``built``, the model it built), then the
    config file's, then the command line's."""
    base: dict[str, Any] = {}
    if saved is not None:
        kept = {k: v for k, v in saved.items() if k in FIELDS and k not in PER_INVOCATION}
        base = normalize(kept, "the run's saved config.json")
        # Runs saved before --fp8_recipe existed trained tensorwise (then the only scaling), whatever the default now.
        base.setdefault("fp8_recipe", "tensorwise")
        # Settings the run left to follow its LR and length follow them when a resume changes those: a new --lr gets
        # its own floor, a longer run its own evaluation and save cadence. The warm-up has already run.
        if None not in (base.get("lr"), base.get("max_steps"), base.get("mode")):
            derived = derived_defaults(base["lr"], base["max_steps"], base["mode"])
            for key in ("min_lr", "eval_every", "save_every"):
                if key in base and base[key] == derived[key]:
                    del base[key]
        # Likewise a new --mode gets its own length, logging and evaluation size where the run had the old mode's.
        mode = cli.get("mode") or file_values.get("mode")
        if mode is not None and mode != base.get("mode") and base.get("mode") in MODE_DEFAULTS:
            for key, value in MODE_DEFAULTS[base["mode"]].items():
                if base.get(key) == value:
                    del base[key]
        reference = dict(base)
        if built:  # a model key not overridden at the start is what the run's model has, not a change
            reference["model"] = {**HydraConfig.from_saved(built).to_dict(), **(base.get("model") or {})}
        for key in FROZEN_ON_RESUME:
            for layer, where in ((file_values, "the config file"), (cli, "the command line")):
                if key in layer and _changes(key, layer[key], reference.get(key)):
                    given, had = layer[key], reference.get(key)
                    if key == "model" and isinstance(given, dict) and isinstance(had, dict):
                        given = {k: v for k, v in given.items() if _changes(key, {k: v}, had)}
                        had = {k: had.get(k) for k in given}
                    raise ValueError(f"cannot change {key} when resuming (run has {had!r}, {where} gives "
                                     f"{given!r}): it would not load or not reproduce the run; drop it to "
                                     "resume, or start a new --out directory")
    merged = {**base, **file_values, **cli}
    # Model overrides merge key by key: the run's, then the config file's, then the command line's.
    models = [layer["model"] for layer in (base, file_values, cli) if layer.get("model") is not None]
    if models:
        merged["model"] = {k: v for model in models for k, v in model.items()}
    return TrainConfig(**merged)


def _changes(key: str, given: Any, saved: Any) -> bool:
    """Whether a resume's ``given`` value of frozen ``key`` changes the run's ``saved`` one: model overrides only in
    the keys given (the rest may come from another layer), preset names as the preset they name."""
    if key == "model" and isinstance(given, dict) and isinstance(saved, dict):
        # The kernel choices change how attention is computed, not what: a run may resume with another one.
        return any(k not in KERNEL_CHOICES and (k not in saved or saved[k] != v) for k, v in given.items())
    if key == "model_size" and isinstance(given, str) and isinstance(saved, str):
        try:
            return preset_config(given).preset != preset_config(saved).preset
        except ValueError:
            return True
    return given != saved


def fields_arch_ignores(arch: str) -> frozenset[str]:
    """Model fields that do nothing for ``arch`` (refused as overrides, left out of config.toml)."""
    return frozenset(HYDRA_ONLY_FIELDS) if arch == "dense" else frozenset({"n_layers"})


def build_model_config(cfg: TrainConfig, data: DataInfo) -> HydraConfig:
    overrides = dict(cfg.model)
    if overrides.get("arch", cfg.arch) != cfg.arch:  # the saved train config would record the other one
        raise ValueError(f"--model.arch {overrides['arch']} contradicts --arch {cfg.arch}: give --arch alone")
    ignored = [k for k in overrides if k in fields_arch_ignores(cfg.arch)]
    if ignored:  # the run would train the model it trains without them
        raise ValueError(f"--model.{ignored[0]} does nothing for --arch {cfg.arch}: " + (
            "the dense baseline has no routing, recursion or CCGQA attention; drop it" if cfg.arch == "dense" else
            "n_layers is the dense baseline's depth; a HYDRA model's is --model.n_blocks x --model.recursions"))
    preset = preset_config(cfg.model_size)
    if overrides.get("preset") not in (None, preset.preset):  # a resolved [model] table, from a run's config.toml
        raise ValueError(f"the config's [model] fields were resolved for preset {overrides['preset']!r}: with "
                         f"--model_size {cfg.model_size} they would keep that preset's sizes under this name; drop "
                         "--model_size, or the [model] table")
    preset_len = preset.max_seq_len
    values = {"arch": cfg.arch, "vocab_size": data.vocab_size, "max_seq_len": max(preset_len, cfg.seq_len)}
    values.update(overrides)
    model_cfg = preset_config(cfg.model_size, **values)
    if model_cfg.vocab_size < data.vocab_size:
        raise ValueError(f"model vocab_size={model_cfg.vocab_size} is smaller than the data's vocabulary "
                         f"({data.vocab_size} in {data.path}): token ids would be out of range")
    if model_cfg.max_seq_len < cfg.seq_len:
        raise ValueError(f"model max_seq_len={model_cfg.max_seq_len} is below seq_len={cfg.seq_len}")
    if cfg.batch_size % model_cfg.topk_groups:
        raise ValueError(f"model topk_groups={model_cfg.topk_groups} pools the batch's rows in equal groups: it must "
                         f"divide batch_size={cfg.batch_size}")
    if cfg.seq_len_schedule:  # the rows of each stage's micro-batches too, before a stage's switch fails on them
        SeqLenSchedule.parse(cfg.seq_len_schedule).check(cfg.batch_size, cfg.seq_len, model_cfg.topk_groups)
    return model_cfg


def setup_run(cli: dict[str, Any], file_values: dict[str, Any] | None = None, echo: bool = True) -> RunSetup:
    # Typed and checked here too (idempotent for the CLI's and config files' already normalized values): a Python
    # caller's "1e-3" or moe=True would otherwise fail deep inside, or an alias not map to its field.
    cli = normalize(cli, "setup_run's settings")
    file_values = normalize(file_values or {}, "setup_run's file values")
    out = cli.get("out") or file_values.get("out")
    if not out:
        raise ValueError("--out RUN_DIR is required")
    run_dir = Path(out).expanduser()
    data = cli.get("data") or file_values.get("data")
    dataset = cli.get("dataset") or file_values.get("dataset")
    if data is None and dataset is not None and (Path(dataset).expanduser() / "meta.json").is_file():
        data = dataset  # --dataset naming a prepared directory; its cache directories are not where runs go
    check_outside_data(run_dir, data)
    if (run_dir / "results.json").is_file() and (run_dir / "runs").is_dir():  # compare's own names
        raise ValueError(f"--out {run_dir} holds a `hydra-lm compare` output (results.json, runs/): train into a "
                         "directory of its own")
    made_here = not run_dir.exists()
    check_writable(run_dir)
    # Before anything reads or cleans the directory: another trainer's temporary files are its own.
    lock = RunLock(run_dir).acquire() if launched_rank() == 0 else None
    try:
        return _setup_locked(run_dir, file_values, cli, echo, lock)
    except BaseException:
        if lock is not None:
            lock.release()
            if made_here:  # a refused start leaves no directory of a run that never began (its log, its lock)
                shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _setup_locked(run_dir: Path, file_values: dict[str, Any], cli: dict[str, Any], echo: bool,
                  lock: RunLock | None) -> RunSetup:
    manager = CheckpointManager(run_dir / "checkpoints", "?")
    has_ckpt = bool(manager.list())
    saved = read_saved_config(run_dir)
    if has_ckpt and saved is None:
        saved = _config_from_checkpoints(manager, run_dir)
    resuming = has_ckpt
    # A run whose checkpoints were all set aside as corrupt is still this run: --restart trains it again from step 0
    # with its saved config, which the next start then checks as a resume's.
    same_run = saved is not None and (has_ckpt or bool(manager.quarantined()))
    cfg = merge_layers(file_values, cli, saved["train"] if same_run else None, saved.get("model") if same_run else None)
    rank = launched_rank()  # under torchrun only rank 0 writes the log; the others report warnings
    log = RunLog(run_dir / "train.log", echo=echo) if rank == 0 else RunLog(None, echo=False, prefix=f"[rank {rank}] ")
    try:
        if cfg.resume is False and has_ckpt:  # it resumed all the same: say so rather than ignore the flag
            raise ValueError(f"--no-resume: {run_dir} has checkpoints, which this run would continue from; use a new "
                             f"--out, or remove {run_dir / 'checkpoints'} to start over")
        if cfg.resume and not has_ckpt:
            log.warning(f"--resume: {run_dir} has no checkpoint yet; starting a new run")

        given = {k for layer in (file_values, cli) for k, v in layer.items() if v is not None}
        if {"data", "dataset"} <= given:  # on the command line, in --config, or one in each
            raise ValueError("--data and --dataset both name the training data: keep one")
        # --dataset given now names the data, over a resumed run's saved --data (checked against the run below).
        if cfg.dataset is not None and ("dataset" in given or cfg.data is None):
            cfg = cfg.replace(data=str(dataset_dir(cfg.dataset)))
        if cfg.data is None:
            raise ValueError("no data: pass --data DATA_DIR (from `hydra-lm prepare`) or --dataset default")
        if same_run and not {"data", "dataset"} & given and not Path(cfg.data).expanduser().exists():
            raise ValueError(f"run {run_dir} was trained on {Path(cfg.data).expanduser().resolve()}, which is gone; "
                             "pass --data DIR prepared with the run's tokenizer to resume")
        data = open_data(cfg.data)
        cfg = cfg.replace(data=str(data.path))  # saved absolute: a resume from another directory finds it
        pick_device(cfg.device)  # a bad --device fails here, before any process group forms
        info, device = init_distributed(cfg.device, cfg.parallel)
        check_one_out_for_all_ranks(run_dir, info)
        device = device or pick_device(cfg.device)
        preset = preset_config(cfg.model_size).preset  # validates the name early, with suggestions
        batch_from_table = cfg.batch_size is None and cfg.grad_accum is None and not cfg.seq_len_schedule
        eval_from_table = cfg.eval_batches is None
        cfg = resolve(cfg.replace(model_size=preset), preset, device.type == "cuda")
        model_cfg = build_model_config(cfg, data)
        if not resuming and cfg.warmup_steps > cfg.max_steps:  # a resume that shortened the run may (options.py)
            log.warning(f"--warmup_steps {cfg.warmup_steps} is longer than the run (--max_steps {cfg.max_steps}): the "
                        "learning rate never reaches --lr; lower --warmup_steps, or leave it out for max_steps/10")
        try:
            check_logger_packages(cfg.tensorboard, cfg.wandb)  # before write_run_files saves the flags
        except ValueError as err:
            saved = [f for f in ("tensorboard", "wandb") if getattr(cfg, f) and f not in given] if same_run else []
            if not saved:
                raise
            raise ValueError(f"{err}; the run's saved config has it: pass --no-{saved[0]} to resume without "
                             "it") from None
        if batch_from_table and device.type == "cuda" and not info.enabled and not resuming:
            cfg = _fit_batch_to_gpu(cfg, model_cfg, device, log, eval_from_table)
        if device.type == "cpu":
            check_fits_host(first_step_peak_mb(cfg, model_cfg, cfg.batch_size, "cpu"),
                            f"training {cfg.model_size} on batches of {cfg.batch_size} x {cfg.seq_len}",
                            FIT_ADVICE["train"], processes=info.world_size)
        manager = CheckpointManager(run_dir / "checkpoints", preset, cfg.keep_checkpoints, warn=log.warning)
        resume_from = None
        if same_run:
            check_same_run(saved, data, model_cfg, run_dir)
        if info.is_main:
            manager.cleanup_temp()
            resume_from = _checkpoint_to_resume(manager, resuming, cfg.restart, log)
        if info.enabled:  # rank 0 alone verifies (and quarantines); every rank resumes from its choice
            chosen = broadcast_object(None if resume_from is None else str(resume_from.path), info)
            resume_from = None if chosen is None else verify(Path(chosen))
        if resuming and resume_from is None and not cfg.restart:
            raise ValueError(f"{run_dir} has no usable checkpoint")
        if resume_from is not None:
            check_routing_kept(cfg, resume_from)
        return RunSetup(cfg, model_cfg, run_dir, data, device, manager, resume_from, log, info, lock)
    except BaseException:
        log.close()
        raise


def _fit_batch_to_gpu(cfg: TrainConfig, model_cfg: HydraConfig, device: torch.device, log: RunLog,
                      eval_from_table: bool) -> TrainConfig:
    """The per-size table's sequences per step in the largest micro-batch that fits this GPU (fit_batch.py).
    Evaluation batches are micro-batches too: when their count is the mode's default it shrinks with them,
    so an evaluation reads as many sequences as with the table's batch."""
    total = torch.cuda.get_device_properties(device).total_memory
    batch, accum, peak_mb = fit_micro_batch(cfg, model_cfg, total)
    if (batch, accum) == (cfg.batch_size, cfg.grad_accum):
        return cfg
    eval_batches = -(-cfg.eval_batches * cfg.batch_size // batch) if eval_from_table else cfg.eval_batches
    log.info(f"micro-batch fitted to the GPU: {batch} x {cfg.seq_len} x accumulation {accum} (the "
             f"{cfg.model_size} table's {cfg.batch_size} x {cfg.grad_accum}: the same sequences per step); "
             f"estimated peak {peak_mb:,.0f} of {total / 2 ** 20:,.0f} MB; --batch_size / --grad_accum "
             f"choose them yourself; {eval_batches} evaluation batches")
    fitted = cfg.replace(batch_size=batch, grad_accum=accum, eval_batches=eval_batches)
    validate(fitted)
    return fitted


def _config_from_checkpoints(manager: CheckpointManager, run_dir: Path) -> dict[str, Any]:
    """The run's config as the newest verifiable checkpoint recorded it (config.json is missing)."""
    for _, path in reversed(manager.list()):
        try:
            state = verify(path).state
        except CheckpointError:
            continue
        if "train_config" in state and "model_config" in state:
            return {"train": state["train_config"], "model": state["model_config"], "data": state.get("data", {})}
    raise ValueError(f"{run_dir} has no {CONFIG_JSON} and no checkpoint that records its config; cannot resume "
                     "safely: train into a new --out directory")


def _checkpoint_to_resume(manager: CheckpointManager, resuming: bool, restart: bool, log: RunLog) -> Checkpoint | None:
    """The newest good checkpoint; when every one has been set aside as corrupt, starting over
    from step 0 needs --restart (it would silently throw the run's progress away otherwise)."""
    try:
        found = manager.latest_good() if resuming else None
    except CheckpointError as err:
        found, reason = None, str(err)
    else:
        corrupt = manager.quarantined()
        reason = f"every checkpoint in {manager.dir} was set aside as corrupt ({', '.join(p.name for p in corrupt)})"
        if found is not None or not corrupt:
            return found
    if not restart:
        raise ValueError(f"{reason}; nothing to resume from. Pass --restart to start this run again from step 0 (the "
                         f"corrupt checkpoints are kept as *.corrupt), or put a good checkpoint back")
    log.warning(f"--restart: starting over from step 0 ({reason})")
    return None


def check_same_run(saved: dict[str, Any], data: DataInfo, model_cfg: HydraConfig, run_dir: Path) -> None:
    """A resumed run must see the tokenizer and build the model it was trained with."""
    was = saved.get("data", {})
    if not tokenized_alike(was, data):
        same_dir = was.get("path") is not None and Path(was["path"]).resolve() == Path(data.path).resolve()
        way = (f"{data.path} was prepared again since the run started, with another tokenizer: prepare the corpus "
               f"into a directory with the run's own (hydra-lm prepare --tokenizer {run_dir / 'tokenizer.json'} "
               "--input ... --out DIR) and pass --data DIR") if same_dir else \
            f"resume with the run's data directory ({was.get('path')})"
        raise ValueError(f"tokenizer mismatch: {data.path} (vocab {data.vocab_size}) was not tokenized like the data "
                         f"run {run_dir} was trained on (vocab {was.get('vocab_size')}); {way}")
    # Read back through HydraConfig: fields added since the run was saved take what the run was built with.
    was_model = HydraConfig.from_saved(saved["model"]).to_dict() if saved.get("model") else {}
    diff = sorted(k for k, v in model_cfg.to_dict().items() if was_model.get(k) != v and k not in KERNEL_CHOICES)
    if diff:
        raise ValueError(f"the model config differs from the one {run_dir} was trained with (fields {diff}); "
                         "resume with the same settings or start a new --out directory")


def check_routing_kept(cfg: TrainConfig, ckpt: Checkpoint) -> None:
    """A router the run switched on stays on (curriculum.py): --mod_off / --mor_off on a resume cannot take it back,
    where before the switch they keep it off."""
    state = ckpt.state.get("curriculum") or {}
    for flag, key, name in (("mod_off", "mod_active", "MoD"), ("mor_off", "mor_active", "MoR")):
        if getattr(cfg, flag) and state.get(key):
            raise ValueError(f"cannot set {flag} when resuming: {name} routing is on in the run's checkpoint "
                             f"{ckpt.path.name}, and a router once on stays on; drop --{flag} to resume, or start a "
                             "new --out directory")


def write_run_files(s: RunSetup, argv: list[str]) -> None:
    """config.json / config.toml (the resolved config), the tokenizer, and the log header.

    Called once the trainer is built, so a start that fails (a bad flag on a resumed run, say)
    leaves the run's saved config as it was."""
    record = {"train": s.cfg.to_dict(), "model": s.model_cfg.to_dict(), "data": s.data.to_dict(),
              "versions": versions(), "git": git_revision()}
    write_text_atomic(s.run_dir / CONFIG_JSON, json.dumps(record, indent=1))
    # The resolved model, less what its arch ignores: the file works as a --config for the same run again.
    model = {k: v for k, v in s.model_cfg.to_dict().items() if k not in fields_arch_ignores(s.model_cfg.arch)}
    # --dataset resolved into --data: the file names the data once (a --config holding both is refused).
    write_text_atomic(s.run_dir / CONFIG_TOML, to_toml({**s.cfg.to_dict(), "dataset": None, "model": model}))
    for name in ("tokenizer.json", "tokenizer_tiktoken.json"):
        src = s.data.path / name
        if src.is_file() and not (s.run_dir / name).is_file():  # copied whole or not at all
            tmp = s.run_dir / f".{name}.tmp-{os.getpid()}"
            shutil.copyfile(src, tmp)
            os.replace(tmp, s.run_dir / name)
    v = record["versions"]
    s.log.info(f"hydra-lm {v['hydra_lm']} (git {record['git']}) | torch {v['torch']} | python {v['python']} | "
               f"{s.device}" + (f" ({v['gpu']})" if "gpu" in v else ""))
    s.log.info("command: " + " ".join(argv))
