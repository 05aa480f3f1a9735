"""The trainer's state in and out of checkpoints: save, resume, and roll back to the last good one
after a divergence (or after the anomaly monitor switched an optimization off)."""

from __future__ import annotations

import contextlib
import errno

import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from .checkpoint import DISK_FULL, CheckpointError, capture_rng, disk_full_error, free_bytes, restore_rng, verify
from .distributed import broadcast_object
from .optim import load_keeping_lr, portable_optimizer_state
from .sharded_checkpoint import RANK_FILE, load_dcp, load_optimizer, load_single_into_sharded, os_error


def save_checkpoint(t, reason: str = "") -> bool:
    """Write trainer ``t``'s checkpoint unless anything since the last check (loss, gradients,
    weights) is non-finite."""
    if not t.healthy(check_params=True):
        t.log.warning(f"not saving step {t.step}: the loss, gradients or weights are not finite")
        return False
    t.clock.bank()
    rng_json, rng_tensors = capture_rng()
    state = {
        "model_size": t.s.cfg.model_size,
        "tokens_seen": t.tokens_seen,
        "train_s": t.clock.train_s,
        "startup_s": t.clock.startup_s,
        "curriculum": t.curriculum.state_dict(),
        "adaptive_lr": t.adaptive.state_dict() if t.adaptive is not None else None,
        "rollback": t.rollback.state_dict(),
        "safe_optimizations": t.safe_opts.state_dict(),
        "loader": t.loader.state_dict(),
        "batch_filter": t.batch_filter.state_dict() if t.batch_filter is not None else None,
        "swa": t.swa.state_dict() if t.swa is not None else None,
        "rng": rng_json,
        "log_window": t.window.state() if t.window is not None else None,
        "starving_experts": sorted(t.starving),  # warned about once per run, resumed or not
        "train_config": t.cfg.to_dict(),
        "model_config": t.s.model_cfg.to_dict(),
        "data": t.s.data.to_dict(),
    }
    with t.stop_request.saving(), disk_full_in_one_line(t):
        if t.saver is not None:
            path = t.saver.save(t.step, t.model, t.optimizer, rng_tensors, state)
        else:
            # Optimizer state keyed by parameter name, so any number of ranks can load it.
            optimizer = portable_optimizer_state(get_optimizer_state_dict(t.model, t.optimizer))
            trainer_tensors = {"optimizer": optimizer, **rng_tensors}
            path = t.s.manager.save(t.step, t.model, trainer_tensors, state, t.swa.save if t.swa is not None else None)
    note = f" ({reason})" if reason else ""
    if t.saver is not None and t.saver.use_async:  # the saver logs "saved" once the files are committed
        t.log.info(f"started saving checkpoint {path}{note} in the background")
    else:
        t.log.info(f"saved checkpoint {path}{note}")
    return True


def finish_save(t) -> None:
    """Commit a pending asynchronous save (collective; nothing without one), a full disk reported as in
    ``save_checkpoint``."""
    if t.saver is not None:
        with t.stop_request.saving(), disk_full_in_one_line(t):
            t.saver.finish()


@contextlib.contextmanager
def disk_full_in_one_line(t):
    """A checkpoint write that found the disk full as one line (``disk_full_error``), whether its OSError comes
    bare or inside DCP's CheckpointException, which is no Exception, or as the writers' own errors: safetensors'
    SafetensorError ("No space left on device (os error 28)") and torch.save's RuntimeError ("unexpected pos"), which
    carry no errno (a real full disk; a tmpfs of 2 MB showed both)."""
    try:
        yield
    except (OSError, CheckpointException, RuntimeError, SafetensorError) as err:
        cause, needed = os_error(err), state_bytes(t)
        if cause is not None and cause.errno in DISK_FULL:
            raise disk_full_error(t.s.manager.dir, cause, needed) from None
        text, free = str(err), free_bytes(t.s.manager.dir)
        if "No space left on device" in text or "os error 28" in text or (
                isinstance(err, RuntimeError) and "unexpected pos" in text and free is not None and free < needed):
            raise disk_full_error(t.s.manager.dir, OSError(errno.ENOSPC, text), needed) from None
        raise


