"""`hydra-lm compare`: train several model variants on the same data for the same budget, then
report validation loss against tokens, executed FLOPs and training time, plus routing health.

Every variant is an ordinary run directory (``OUT/runs/NAME``) trained by the normal trainer with
the same data order, seed, batch, sequence length, learning rate and schedule family; only the
number of steps differs where the budget is FLOPs or seconds. With ``--seeds S1 S2 ...`` every
variant trains once per seed (``OUT/runs/NAME.seedS``; each seed sets model init and data order for
every variant alike) and the report adds each variant's mean and spread over the seeds. With ``--lrs
LR1 LR2 ...`` every variant trains once per peak learning rate (``NAME.lrX``) and the report gives
each one's best, flagging a best at an end of the grid; ``--lr_extend N`` then trains up to N more
rounds, each taking every variant whose best is at an end one grid step beyond it. A finished
variant leaves ``compare.json`` in its run directory, so running the command again skips it; an
interrupted one resumes from its checkpoints (the trainer does that by itself).

Evaluation points: with a tokens or FLOPs budget, every ``ceil(steps / evals)`` steps plus the
start and the last step; with a seconds budget, every ``1/evals`` of the budget's training time
(the trainer's schedule clock), plus the start and the end. ``--eval_every K`` under a seconds budget
counts steps of that clock: every K/``SECONDS_CLOCK_STEPS`` (or K/``--max_steps``) of the time.
"""

from __future__ import annotations

import gc
import json
import math
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from ..config import HydraConfig, preset_config
from ..data.prepare import run_files_in
from ..train.checkpoint import write_text_atomic
from ..train.compile_policy import resolve_speed_options
from ..train.fp8 import check_fp8_device
from ..train.optim import check_optimizer_device
from ..train.data_io import dataset_dir, open_data
from ..train.distributed import launched_world_size
from ..train.options import TrainConfig, check_seed, resolve
from ..train.run import build_model_config, check_outside_data, pick_device
from .compare_results import collect_results, lr_extensions
from .compare_runs import (Budget, ComparePlan, VariantRun, finished_marker, parse_budget, read_marker,
                           steps_for_flops, write_marker)
from .variants import DEFAULT_VARIANTS, parse_custom_variant, resolve_variants, sweep_learning_rates

RESULTS = "results.json"
# Schedule resolution of a seconds budget: warm-up, curriculum and evaluations are placed in
# thousandths of the budget unless --max_steps says otherwise.
SECONDS_CLOCK_STEPS = 1000
DEFAULT_EVALS = 8  # --evals
# Settings compare decides itself; giving them would break the equal-budget comparison.
OWNED = {"arch": "variants choose the architecture (e.g. --variant deep:arch=dense,n_layers=8)",
         "stop_at_step": "every variant runs to its budget", "time_budget_s": "use --budget seconds=N"}


