"""Pretests: before training, each enabled speed optimization runs a few steps against the plain path.

On a copy of the model and one synthetic batch of at most ``PRETEST_ROWS`` rows (the plain path materialises
the whole logits: at the run's micro-batch it may not fit where the run's fused loss does), the optimized
forward + backward must give the plain path's loss and gradients (within a tolerance), nothing non-finite,
and a step time at most ``MAX_SLOWDOWN`` x the plain one (the two sides alternate; slower means slower in
every pair of timed repeats, after a warm-up repeat that also compiles; differences under
``MIN_SLOWDOWN_S`` count as noise). A failure switches that optimization off through the anomaly monitor's
switches (see ``safe_optimizations``) and the run goes on without it. Where the plain path itself cannot
run (out of memory, say) there is nothing to compare: the pretest is recorded as skipped and the run goes
on with the optimization. Every start of a run pretests (a new run, a checkpoint load, changed optimization
flags or model size are named as the trigger); results are appended to
``RUN_DIR/pretest_logs/pretest_history.json`` and written to one ``pretest_<time>.json`` per start. CUDA
graphs are not pretested: they replay the trainer's own step and optimizer.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ..model.factory import create_model
from ..config import HydraConfig, preset_config
from .checkpoint import verify, write_text_atomic
from .compile_policy import units_compile_switch

PRETEST_DIR = "pretest_logs"
HISTORY_FILE = "pretest_history.json"
REPEATS = 5  # the first one warms up (and compiles); the others are timed
MAX_SLOWDOWN = 2.0
MIN_SLOWDOWN_S = 0.02  # a step slower by less than this is timing noise, whatever the ratio
# (loss, gradient) relative tolerances: fp32 on the CPU, bf16 autocast on CUDA.
TOLERANCE = {"cpu": (1e-4, 1e-3), "cuda": (2e-2, 5e-2)}
PRETESTED = ("compile", "chunked_ce")
PRETEST_ROWS = 4  # rows of the pretest's batch at most (more where topk_groups needs more)


def pretest_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / PRETEST_DIR


def get_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every pretest of the run, oldest first (one entry per start that pretested)."""
    path = pretest_dir(run_dir) / HISTORY_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def get_summary(run_dir: str | Path) -> dict[str, Any]:
    """Per optimization: how often it passed and failed, and its latest result."""
    history = get_history(run_dir)
    optimizations: dict[str, dict[str, Any]] = {}
    for entry in history:
        for result in entry["results"]:
            o = optimizations.setdefault(result["optimization"], {"passed": 0, "failed": 0, "skipped": 0})
            o["skipped" if result.get("skipped") else "passed" if result["passed"] else "failed"] += 1
            o["last"] = {"time": entry["time"], "trigger": entry["trigger"], **result}
    return {"pretests": len(history), "optimizations": optimizations}


def print_summary(run_dir: str | Path) -> None:
    summary = get_summary(run_dir)
    print(f"{summary['pretests']} pretest(s) in {pretest_dir(run_dir)}")
    for key, o in summary["optimizations"].items():
        last = o["last"]
        verdict = f"skipped ({last['reason']})" if last.get("skipped") else "passed" if last["passed"] else \
            f"FAILED ({last['reason']})"
        skipped = f", skipped {o['skipped']}" if o["skipped"] else ""
        print(f"  --{key}: passed {o['passed']}, failed {o['failed']}{skipped}; last {verdict} at {last['time']} "
              f"({last['trigger']})")


def record_pretest(run_dir: str | Path, entry: dict[str, Any]) -> Path:
    """Write this start's file and append it to the history (each write atomic)."""
    directory = pretest_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S_%f")
    path = directory / f"pretest_{stamp}.json"
    write_text_atomic(path, json.dumps(entry, indent=1))
    write_text_atomic(directory / HISTORY_FILE, json.dumps([*get_history(run_dir), entry], indent=1))
    return path


