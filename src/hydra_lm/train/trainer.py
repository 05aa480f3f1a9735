"""The training loop: accumulation, clipping, schedule, curriculum, eval, checkpoints, exact resume.

Inside a step nothing reads a device value back to the host: losses, grad norms and the
curriculum's loss EMA stay on the device and are read together every ``log_every`` steps.
Under torchrun the same loop runs on every rank (see ``distributed``): losses and routing
statistics are averaged over ranks each step, so every rank takes the same decisions.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch

from ..model.factory import create_model
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from .batch_filter import BatchFilter
from .compile_policy import apply_speed_plan, enable_tf32, resolve_speed_options
from .checkpoint import DISK_FULL, CheckpointError, capture_rng, disk_full_error, restore_rng, verify
from .curriculum import Curriculum, CurriculumPlan
from .data_io import ValSet, train_loader
from .evaluate import evaluate, format_eval, routing_warnings
from .distributed import (any_rank, broadcast_object, full_tensor, gather_objects, gradient_sync, mean_across_ranks,
                          sum_across_ranks, wrap_model)
from .divergence import FiniteFlag, RollbackPolicy, parameters_finite
from .metrics import MetricsWriter, NullMetrics, measure_peak_flops, memory_mb, progress_line
from .optim import build_optimizer, check_optimizer_features, portable_optimizer_state, set_lr
from .pretest import PretestHook
from .run import RunSetup, write_run_files
from .safe_optimizations import AnomalyMonitor, SafeOptimizations, Switch
from .schedule import AdaptiveLR, lr_at
from .swa import WeightAverage
from .attention_kernels import enable_fa3
from .fp8 import convert_to_fp8
from .moe_training import check_moe_options, expert_load_record, hold_routers
from .seq_len_schedule import SeqLenSchedule, carry_over
from .sharded_checkpoint import RANK_FILE, ShardedSaver, load_dcp, load_optimizer, load_single_into_sharded
from .step import TrainStep

EXIT_INTERRUPTED = 130
REPEATED_SIGNAL_S = 2.0  # signals closer together than this count as one request


class Trainer:
    def __init__(self, setup: RunSetup):
        self.s = setup
        cfg, self.cfg, self.log, self.device, self.dist = setup.cfg, setup.cfg, setup.log, setup.device, setup.dist
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        enable_tf32(self.device)
        self.plan = resolve_speed_options(cfg, self.device, self.dist.enabled)
        self.model = create_model(setup.model_cfg).to(self.device)
        self._check_features()
        mc = setup.model_cfg
        routable = (mc.arch == "hydra" and mc.mod_enabled, mc.arch == "hydra" and mc.mor_enabled and mc.recursions > 1)
        # self.model stays the HydraModel (sharded in place by FSDP2); self.wrapped is what a step calls.
        self.wrapped = wrap_model(self.model, self.dist, self.device, find_unused=any(routable) or mc.moe)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg, self.device)
        self.curriculum = Curriculum(CurriculumPlan.from_config(cfg, routable))
        self.swa = WeightAverage(self.model, int(cfg.swa_start_pct * cfg.max_steps)) if cfg.swa else None
        self.adaptive = AdaptiveLR(cfg.adaptive_lr_spike, cfg.adaptive_lr_factor, cfg.adaptive_lr_cooldown) \
            if cfg.adaptive_lr else None
        self.batch_filter = BatchFilter(cfg.batch_filter_k, self.device, warmup=cfg.batch_filter_warmup) \
            if cfg.batch_filter else None
        self.seq_schedule = SeqLenSchedule.parse(cfg.seq_len_schedule) if cfg.seq_len_schedule else None
        self.seq_stage = 0
        self.loader = self._stage_loader(0)
        self.saver = ShardedSaver(setup.manager, self.dist, cfg.async_checkpoint) if self.dist.enabled else None
        self.step = 0
        self.tokens_seen = 0
        self.train_s = 0.0  # seconds of training steps only (no eval, checkpoints, compilation at a start)
        self.startup_s = 0.0
        self._train_t0: float | None = None
        self.finite = FiniteFlag(self.device)
        self.rollback = RollbackPolicy(cfg.max_rollbacks, cfg.rollback_lr_factor)
        self._saved_window: dict | None = None
        self._window: dict | None = None
        if setup.resume_from is not None:
            # Keep this run's LR ratios and LR holders (torchao keeps the LR in a tensor) over the saved ones.
            lrs = [(g["lr"], g["lr_ratio"]) for g in self.optimizer.param_groups]
            self._restore(setup.resume_from)
            for group, (lr, ratio) in zip(self.optimizer.param_groups, lrs):
                group["lr"], group["lr_ratio"] = lr, ratio
        # After any restore: a captured step needs a capturable optimizer (learning rate on the device).
        self.train_step = TrainStep(self.model, apply_speed_plan(self.model, self.wrapped, self.plan), self.optimizer,
                                    self.device, self.plan, cfg.grad_accum, cfg.grad_clip, cfg.cuda_graphs_warmup)
        self._graphs_announced = False
        self.use_doc_ids = cfg.document_masking
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world_size
        self.peak_flops = measure_peak_flops(self.device) if self.device.type == "cuda" else None
        self._stop: str | None = None
        self._signal_at: float | None = None
        self._valset: ValSet | None = None
        self._iter = None
        monitor = AnomalyMonitor(cfg.experimental_safety_window, cfg.experimental_loss_spike_threshold,
                                 cfg.experimental_throughput_drop_threshold)
        self.safe_opts = SafeOptimizations(self._optimization_switches(), monitor, self.log.warning,
                                           lambda record: self.metrics.write(record))
        if setup.resume_from is not None and setup.resume_from.state.get("safe_optimizations"):
            self.safe_opts.load_state_dict(setup.resume_from.state["safe_optimizations"])

    # ------------------------------------------------------------------ setup helpers
    def _check_features(self) -> None:
        cfg = self.cfg
        if cfg.time_budget_s and self.dist.enabled:
            raise ValueError("--time_budget_s works in one process only (ranks time their steps differently and "
                             "would disagree on the schedule); under torchrun use --max_steps")
        check_optimizer_features(cfg, self.dist)
        check_moe_options(cfg, self.s.model_cfg.arch, self.s.model_cfg.moe)
        self._starving: set[str] = set()
        if cfg.experimental_fa3:
            self.log.info(enable_fa3(self.device))
        if cfg.experimental_fp8:
            n = convert_to_fp8(self.model, cfg.fp8_format, self.device)
            self.log.info(f"--experimental_fp8: {n} Linear layers of the transformer layers now train in float8 "
                          f"({cfg.fp8_format})")
        if cfg.mor_ramp and self.s.model_cfg.mor_routing != "expert":
            raise ValueError("--mor_ramp sets the capacities of expert-choice MoR; with --model.mor_routing token "
                             "each token picks its own depth: drop --mor_ramp")
        if cfg.swa and self.dist.enabled:
            raise ValueError("--swa works in one process only (the average is an unsharded copy of the model); "
                             "drop --swa under torchrun")
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing = True
            self.model.checkpoint_every = cfg.checkpoint_every or 1

    def _optimization_switches(self) -> list[Switch]:
        """What the anomaly monitor may switch off while running, most invasive first."""
        switches, step = [], self.train_step
        if step.graphs is not None:
            graphs = step.graphs

            def graphs_on() -> None:
                graphs.reset()
                step.graphs = graphs

            switches.append(Switch("CUDA graphs (--cuda_graph)", "cuda_graph", lambda: setattr(step, "graphs", None),
                                   graphs_on))
        if step.step_model is not self.wrapped:
            compiled = step.step_model
            switches.append(Switch("torch.compile (--compile)", "compile",
                                   lambda: setattr(step, "step_model", self.wrapped),
                                   lambda: setattr(step, "step_model", compiled)))
        if self.plan.ce_impl != "naive":
            impl = self.model.ce_impl
            switches.append(Switch("the fused chunked loss (--chunked_ce)", "chunked_ce",
                                   lambda: setattr(self.model, "ce_impl", "naive"),
                                   lambda: setattr(self.model, "ce_impl", impl)))
        return switches

    def autocast(self):
        return self.train_step.autocast()

    def _restore(self, ckpt) -> None:
        # On the CPU: RNG states must stay there; the optimizer moves its state to the parameters' device.
        same_world = ckpt.world_size == self.dist.world_size
        try:
            if ckpt.layout == "dcp":
                load_dcp(ckpt, self.model, self.optimizer, distributed=self.dist.enabled)
                tensors = ckpt.load_trainer("cpu", RANK_FILE.format(self.dist.rank)) if same_world else {}
            else:
                tensors = ckpt.load_trainer(map_location="cpu")
                if self.dist.enabled and self.dist.parallel == "fsdp":
                    load_single_into_sharded(ckpt, self.model, self.optimizer, tensors)
                else:
                    ckpt.load_model(self.model)
                    load_optimizer(self.model, self.optimizer, tensors["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise ValueError(f"checkpoint {ckpt.path}: its model or optimizer state does not fit this run "
                             f"({self.cfg.optimizer}): {err}") from None
        st = ckpt.state
        self.step = ckpt.step
        self.tokens_seen = int(st.get("tokens_seen", 0))
        self.train_s, self.startup_s = float(st.get("train_s", 0.0)), float(st.get("startup_s", 0.0))
        self.curriculum.load_state_dict(st["curriculum"], self.device)
        if self.swa is not None:
            self.swa.load(ckpt.path, st.get("swa"))
        if self.adaptive is not None and st.get("adaptive_lr"):
            self.adaptive.load_state_dict(st["adaptive_lr"])
        if st.get("rollback"):
            self.rollback.load_state_dict(st["rollback"])
        if self.batch_filter is not None and st.get("batch_filter"):
            self.batch_filter.load_state_dict(st["batch_filter"])
        if self.seq_schedule is not None:  # the loader of the stage the checkpoint was in
            self._replace_loader(self.seq_schedule.stage_of_length(st["loader"]["seq_len"]))
        self.loader.load_state_dict(st["loader"])
        self._saved_window = st.get("log_window")
        if same_world:
            restore_rng(st["rng"], {k: v for k, v in tensors.items() if k in ("torch", "cuda")})
        else:
            self.log.warning(f"{ckpt.path} was written by {ckpt.world_size} process(es), this run has "
                             f"{self.dist.world_size}: model and optimizer restored; the data continues at the same "
                             f"row of the epoch but batches are now shared out among {self.dist.world_size}, and the "
                             "random number streams restart from the seed, so the run is not bit-identical to an "
                             "uninterrupted one")
        self.log.info(f"resumed from {ckpt.path} at step {self.step}")

    # ------------------------------------------------------------------ checkpoints
    def save(self, reason: str = "") -> bool:
        """Write a checkpoint unless anything since the last check (loss, gradients, weights) is non-finite."""
        if not self._healthy(check_params=True):
            self.log.warning(f"not saving step {self.step}: the loss, gradients or weights are not finite")
            return False
        self._bank_train_time()
        rng_json, rng_tensors = capture_rng()
        state = {
            "model_size": self.s.cfg.model_size,
            "tokens_seen": self.tokens_seen,
            "train_s": self.train_s,
            "startup_s": self.startup_s,
            "curriculum": self.curriculum.state_dict(),
            "adaptive_lr": self.adaptive.state_dict() if self.adaptive is not None else None,
            "rollback": self.rollback.state_dict(),
            "safe_optimizations": self.safe_opts.state_dict(),
            "loader": self.loader.state_dict(),
            "batch_filter": self.batch_filter.state_dict() if self.batch_filter is not None else None,
            "swa": self.swa.state_dict() if self.swa is not None else None,
            "rng": rng_json,
            "log_window": self._window_state(),
            "train_config": self.cfg.to_dict(),
            "model_config": self.s.model_cfg.to_dict(),
            "data": self.s.data.to_dict(),
        }
        try:
            if self.saver is not None:
                state["loader_ranks"] = gather_objects(self.loader.state_dict(), self.dist)
                path = self.saver.save(self.step, self.model, self.optimizer, rng_tensors, state)
            else:
                # Optimizer state keyed by parameter name, so any number of ranks can load it.
                optimizer = portable_optimizer_state(get_optimizer_state_dict(self.model, self.optimizer))
                trainer_tensors = {"optimizer": optimizer, **rng_tensors}
                path = self.s.manager.save(self.step, self.model, trainer_tensors, state,
                                           self.swa.save if self.swa is not None else None)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise disk_full_error(self.s.manager.dir, err, self._state_bytes()) from None
        self.log.info(f"saved checkpoint {path}" + (f" ({reason})" if reason else ""))
        return True

    def _state_bytes(self) -> int:
        """This process's weights and optimizer state: about what one checkpoint takes on disk."""
        tensors = [*self.params, *(v for st in self.optimizer.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _healthy(self, check_params: bool = False) -> bool:
        """Host sync (log, eval and save points only): every loss and grad norm since the last
        rollback finite, and with ``check_params`` every weight too (on every rank)."""
        ok = self.finite.read() and (not check_params or parameters_finite(self.params))
        return not any_rank(not ok, self.dist)

    def _last_good_checkpoint(self):
        """The newest checkpoint that verifies (rank 0 decides), or None."""
        path = None
        if self.dist.is_main:
            try:
                ckpt = self.s.manager.latest_good()
            except CheckpointError:
                ckpt = None
            path = None if ckpt is None else str(ckpt.path)
        path = broadcast_object(path, self.dist)
        return None if path is None else verify(path)

    def _roll_back_to(self, good) -> None:
        """Continue from checkpoint ``good``, keeping the rollback count and switched-off optimizations."""
        policy = self.rollback.state_dict()
        self._restore(good)
        if self._train_t0 is not None:  # training time restarts from the checkpoint's count
            self._train_t0 = time.perf_counter()
        self.rollback.load_state_dict(policy)  # the checkpoint's own (older) count would allow endless retries
        self.finite.reset()
        self._iter = None
        if self.train_step.graphs is not None:
            self.train_step.graphs.reset()
        self._window = self._new_window()
        self.safe_opts.restarted_at(self.step)

    def _continue_after_switch(self) -> None:
        """An optimization was switched off: go on from the last good checkpoint (or from here without one)."""
        good = self._last_good_checkpoint()
        if good is not None:
            self._roll_back_to(good)
        else:
            self._window = self._new_window()

    def _handle_divergence(self) -> bool:
        """Roll back to the last good checkpoint with a lower LR (True), or explain and stop (False)."""
        cfg, w = self.cfg, self._window
        n = max(1, w["steps"])
        values = (w["sums"] / n).tolist()
        where = (f"training diverged by step {self.step} (last {w['steps']} steps: mean loss {values[0]:.4g}, grad "
                 f"norm {values[5]:.4g})")
        if self.saver is not None:
            self.saver.finish()  # a pending save was checked before it started: it is good
        good = self._last_good_checkpoint()
        record = {"kind": "divergence", "step": self.step, "loss": values[0], "grad_norm": values[5],
                  "rollbacks": self.rollback.rollbacks}
        if good is None:
            self.metrics.write({**record, "action": "stop"})
            self.log.warning(f"{where}; no checkpoint was saved before it, so there is nothing to roll back to: "
                           f"start again with a lower --lr (this run used {cfg.lr:g})")
            return False
        if not self.rollback.may_roll_back():
            self.metrics.write({**record, "action": "stop", "good_checkpoint": str(good.path)})
            lower = cfg.lr * self.rollback.lr_scale * cfg.rollback_lr_factor
            self.log.warning(f"{where} after {self.rollback.rollbacks} rollback(s); nothing from the diverged state "
                           f"was saved. The last good checkpoint is {good.path} (step {good.step}): resume from it "
                           f"with a lower learning rate: hydra-lm train --out {self.s.run_dir} --lr {lower:.3g}")
            return False
        self.safe_opts.note_divergence(self.step)
        self._roll_back_to(good)
        self.rollback.record_rollback()
        self.metrics.write({**record, "action": "rollback", "to_step": good.step, "checkpoint": str(good.path),
                            "lr_scale": self.rollback.lr_scale})
        self.log.warning(f"{where}: rolled back to {good.path} (step {good.step}) with the learning rate "
                         f"x{self.rollback.lr_scale:g} (rollback {self.rollback.rollbacks} of {cfg.max_rollbacks})")
        return True

    # ------------------------------------------------------------------ data
    def _stage_loader(self, stage: int):
        cfg = self.cfg
        rows, length = (self.seq_schedule.shape(stage, cfg.batch_size, cfg.seq_len) if self.seq_schedule is not None
                        else (cfg.batch_size, cfg.seq_len))
        return train_loader(self.s.data, rows, length, cfg.seed, cfg.experimental_prefetch_threads,
                            cfg.prefetch_buffer_size, self.dist.rank, self.dist.world_size)

    def _replace_loader(self, stage: int) -> None:
        if stage != self.seq_stage:
            self.loader.close()
            self.loader, self.seq_stage, self._iter = self._stage_loader(stage), stage, None

    def _follow_seq_len_schedule(self, clock: int) -> None:
        """Switch to the row length of the schedule's stage at ``clock``, continuing the epoch."""
        stage = self.seq_schedule.stage_at(clock, self.cfg.max_steps)
        if stage == self.seq_stage:
            return
        old = self.loader.state_dict()
        self._replace_loader(stage)
        rows, length = self.loader.batch_size, self.loader.seq_len
        self.loader.load_state_dict(carry_over(old, rows * self.dist.world_size, length))
        if self.train_step.graphs is not None:  # new shapes: capture again
            self.train_step.graphs.reset()
        recompile = " (a compiled model recompiles once for it)" if self.cfg.compile else ""
        self.log.info(f"step {self.step}: sequence length {old['seq_len']} -> {length}, {rows} rows per "
                      f"micro-batch{recompile}")

    def _next_batch(self) -> dict[str, torch.Tensor]:
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            batch = next(self._iter)
        except StopIteration:  # a finite loader: start its next epoch
            self._iter = iter(self.loader)
            batch = next(self._iter)
        return batch

    # ------------------------------------------------------------------ the loop
    def _install_signals(self) -> dict:
        def handler(signum, frame):
            now = time.monotonic()
            if self._signal_at is not None:
                # A second Ctrl-C stops at once (checkpoints on disk are intact). One right after the
                # first is the same request: torchrun forwards the terminal's signal to its workers.
                if now - self._signal_at > REPEATED_SIGNAL_S:
                    raise KeyboardInterrupt
                return
            self._signal_at = now
            self._stop = signal.Signals(signum).name
            self.log.info(f"{self._stop} received: saving a checkpoint after the step in progress")

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return old

    def run(self) -> int:
        cfg = self.cfg
        old = self._install_signals()
        metrics = MetricsWriter(self.s.run_dir, self.log, cfg.tensorboard, cfg.wandb, cfg.wandb_project,
                                config=self.cfg.to_dict(), resume_step=self.step if self.s.resume_from else -1) \
            if self.dist.is_main else NullMetrics()
        self.metrics = metrics
        try:
            return self._loop()
        finally:
            metrics.close()
            self.loader.close()
            if self._valset is not None:
                self._valset.loader.close()
            for sig, h in old.items():
                signal.signal(sig, h)

    def _loop(self) -> int:
        cfg, s = self.cfg, self.s
        end = cfg.stop_at_step or cfg.max_steps
        self.log.info(f"model {cfg.model_size} ({s.model_cfg.arch}): {self.model.num_parameters() / 1e6:.2f}M "
                      f"parameters | data {s.data.path} (vocab {s.data.vocab_size}) | batch {cfg.batch_size} x "
                      f"{cfg.seq_len} x accum {cfg.grad_accum} = {self.tokens_per_step:,} tokens/step | "
                      f"{cfg.optimizer}, lr {cfg.lr:g} -> {cfg.min_lr:g} ({cfg.schedule}, warm-up "
                      f"{cfg.warmup_steps}) | {self.curriculum.plan.describe()}")
        self.log.info("active: " + ", ".join(self._active_features()))
        now = self._clock()
        if now >= end:
            self.log.info(f"nothing to do: the run is at step {self.step}, target {end}")
            return 0
        PretestHook(self).before_training()
        if self.step == 0 and cfg.eval_at_start:
            self._eval()
        self._window = self._new_window()
        stopping = False
        self._train_t0 = time.perf_counter()
        compiling = self.plan.compile is not None or self.plan.cuda_graph
        while now < end and not stopping:  # `now` is read once per step: every decision below agrees on it
            before = now
            self._train_step(self._window)
            if compiling:  # compiling (first step) or capturing CUDA graphs (first steps): not training time
                self._bank_train_time(startup=True)
                compiling = self.train_step.graphs is not None and not self.train_step.graphs.captured
            now = self._clock()
            stopping = self._stop_agreed()
            regular = self.step % cfg.log_every == 0
            log_due = regular or now >= end or stopping
            eval_due = cfg.eval_every and now // cfg.eval_every > before // cfg.eval_every or now == cfg.max_steps
            save_due = now // cfg.save_every > before // cfg.save_every or now >= end
            if (log_due or eval_due or save_due) and not self._healthy(check_params=save_due):
                if not stopping and self._handle_divergence():
                    now = self._clock()
                    continue
                return 1
            if log_due:
                if self._log(self._window, regular):  # an optimization was switched off
                    self._continue_after_switch()
                    now = self._clock()
                    continue
                if regular:
                    self._window = self._new_window()
            if eval_due:
                self._eval()
                self._restart_timer()
                stopping = self._stop_agreed()
            if stopping:
                break
            if save_due:
                self.save("stop_at_step" if cfg.stop_at_step and now >= end else "")
                self._restart_timer()
        if stopping:
            self.save(f"interrupted by {self._stop}")
        if self.saver is not None:
            self.saver.finish()
        if stopping:
            self.log.info(f"stopped at step {self.step}; resume with: hydra-lm train --out {s.run_dir}")
            return EXIT_INTERRUPTED
        return 0

    def _stop_agreed(self) -> bool:
        """Whether to stop now: a signal on any rank stops every rank at the same step."""
        if any_rank(self._stop is not None, self.dist):
            self._stop = self._stop or "a signal on another rank"
            return True
        return False

    def _active_features(self) -> list[str]:
        cfg, cuda = self.cfg, self.device.type == "cuda"
        feats = [f"{self.dist.parallel.upper()} on {self.dist.world_size} processes"] if self.dist.enabled else []
        feats += ["bf16 autocast, TF32" if cuda else "fp32",
                 f"{'fused ' if cuda and cfg.optimizer == 'adamw' else ''}{cfg.optimizer}",
                 f"grad clip {cfg.grad_clip:g}" if cfg.grad_clip > 0 else "no grad clip"]
        feats += [part for part in self.plan.describe() if part != "eager"]
        feats += [name for name, on in (("gradient checkpointing", cfg.gradient_checkpointing),
                                        ("document masking", self.use_doc_ids), ("adaptive LR", cfg.adaptive_lr),
                                        (f"batch filter (k={cfg.batch_filter_k:g})", cfg.batch_filter)) if on]
        if cfg.experimental_prefetch_threads:
            feats.append(f"prefetch {cfg.experimental_prefetch_threads} threads x {cfg.prefetch_buffer_size} batches")
        return feats

    def _restart_timer(self) -> None:
        """Throughput counts training steps only, not evaluation or checkpoint time."""
        self._bank_train_time()
        self._window["t0"] = self._train_t0 = time.perf_counter()
        self._window["timed_steps"] = 0

    def _bank_train_time(self, startup: bool = False) -> None:
        """Stop the training-time clock (before eval / a checkpoint) and add what it measured to train_s."""
        if self._train_t0 is None:
            return
        if self.device.type == "cuda":  # the steps queued so far belong to this interval
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if startup:
            self.startup_s += now - self._train_t0
        else:
            self.train_s += now - self._train_t0
        self._train_t0 = now if startup else None

    def _train_seconds(self) -> float:
        return self.train_s + (time.perf_counter() - self._train_t0 if self._train_t0 is not None else 0.0)

    def _clock(self) -> int:
        """Where the run is on its schedule, in steps of max_steps: the step itself, or with a time
        budget the fraction of it spent (so runs of any speed share one schedule family)."""
        budget = self.cfg.time_budget_s
        if not budget:
            return self.step
        return int(self.cfg.max_steps * min(1.0, self._train_seconds() / budget))

    def _window_state(self) -> dict | None:
        w = self._window
        if w is None or w["steps"] == 0:
            return None
        return {"sums": w["sums"].tolist(), "steps": w["steps"]}

    def _new_window(self) -> dict[str, Any]:
        window = {"t0": time.perf_counter(), "steps": 0, "sums": torch.zeros(6, device=self.device), "stats": None,
                  "timed_steps": 0}
        if self._saved_window is not None:  # a resumed run continues the interrupted log window
            window["sums"] = torch.tensor(self._saved_window["sums"], device=self.device)
            window["steps"] = int(self._saved_window["steps"])
            self._saved_window = None
        return window

    def _train_step(self, window) -> None:
        cfg = self.cfg
        clock = self._clock()
        if self.seq_schedule is not None:
            self._follow_seq_len_schedule(clock)
        msg = self.curriculum.apply(clock, self.model)
        if msg:
            self.log.info(msg)
            if self.train_step.graphs is not None:  # the routing's control flow changed: capture it again
                self.train_step.graphs.reset()
        lr = lr_at(clock, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                   schedule=cfg.schedule, wsd_decay_pct=cfg.wsd_decay_pct)
        if self.adaptive is not None:
            lr *= self.adaptive.multiplier(self.step)
        lr *= self.rollback.lr_scale
        set_lr(self.optimizer, lr)
        if self.step < cfg.moe_warmup_steps:
            hold_routers(self.optimizer)
        hessian_due = getattr(self.optimizer, "hessian_due", None)  # Sophia: this step's backward keeps its graph
        self.train_step.create_graph = hessian_due is not None and hessian_due()
        parts = torch.zeros(5, device=self.device)  # loss, ce, aux, ponder, moe (summed over micro-batches)
        stats = None
        for i in range(cfg.grad_accum):
            batch = self._next_batch()
            inputs = {"input_ids": batch["input_ids"], "targets": batch["targets"]}
            if self.use_doc_ids:
                inputs["doc_ids"] = batch["doc_ids"]
            with gradient_sync(self.wrapped, self.dist, sync=i == cfg.grad_accum - 1):
                micro_parts, micro_stats = self.train_step.micro(inputs)
            parts += micro_parts
            stats = micro_stats.clone()  # CUDA graphs reuse output memory
        if self.batch_filter is not None:  # every rank decides on the same (global mean) loss
            keep = self.batch_filter.keep(mean_across_ranks(parts[0] / cfg.grad_accum, self.dist))
            self.batch_filter.mask(self.params, keep)
        grad_norm = full_tensor(self.train_step.update())
        moe_load = self.train_step.moe_load
        if moe_load is not None:  # the last micro-batch's expert shares, summed over the window
            window["moe_load"] = window.get("moe_load", 0) + moe_load
            window["moe_steps"] = window.get("moe_steps", 0) + 1
        graphs = self.train_step.graphs
        if graphs is not None and graphs.captured and not self._graphs_announced:
            self.log.info(f"step {self.step + 1}: training step captured as CUDA graphs, replayed from now on")
        self._graphs_announced = graphs is not None and graphs.captured
        parts = parts / cfg.grad_accum
        if self.dist.enabled:  # one small all-reduce: every rank logs and decides on the global mean
            flat = mean_across_ranks(torch.cat([parts, stats.flatten()]), self.dist)
            parts, stats = flat[:5], flat[5:].reshape(stats.shape)
        self.finite.fold(parts[0], grad_norm)
        self.curriculum.observe(parts[1])
        window["sums"] += torch.cat([parts, grad_norm.detach().float().reshape(1)])
        window["stats"] = stats
        window["steps"] += 1
        window["timed_steps"] += 1
        window["lr"] = lr
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        if self.swa is not None:
            self.swa.update(self.model, self._clock())

    def _log(self, window, regular: bool = True) -> bool:
        """Write a metrics record (of a window known to be finite). Only ``regular`` records (every
        log_every steps) feed the loss gate, the adaptive LR and the anomaly monitor, so interrupting
        a run cannot change their decisions. True when the monitor switched an optimization off."""
        n = max(1, window["steps"])
        values = (window["sums"] / n).tolist()  # the one host sync per log interval
        elapsed = time.perf_counter() - window["t0"]
        loss, ce, aux, ponder, moe, gnorm = values
        tps = window["timed_steps"] * self.tokens_per_step / max(elapsed, 1e-9)
        record: dict[str, Any] = {
            "kind": "train", "step": self.step, "loss": loss, "ce_loss": ce, "aux_loss": aux, "ponder_loss": ponder,
            "moe_loss": moe, "lr": window.get("lr", 0.0), "grad_norm": gnorm, "tokens_per_s": tps,
            "tokens": self.tokens_seen, "memory_mb": memory_mb(self.device), "train_s": self._train_seconds(),
            "startup_s": self.startup_s,
            "mod_active": self.curriculum.mod_active, "mor_active": self.curriculum.mor_active,
        }
        if window["stats"] is not None and window["stats"].numel():
            fracs = window["stats"][:, 0].tolist()
            record["routing_exec_frac"] = dict(zip(self.model.router_names(), fracs))
            record["exec_frac_mean"] = sum(fracs) / len(fracs)
        if "moe_load" in window:
            names = [f"after_block{i}" for i in self.model.moe_blocks]
            record["moe_expert_load"], warnings = expert_load_record(window["moe_load"] / window["moe_steps"], names)
            for expert, warning in warnings.items():
                if expert not in self._starving:  # once per expert and run
                    self._starving.add(expert)
                    self.log.warning(f"step {self.step}: {warning}")
        if self.batch_filter is not None:
            record["skipped_batches"] = int(self.batch_filter.skipped)
        if self.peak_flops:
            record["mfu"] = self._flops_per_token() * tps / (self.peak_flops * self.dist.world_size)
        self.metrics.write(record)
        self.log.info(progress_line(record, self.cfg.max_steps))
        if not regular:
            return False
        self.curriculum.check_gate(self._clock())
        if self.adaptive is not None and self.adaptive.observe(self.step, loss):
            self.log.info(f"adaptive LR: loss spike at step {self.step} ({loss:.3f}); LR "
                          f"x{self.cfg.adaptive_lr_factor:g} for {self.cfg.adaptive_lr_cooldown} steps")
        tps = broadcast_object(tps, self.dist)  # rank 0's throughput: every rank takes the same decision
        return self.safe_opts.observe(self.step, loss, gnorm, tps) is not None

    def _flops_per_token(self) -> float:
        try:
            from ..model.accounting import executed_flops_per_token
        except ImportError:
            return 0.0
        mc = self.s.model_cfg
        live = mc.replace(mod_enabled=mc.mod_enabled and self.curriculum.mod_active,
                          mor_enabled=mc.mor_enabled and self.curriculum.mor_active)
        return executed_flops_per_token(live, self.cfg.seq_len, training=True)

    def _eval(self) -> dict | None:
        if not self.s.data.token_counts.get("val"):
            if not getattr(self, "_warned_no_val", False):
                self.log.warning(f"{self.s.data.path} has no validation split: skipping evaluation")
                self._warned_no_val = True
            return None
        self._bank_train_time()
        t0 = time.perf_counter()
        if self._valset is None:
            self._valset = ValSet(self.s.data, self.cfg.batch_size, self.cfg.seq_len, self.dist.rank,
                                  self.dist.world_size)
        result = evaluate(self.model, self._valset, self.device, self.cfg.eval_batches, self.autocast,
                          self.use_doc_ids, self._stop_agreed, lambda t: sum_across_ranks(t, self.dist))
        if result is None:
            return None
        record = {"kind": "eval", "step": self.step, **result}
        swa = self._eval_swa() if self._clock() >= self.cfg.max_steps else None
        if swa is not None:
            record.update({f"swa_{k}": v for k, v in swa.items() if k.startswith(("val_loss", "val_ppl", "val_gap"))})
        record.update(eval_s=time.perf_counter() - t0, train_s=self.train_s)
        self.metrics.write(record)
        self.log.info(f"eval step {self.step}: {format_eval(result)}")
        if swa is not None:
            self.log.info(f"eval step {self.step} of the weight average ({self.swa.steps_averaged} steps): "
                          f"{format_eval(swa)}")
        for warning in routing_warnings(result):
            self.log.warning(f"eval step {self.step}: {warning}")
        return result


    def _eval_swa(self) -> dict | None:
        """The end-of-run evaluation of the weight average, with the curriculum's routing switches."""
        if self.swa is None or self.swa.steps_averaged == 0:
            return None
        self.swa.module.set_curriculum(self.curriculum.mod_active, self.curriculum.mor_active, self.curriculum.mor_ramp)
        return evaluate(self.swa.module, self._valset, self.device, self.cfg.eval_batches, self.autocast,
                        self.use_doc_ids, self._stop_agreed)


def train(setup: RunSetup) -> int:
    """Run a configured training job; returns the process exit status (130 when interrupted)."""
    try:
        trainer = Trainer(setup)
        if setup.dist.is_main:
            write_run_files(setup, sys.argv)
        return trainer.run()
    finally:
        setup.close()