def run_compare(data: str | None, out: str | None, budget: str, variant_names: list[str] | None,
                custom_specs: list[str] | None, evals: int | None, shared: dict[str, Any],
                seeds: list[int] | None = None, gpus: int = 1, lrs: list[float] | None = None,
                lr_extend: int = 0) -> int:
    """Train what is missing, then write OUT/results.json, OUT/report.md and the plots.
    ``shared``: trainer settings (TrainConfig keys) applied to every variant; ``seeds``: train each
    variant once per seed; ``gpus``: train that many runs at a time, one per CUDA GPU of this host;
    ``lrs``: train each variant once per peak learning rate; ``lr_extend``: then up to that many rounds
    that extend a variant's grid past the end its best learning rate sits at."""
    from .plots import write_compare_plots
    from .report import format_lr_table, format_seed_table, format_table, write_report

    if launched_world_size() > 1:
        raise ValueError("compare trains its variants one after another in one process: launch it without torchrun; "
                         "--gpus N trains N of them at a time, one per GPU")
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: give the number of GPUs to train on at a time, at least 1")
    if lr_extend < 0 or (lr_extend and lrs is None):
        raise ValueError(f"--lr_extend {lr_extend}: give a number of rounds >= 0, with --lrs (the grid it extends)")
    extra_lrs: dict[str, list[float]] = {}
    for round_ in range(lr_extend + 1):
        # Re-running the command repeats the same rounds: their runs are finished and skipped.
        request = (data, out, budget, variant_names, custom_specs, evals, shared, seeds, lrs, extra_lrs)
        plan = plan_compare(data, out, parse_budget(budget), variant_names, custom_specs, evals, shared, seeds, lrs,
                            extra_lrs)
        if gpus > 1:
            code = train_on_gpus(plan, request, gpus)
        else:
            code = train_runs(plan, [run.name for run in plan.runs])
        if code == 130:
            return code
        more = lr_extensions(collect_results(plan).get("lr_sweep", {})) if round_ < lr_extend else {}
        if not more:
            break
        steps = ", ".join(f"{name} -> {lr:g}" for name, lr in more.items())
        print(f"compare: extending the learning-rate grid (round {round_ + 1} of {lr_extend}): {steps}", flush=True)
        for name, lr in more.items():
            extra_lrs.setdefault(name, []).append(lr)
    out_dir = plan.out
    results = collect_results(plan)
    write_text_atomic(out_dir / RESULTS, json.dumps(results, indent=1))
    plots = write_compare_plots(results, out_dir)
    write_report(results, plots, out_dir / "report.md")
    print(format_table(results))
    if results.get("across_seeds"):
        print(format_seed_table(results))
    if results.get("lr_sweep"):
        print(format_lr_table(results))
    for line in results["warnings"]:
        print(f"warning: {line}")
    print(f"compare: wrote {out_dir / 'report.md'}, {out_dir / RESULTS} and {len(plots)} plots")
    return 0 if all(v["status"] == "finished" for v in results["variants"].values()) else 1


def train_runs(plan: ComparePlan, names: list[str]) -> int:
    """Train the runs of ``plan`` named in ``names`` that are not finished, one after another, in this
    process. A run that raises is marked failed (the same command trains it again) and the others go on.
    130 when interrupted (the same command resumes), else 1 when a run failed, else 0."""
    from ..train import setup_run, train

    runs = training_order(plan)
    failed = False
    for i, run in enumerate(runs, 1):
        if run.name not in names:
            continue
        marker = finished_marker(run)
        if marker is not None:
            print(f"compare: {run.name} ({i}/{len(runs)}) {marker['status']} earlier in {run.run_dir}: "
                  "not retrained", flush=True)
            continue
        print(f"compare: training {run.name} ({i}/{len(runs)}): {run.variant.description} -> {run.run_dir}",
              flush=True)
        # Each variant is a new model: the previous ones' compiled graphs only count against Dynamo's
        # recompile limit of the functions every model shares (the routed unit).
        torch._dynamo.reset()
        try:
            setup = setup_run(run.values)
            write_marker(run, "started")  # its settings: a later command must not resume it under others
            code = train(setup)
        except Exception:  # e.g. out of memory: the other variants still train and the report names it failed
            traceback.print_exc()
            print(f"compare: {run.name} failed (traceback above); the next runs go on, and the same command "
                  "trains it again", flush=True)
            write_marker(run, "failed")
            failed = True
            continue
        finally:
            gc.collect()  # the run's model and CUDA graphs go now, not inside the next run's capture
        if code == 130:
            print(f"compare: interrupted; run the same command again to resume {run.name}", flush=True)
            return code
        write_marker(run, "finished" if code == 0 else "diverged")
    return 1 if failed else 0


def training_order(plan: ComparePlan) -> list[VariantRun]:
    """The runs seed by seed (every variant's first seed, then every variant's second, ...), so a study cut
    short by a machine's time limit still has every variant at its first seeds."""
    seeds = plan.seeds or [None]
    return sorted(plan.runs, key=lambda run: seeds.index(run.seed))  # stable: variants keep their order