def state_bytes(t) -> int:
    """This process's weights and optimizer state: about what one checkpoint takes on disk."""
    tensors = [*t.params, *(v for st in t.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
    return sum(x.numel() * x.element_size() for x in tensors)


def restore(t, ckpt, verb: str = "resumed from") -> None:
    """Load checkpoint ``ckpt`` into trainer ``t``: model, optimizer, loop state, data position, RNGs (``verb``: how
    the log line says it, "rolled back to" within a run)."""
    # On the CPU: RNG states must stay there; the optimizer moves its state to the parameters' device.
    same_world = ckpt.world_size == t.dist.world_size
    tensors: dict = {}

    def load() -> None:
        if ckpt.layout == "dcp":
            load_dcp(ckpt, t.model, t.optimizer, distributed=t.dist.enabled)
            tensors.update(ckpt.load_trainer("cpu", RANK_FILE.format(t.dist.rank)) if same_world else {})
        else:
            tensors.update(ckpt.load_trainer(map_location="cpu"))
            if t.dist.enabled and t.dist.parallel == "fsdp":
                load_single_into_sharded(ckpt, t.model, t.optimizer, tensors)
            else:
                ckpt.load_model(t.model)
                load_optimizer(t.model, t.optimizer, tensors["optimizer"])

    try:
        load_keeping_lr(t.optimizer, load, t.device)
    except (ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"checkpoint {ckpt.path}: its model or optimizer state does not fit this run "
                         f"({t.cfg.optimizer}): {err}") from None
    st = ckpt.state
    t.step = ckpt.step
    t.tokens_seen = int(st.get("tokens_seen", 0))
    t.clock.train_s, t.clock.startup_s = float(st.get("train_s", 0.0)), float(st.get("startup_s", 0.0))
    t.curriculum.load_state_dict(st["curriculum"], t.device)
    if t.swa is not None:
        t.swa.load(ckpt.path, st.get("swa"))
    if t.adaptive is not None and st.get("adaptive_lr"):
        t.adaptive.load_state_dict(st["adaptive_lr"])
    # A resume with another --lr (a divergence's advice already folds the rollbacks' scaling into it) starts the
    # rollback count and scaling afresh; with the run's own LR they carry on.
    if st.get("rollback") and st.get("train_config", {}).get("lr", t.cfg.lr) == t.cfg.lr:
        t.rollback.load_state_dict(st["rollback"])
    if t.batch_filter is not None and st.get("batch_filter"):
        t.batch_filter.load_state_dict(st["batch_filter"])
    if t.seq_schedule is not None:  # the loader of the stage the checkpoint was in
        near = t.seq_schedule.stage_at(t.clock.position(t.step), t.cfg.max_steps)
        t.replace_loader(t.seq_schedule.stage_of_length(st["loader"]["seq_len"], near))
    t.loader.load_state_dict(st["loader"])
    t.saved_window = st.get("log_window")
    t.starving = set(st.get("starving_experts", ()))
    if same_world:
        restore_rng(st["rng"], {k: v for k, v in tensors.items() if k in ("torch", "cuda")})
    else:
        t.log.warning(f"{ckpt.path} was written by {ckpt.world_size} process(es), this run has "
                      f"{t.dist.world_size}: model and optimizer restored; the data continues at the same "
                      f"row of the epoch but batches are now shared out among {t.dist.world_size}, and the "
                      "random number streams restart from the seed, so the run is not bit-identical to an "
                      "uninterrupted one" + _global_batch_advice(st.get("train_config", {}), ckpt.world_size, t))
    t.log.info(f"{verb} {ckpt.path} at step {t.step}")


def _global_batch_advice(saved: dict, saved_world: int, t) -> str:
    """What keeps the checkpoint's rows per optimizer step on this world size, where they change."""
    if not (saved.get("batch_size") and saved.get("grad_accum")):
        return ""
    was = saved["batch_size"] * saved["grad_accum"] * saved_world
    now = t.cfg.batch_size * t.cfg.grad_accum * t.dist.world_size
    if was == now:
        return ""
    per_accum = t.cfg.batch_size * t.dist.world_size
    fix = (f"--grad_accum {was // per_accum} keeps it" if was % per_accum == 0 else
           f"no --grad_accum keeps it at --batch_size {t.cfg.batch_size}")
    return (f"; an optimizer step now takes {now} rows against the checkpoint's {was} (the learning rate was "
            f"tuned for those): {fix}")


def last_good_checkpoint(t, before: int | None = None):
    """The newest checkpoint that verifies (of a step below ``before``, where given; rank 0 decides), or None."""
    path = None
    if t.dist.is_main:
        try:
            ckpt = t.s.manager.latest_good(before)
        except CheckpointError:
            ckpt = None
        path = None if ckpt is None else str(ckpt.path)
    path = broadcast_object(path, t.dist)
    return None if path is None else verify(path)


def roll_back_to(t, good) -> None:
    """Continue from checkpoint ``good``, keeping the rollback count and switched-off optimizations."""
    policy = t.rollback.state_dict()
    restore(t, good, "rolled back to")
    t.metrics.rewind(good.step)
    if t.clock.t0 is not None:  # training time restarts from the checkpoint's count
        t.clock.start()
    t.rollback.load_state_dict(policy)  # the checkpoint's own (older) count would allow endless retries
    t.finite.reset()
    t.batches = None
    if t.train_step.graphs is not None:
        t.train_step.graphs.reset()
    t.window = t.new_window()
    t.safe_opts.restarted_at(t.step)


def continue_after_switch(t) -> bool:
    """An optimization was switched off: go on from the last good checkpoint (True), or from here without one."""
    finish_save(t)  # a pending save was checked before it started: the newest good checkpoint
    # From before the burst of anomalies that switched it off where one is kept (a checkpoint saved between them
    # holds their state), else the newest.
    good = last_good_checkpoint(t, before=t.safe_opts.switched_after) or last_good_checkpoint(t)
    if good is not None:
        roll_back_to(t, good)
        return True
    t.window = t.new_window()
    return False


def handle_divergence(t, stopping: bool = False) -> bool:
    """Roll back to the last good checkpoint with a lower LR (True), or explain and stop (False; always when
    ``stopping``: a stop signal arrived with the divergence)."""
    cfg, w = t.cfg, t.window
    values = w.means()
    where = (f"training diverged by step {t.step} (last {w.steps} steps: mean loss {values[0]:.4g}, grad "
             f"norm {values[5]:.4g})")
    finish_save(t)  # a pending save was checked before it started: it is good
    good = last_good_checkpoint(t)
    record = {"kind": "divergence", "step": t.step, "loss": values[0], "grad_norm": values[5],
              "rollbacks": t.rollback.rollbacks}
    if good is None:
        t.metrics.write({**record, "action": "stop"})
        t.log.warning(f"{where}; no checkpoint was saved before it, so there is nothing to roll back to: "
                      f"start again with a lower --lr (this run used {cfg.lr:g})")
        return False
    if stopping or not t.rollback.may_roll_back():
        t.metrics.write({**record, "action": "stop", "good_checkpoint": str(good.path)})
        scale = t.rollback.lr_scale * cfg.rollback_lr_factor
        # --adamw_lr is absolute: lower it alike, or Muon's part alone would slow down
        adamw = f" --adamw_lr {cfg.adamw_lr * scale:.3g}" if cfg.optimizer == "muon" and cfg.adamw_lr else ""
        why = "as the run was asked to stop, without a rollback" if stopping else \
            f"after {t.rollback.rollbacks} rollback(s)"
        t.log.warning(f"{where} {why}; nothing from the diverged state "
                      f"was saved. The last good checkpoint is {good.path} (step {good.step}): resume from it "
                      f"with a lower learning rate: hydra-lm train --out {t.s.run_dir} --lr {cfg.lr * scale:.3g}"
                      f"{adamw}")
        return False
    diverged_at = t.step
    roll_back_to(t, good)
    t.safe_opts.note_divergence(diverged_at, good.step)
    t.rollback.record_rollback()
    t.metrics.write({**record, "action": "rollback", "to_step": good.step, "checkpoint": str(good.path),
                     "rollbacks": t.rollback.rollbacks, "lr_scale": t.rollback.lr_scale})  # this one counted
    t.log.warning(f"{where}: rolled back to {good.path} (step {good.step}) with the learning rate "
                  f"x{t.rollback.lr_scale:g} (rollback {t.rollback.rollbacks} of {cfg.max_rollbacks})")
    return True