def pretest_batch(vocab_size: int, batch_size: int, seq_len: int, device: torch.device, seed: int,
                  topk_groups: int = 1):
    """One batch of random tokens of the run's length and at most PRETEST_ROWS of its ``batch_size`` rows (a multiple
    of ``topk_groups``, which pools a top-k over the batch's rows in equal groups), from a generator of its own: the
    run's random streams and data order are untouched."""
    rows = min(batch_size, max(topk_groups, PRETEST_ROWS // topk_groups * topk_groups))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class _Path:
    """One side of a comparison: what to call on the shared model copy, and its last repeat's results."""

    def __init__(self, model: torch.nn.Module, call: Callable, ce_impl: str):
        self.model, self.call, self.ce_impl = model, call, ce_impl
        self.times, self.loss, self.grads = [], math.nan, []

    def step(self, batch, autocast, timed: bool) -> None:
        inputs, targets = batch
        self.model.ce_impl = self.ce_impl
        self.model.zero_grad(set_to_none=True)
        if inputs.is_cuda:
            torch.cuda.synchronize(inputs.device)
        t0 = time.perf_counter()
        with autocast():
            out = self.call(inputs, targets=targets)
        out["loss"].backward()
        if inputs.is_cuda:
            torch.cuda.synchronize(inputs.device)
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.loss = float(out["loss"].detach().float())
        self.grads = [None if p.grad is None else p.grad.detach().float().clone() for p in self.model.parameters()]


def _grad_difference(got: list, want: list) -> float:
    """Relative difference of two gradient lists: ||got - want|| / ||want|| (inf if either is non-finite)."""
    diff = ref = 0.0
    for g, w in zip(got, want):
        if (g is None) != (w is None):
            return math.inf
        if g is not None:
            diff += float((g - w).pow(2).sum())
            ref += float(w.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(ref), 1e-12) if math.isfinite(diff + ref) else math.inf


def compare(key: str, model: torch.nn.Module, batch, autocast, device_type: str,
            ce_impl: str = "auto") -> dict[str, Any]:
    """Pretest one optimization (``key``: a TrainConfig flag in PRETESTED) against the plain path."""
    work = copy.deepcopy(model)  # both sides share its weights: the run's model and buffers stay untouched
    # An eager copy: the run's compiled blocks and units, called with the copy's modules, would fail their guards
    # and compile again (half a minute on a GPU, and towards Dynamo's recompile limit).
    units_compile_switch(work)[0]()
    want = _Path(work, work, "naive")
    if key == "chunked_ce":
        got = _Path(work, work, ce_impl)
    elif key == "compile":
        got = _Path(work, torch.compile(work), "naive")
    else:
        raise ValueError(f"no pretest for --{key} (pretested: {', '.join(PRETESTED)})")
    skipped = None
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device_type == "cuda" else []):
            for i in range(REPEATS):  # alternating, so a busy machine slows both sides alike
                try:
                    want.step(batch, autocast, timed=i > 0)
                except Exception as err:  # no reference to compare with (out of memory, say): not the optimization's
                    skipped = f"the plain path raised {_first_line(err)}"
                    break
                try:
                    got.step(batch, autocast, timed=i > 0)
                except Exception as err:  # a crashing optimization fails its pretest instead of stopping the run
                    return {"optimization": key, "passed": False, "reason": f"raised {_first_line(err)}"}
    finally:
        if key == "compile":  # the copy's graphs must neither hold memory nor shape how the run compiles
            torch._dynamo.reset()
    if skipped is not None:
        del work, want, got  # the copy and its gradients, before the run's first step
        if device_type == "cuda":
            torch.cuda.empty_cache()
        return {"optimization": key, "passed": None, "skipped": True, "reason": skipped}
    want_loss, got_loss = want.loss, got.loss
    loss_tol, grad_tol = TOLERANCE.get(device_type, TOLERANCE["cpu"])
    loss_diff = abs(got_loss - want_loss) / max(abs(want_loss), 1e-12)
    grad_diff = _grad_difference(got.grads, want.grads)
    # Slower only if slower in every (plain, optimized) pair of repeats: a busy machine rarely slows all of them.
    slowdown = min(g / max(w, 1e-12) for g, w in zip(got.times, want.times))
    extra_s = min(g - w for g, w in zip(got.times, want.times))
    if not (math.isfinite(got_loss) and math.isfinite(grad_diff)):
        reason = f"non-finite loss or gradients (loss {got_loss:.6g})"
    elif loss_diff > loss_tol:
        reason = f"loss {got_loss:.6g} differs from the plain path's {want_loss:.6g} (relative {loss_diff:.2e} > " \
                 f"{loss_tol:g})"
    elif grad_diff > grad_tol:
        reason = f"gradients differ from the plain path's by {grad_diff:.2e} (relative, > {grad_tol:g})"
    elif slowdown > MAX_SLOWDOWN and extra_s > MIN_SLOWDOWN_S:
        reason = f"a step takes at least {slowdown:.2f}x the plain path's time (> {MAX_SLOWDOWN:g}x; " \
                 f"{min(got.times) * 1e3:.1f} ms against {min(want.times) * 1e3:.1f} ms at best)"
    else:
        reason = None
    return {"optimization": key, "passed": reason is None, "reason": reason, "loss": got_loss,
            "plain_loss": want_loss, "loss_diff": loss_diff, "grad_diff": grad_diff,
            # best against best: the pair rule above is one-sided (it must not fail an optimization for one slow
            # repeat), so its ratio, the luckiest pair, would overstate the speed-up
            "speed_ratio": min(want.times) / max(min(got.times), 1e-12)}


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def pretested_on(train_config: dict[str, Any], device_type: str) -> list[str]:
    """The PRETESTED optimizations a run's saved config turns on, on ``device_type``: asked for, or left
    automatic (None), which compile_policy turns on on CUDA and off elsewhere."""
    return [k for k in PRETESTED if train_config.get(k) or (train_config.get(k) is None and device_type == "cuda")]


def optimization_flags(train_config: dict[str, Any]) -> dict[str, Any]:
    # None: the speed policy decides by device (see compile_policy).
    flags = {k: train_config.get(k) for k in (*PRETESTED, "cuda_graph")}
    return {k: "auto" if v is None else v for k, v in flags.items()}


def trigger_of(train_config: dict[str, Any], model_size: str, checkpoint_state: dict[str, Any] | None) -> str:
    """Why this start pretests: a new run, or a checkpoint load and what changed since it was saved."""
    if checkpoint_state is None:
        return "new run"
    was_size = checkpoint_state.get("model_size", model_size)
    if was_size != model_size:
        return f"model size changed ({was_size} -> {model_size})"
    was, now = optimization_flags(checkpoint_state.get("train_config", {})), optimization_flags(train_config)
    changed = [f"{k}: {was[k]} -> {now[k]}" for k in now if was[k] != now[k]]
    return f"optimization flags changed ({', '.join(changed)})" if changed else "checkpoint load"


def run_pretests(model: torch.nn.Module, keys: list[str], train_config: dict[str, Any], model_size: str,
                 batch, autocast, device_type: str, trigger: str, step: int = 0) -> dict[str, Any]:
    """Pretest each optimization in ``keys``: the history entry (not yet written)."""
    ce_impl = model.ce_impl if model.ce_impl != "naive" else "auto"
    results = [compare(key, model, batch, autocast, device_type, ce_impl) for key in keys]
    return {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "trigger": trigger, "step": step,
            "model_size": model_size, "device": device_type, "flags": optimization_flags(train_config),
            "results": results}


class PretestHook:
    """Pretests the trainer's enabled optimizations before its first step and switches failures off."""

    def __init__(self, trainer):
        self.t = trainer

    def before_training(self) -> dict[str, Any] | None:
        t = self.t
        keys = [s.key for s in t.safe_opts.switches if s.on and s.pretested and s.key in PRETESTED]
        if not keys:
            return None
        if t.cfg.experimental_skip_pretest:
            t.log.info(f"--experimental_skip_pretest: not pretesting {', '.join('--' + k for k in keys)}")
            return None
        if t.dist.enabled:
            t.log.info("pretests run in one process only: not pretesting under torchrun")
            return None
        resumed = t.s.resume_from.state if t.s.resume_from is not None else None
        trigger = trigger_of(t.cfg.to_dict(), t.cfg.model_size, resumed)
        batch = pretest_batch(t.s.model_cfg.vocab_size, t.cfg.batch_size, t.cfg.seq_len, t.device, t.cfg.seed,
                              t.s.model_cfg.topk_groups)
        t0 = time.perf_counter()
        entry = run_pretests(t.model, keys, t.cfg.to_dict(), t.cfg.model_size, batch, t.autocast, t.device.type,
                             trigger, t.step)
        path = record_pretest(t.s.run_dir, entry)
        for r in entry["results"]:
            if r.get("skipped"):
                t.log.warning(f"pretest skipped for --{r['optimization']} ({trigger}): {r['reason']}; the run goes on "
                              "with it, untested")
            elif r["passed"]:
                t.log.info(f"pretest passed for --{r['optimization']} ({trigger}): loss within {r['loss_diff']:.1e}, "
                           f"gradients within {r['grad_diff']:.1e}, {r['speed_ratio']:.2f}x the plain path's speed")
            else:
                t.safe_opts.disable(r["optimization"], t.step, r["reason"])
        t.log.info(f"pretests took {time.perf_counter() - t0:.1f} s; results in {path}")
        return entry


def run_pretests_for_checkpoint(path: str | Path, size: str | None = None, device: str = "cpu",
                                run_dir: str | Path | None = None) -> dict[str, Any]:
    """Pretest the optimizations a checkpoint's run enabled, on its weights (or, with another model
    ``size``, on a fresh model of that size), and record the result in ``run_dir``/pretest_logs. ``run_dir``
    defaults to the checkpoint directory's run (RUN_DIR of RUN_DIR/checkpoints/NAME), or for an exported
    .safetensors file to the folder that holds it."""
    ckpt = verify(Path(path).resolve())  # resolved: a relative path's parents are not the run's
    state = ckpt.state
    train_config, dev = state["train_config"], torch.device(device)
    saved_size = state.get("model_size", train_config.get("model_size"))
    if size is None or size == saved_size:
        model_cfg = HydraConfig.from_saved(state["model_config"])
        model = create_model(model_cfg)
        ckpt.load_model(model)
    else:
        model_cfg = preset_config(size, vocab_size=state["model_config"]["vocab_size"])
        model = create_model(model_cfg)
    model.to(dev).train()
    if train_config.get("chunked_ce"):
        model.ce_impl, model.ce_chunk_size = "auto", train_config.get("chunked_ce_size", 4096)
    keys = pretested_on(train_config, dev.type)
    size = size or saved_size
    trigger = trigger_of(train_config, size, state)
    batch = pretest_batch(model_cfg.vocab_size, train_config["batch_size"], train_config["seq_len"], dev,
                          train_config.get("seed", 0), model_cfg.topk_groups)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else contextlib.nullcontext
    entry = run_pretests(model, keys, train_config, size, batch, autocast, dev.type, trigger, ckpt.step)
    if run_dir is None:
        run_dir = ckpt.path.parent if ckpt.path.is_file() else ckpt.path.parent.parent
    record_pretest(Path(run_dir), entry)
    return entry