def train_on_gpus(plan: ComparePlan, request: tuple, gpus: int) -> int:
    """Train the unfinished runs ``gpus`` at a time: one worker process per GPU (``CUDA_VISIBLE_DEVICES``),
    each taking the next unfinished run (``training_order``) from a shared queue when it is free (runs of
    unequal length keep every GPU busy) and logging to OUT/compare.gpuI.log. Every run still has a whole
    GPU to itself; they share the host's CPUs, so each worker gets an equal share of them for its own threads
    and compilation, which by default takes every core and overlaps the other runs' training (on a 4-GPU
    host whose cores other runs' and jobs' compilations shared, the training runs' tokens/s wavered by
    about 20%; compilation is not counted as training time, steps are)."""
    import multiprocessing

    found = torch.cuda.device_count()
    if gpus > found:
        raise ValueError(f"--gpus {gpus}: this machine has {found} CUDA GPU(s); give at most {found} "
                         "(or leave --gpus out to train the variants one after another)")
    # The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all of them when it is unset).
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = visible or [str(i) for i in range(found)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // gpus)
    missing = [run.name for run in training_order(plan) if finished_marker(run) is None]
    if not missing:
        return 0
    context = multiprocessing.get_context("spawn")  # fresh processes: CUDA_VISIBLE_DEVICES before CUDA starts
    queue = context.Queue()
    for name in missing:
        queue.put(name)
    workers = []
    for gpu in range(min(gpus, len(missing))):
        queue.put(None)  # one end mark per worker
        log = plan.out / f"compare.gpu{gpu}.log"
        print(f"compare: GPU {gpu} takes the next unfinished run when free (log: {log})", flush=True)
        worker = context.Process(target=_gpu_worker, args=(gpu, devices[gpu], threads, queue, request, str(log)))
        worker.start()
        workers.append((gpu, worker))
    codes = []
    queue.close()
    queue.cancel_join_thread()  # runs an interrupted worker left behind stay unfinished for the next call
    for gpu, worker in workers:
        worker.join()
        codes.append(worker.exitcode)
        if worker.exitcode not in (0, None):
            print(f"compare: the worker on GPU {gpu} exited with {worker.exitcode}; see "
                  f"{plan.out / f'compare.gpu{gpu}.log'}", flush=True)
    return 130 if 130 in codes else 0


def _gpu_worker(gpu: int, device: str, threads: int, queue, request: tuple, log: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    import sys

    import torch._inductor.config as inductor_config

    torch.set_num_threads(threads)
    inductor_config.compile_threads = threads

    with open(log, "a", buffering=1) as stream:
        sys.stdout = sys.stderr = stream
        os.dup2(stream.fileno(), 1)  # the compile workers' and native libraries' output too
        os.dup2(stream.fileno(), 2)
        print(f"compare: worker of GPU {gpu} (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}, "
              f"{torch.get_num_threads()} CPU threads, {inductor_config.compile_threads} compile threads)", flush=True)
        data, out, budget, variant_names, custom_specs, evals, shared, seeds, lrs, extra_lrs = request
        plan = plan_compare(data, out, parse_budget(budget), variant_names, custom_specs, evals, shared, seeds, lrs,
                            extra_lrs)
        failed = []
        while (name := queue.get()) is not None:
            try:
                code = train_runs(plan, [name])
            except Exception:  # into this log while it is open (after it closes the traceback would be lost)
                traceback.print_exc()
                print(f"compare: run {name} failed (traceback above); it stays unfinished, the next runs go on",
                      flush=True)
                failed.append(name)
                continue
            if code == 130:  # interrupted: leave the rest to the command's next call
                sys.exit(code)
            if code:  # marked failed, its traceback above
                failed.append(name)
        sys.exit(1 if failed else 0)


def plan_compare(data: str | None, out: str | None, budget: Budget, variant_names: list[str] | None,
                 custom_specs: list[str] | None, evals: int | None, shared: dict[str, Any],
                 seeds: list[int] | None = None, lrs: list[float] | None = None,
                 extra_lrs: dict[str, list[float]] | None = None) -> ComparePlan:
    """Check the request and work out every variant's trainer settings (nothing is trained here).
    ``extra_lrs``: learning rates that ``--lr_extend`` added to a variant's ``lrs``."""
    if lrs is not None and shared.get("lr") is not None:
        raise ValueError("--lr and --lrs: give one of them (--lrs trains every variant once per learning rate)")
    if seeds is not None:
        if shared.get("seed") is not None:
            raise ValueError("--seed and --seeds: give one of them (--seeds trains every variant once per seed)")
        if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"--seeds {' '.join(map(str, seeds))}: give distinct seeds >= 0 (e.g. --seeds 0 1 2)")
        for seed in seeds:
            check_seed(seed, "--seeds")
    if shared.get("dataset") is not None:  # as train takes it: 'default', a prepared directory or a corpus
        if data:
            raise ValueError("--data and --dataset both name the training data: keep one")
        data = str(dataset_dir(shared["dataset"]))
    if not data:
        raise ValueError("--data DATA_DIR is required (a directory from `hydra-lm prepare`; or --dataset default)")
    if not out:
        raise ValueError("--out DIR is required: the variants' runs, results.json, report.md and plots go there")
    check_outside_data(Path(out).expanduser(), data)  # once here, not as each variant's run starts
    held = run_files_in(Path(out).expanduser())
    if held:  # the variants' runs go under OUT/runs/: their report and results would land inside a training run
        raise ValueError(f"--out {out} holds a training run ({', '.join(held)}); compare writes its variants' runs, "
                         "report and results into a directory of its own: choose another --out")
    if evals is not None and shared.get("eval_every") is not None:
        raise ValueError("--evals and --eval_every both set when to evaluate: keep one")
    evals = DEFAULT_EVALS if evals is None else evals
    if evals < 1:
        raise ValueError(f"--evals {evals}: must be >= 1")
    info = open_data(data)
    if not info.token_counts.get("val"):
        raise ValueError(f"data directory {info.path} has no validation split, and compare evaluates every variant "
                         "on it: prepare the data again with --val_fraction above 0")
    shared = {k: v for k, v in shared.items() if k not in ("data", "dataset", "out")}
    for key, why in OWNED.items():
        if shared.get(key) is not None:
            raise ValueError(f"--{key} cannot be given to compare: {why}")
    if "arch" in shared.get("model", {}):
        raise ValueError(f"--model.arch cannot be given to compare: {OWNED['arch']}")
    if budget.kind != "seconds" and shared.get("max_steps") is not None:
        raise ValueError(f"--max_steps cannot be given with --budget {budget}: the budget sets each variant's steps "
                         "(with --budget seconds=N, --max_steps sets the schedule's resolution)")
    customs = [parse_custom_variant(spec) for spec in custom_specs or []]
    names = list(variant_names) if variant_names else ([] if customs else list(DEFAULT_VARIANTS))
    preset = preset_config(shared.get("model_size", "debug")).preset
    device = pick_device(shared.get("device", "auto"))
    on_cuda = device.type == "cuda"
    base = resolve(TrainConfig(**{**shared, "data": str(info.path), "model_size": preset}), preset, on_cuda)
    pinned = {"model_size": preset, "batch_size": base.batch_size, "grad_accum": base.grad_accum,
              "seq_len": base.seq_len}

    def model_config(overrides: dict[str, Any]) -> HydraConfig:
        cfg = base.replace(arch=overrides.get("arch", "hydra"),
                           model={**base.model, **{k: v for k, v in overrides.items() if k != "arch"}})
        return build_model_config(cfg, info)

    variants = resolve_variants(names, customs, model_config, base.seq_len)
    if lrs is not None:
        variants = sweep_learning_rates(variants, lrs, extra_lrs)
    tokens_per_step = base.batch_size * base.seq_len * base.grad_accum
    out_dir = Path(out).expanduser()
    runs = []
    custom_names = {c.name for c in customs}
    trained_as: dict[str, str] = {}  # a variant's model and trainer settings -> its name (same_as)
    for v in variants:
        label = v.swept_from or v.name
        try:
            model_cfg = model_config(v.overrides)
            # Batch and sequence length are shared; the learning rates follow the variant's optimizer (its
            # per-size default) unless the variant or the shared flags give them.
            own = resolve(TrainConfig(**{**shared, **v.train, "data": str(info.path), "model_size": preset}), preset,
                          on_cuda)
        except ValueError as err:  # say which variant's settings to change
            raise ValueError(f"{'--variant' if label in custom_names else 'variant'} {label}: {err}") from None
        # A run needs only its newest checkpoint (to resume, and for the final evaluation); the trainer's
        # default three of every 1B run (10 GB each) likely filled a device's 128 GB disk mid-study
        # (benchmarks/BENCHMARKS.md, twenty-ninth session).
        values = {"keep_checkpoints": 1, **shared, **pinned, "lr": own.lr, "min_lr": own.min_lr, **v.train,
                  "data": str(info.path),
                  "arch": v.arch, "model": {**base.model, **{k: x for k, x in v.overrides.items() if k != "arch"}}}
        share = budget.value * v.budget_scale
        if budget.kind == "seconds":
            steps = shared.get("max_steps") or SECONDS_CLOCK_STEPS
            values["time_budget_s"] = share
        elif budget.kind == "tokens":
            steps = math.ceil(share / tokens_per_step)
        else:
            steps = steps_for_flops(share, model_cfg, base.replace(**v.train), tokens_per_step)
        values["max_steps"] = steps
        # Rounded up: the last of the evals falls on the run's end (the trainer always evaluates there),
        # not one step before it (1000 steps // 3 = 333 evaluated at 999 and again at 1000).
        # --eval_every 0: at the end only (and the start), as in train.
        values["eval_every"] = shared["eval_every"] if shared.get("eval_every") is not None else \
            max(1, math.ceil(steps / evals))
        # A checkpoint at the middle and the end: the trainer's default of one per tenth cost a 1B run
        # about 30 s a save (twenty-ninth session), device time a study lacks.
        values["save_every"] = shared.get("save_every") or max(1, math.ceil(steps / 2))
        check_on_device(v.name, own, device)
        same_as(trained_as, label, model_cfg, values, custom_names)
        for seed in seeds or [None]:
            name = v.name if seed is None else f"{v.name}.seed{seed}"
            run_values = {**values, "out": str(out_dir / "runs" / name), **({} if seed is None else {"seed": seed})}
            runs.append(VariantRun(v, out_dir / "runs" / name, run_values, model_cfg, name, seed))
    for run in runs:  # a run directory that is not this study's is refused before any run trains
        read_marker(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    return ComparePlan(out_dir, budget, runs, info, base, None if shared.get("eval_every") is not None else evals,
                       tokens_per_step, seeds)


def same_as(trained_as: dict[str, str], label: str, model_cfg: HydraConfig, values: dict[str, Any],
            custom_names: set[str]) -> None:
    """Refuse a custom variant that would train exactly what another variant trains (its fields change nothing
    here, e.g. a setting at its default): its run would be the other's again under a new name. Built-in variants
    may coincide (dense and dense-flops at one depth): each is still what its name promises."""
    model = {k: v for k, v in model_cfg.to_dict().items() if k != "preset"}
    key = json.dumps([model, {k: v for k, v in values.items() if k not in ("model", "arch")}], sort_keys=True,
                     default=str)
    other = trained_as.setdefault(key, label)
    if other != label and (label in custom_names or other in custom_names):
        def named(n: str) -> str:
            return f"--variant {n}" if n in custom_names else f"variant {n}"
        raise ValueError(f"{named(label)} trains the same model with the same settings as {named(other)} (its "
                         "fields only repeat what that one has): drop one of them, or change a field so that they "
                         "differ")


def check_on_device(name: str, cfg: TrainConfig, device: torch.device) -> None:
    """What the trainer would refuse on this device for a variant's settings, before any variant trains
    (a precision or optimizer the device lacks would otherwise fail after the earlier variants' runs)."""
    try:
        resolve_speed_options(cfg, device, distributed=False, moe=bool(cfg.model.get("moe")))
        check_optimizer_device(cfg.optimizer, device)
        if cfg.experimental_fp8:
            check_fp8_device(device)
    except ValueError as err:
        raise ValueError(f"--variant {name}: {err}") from None
