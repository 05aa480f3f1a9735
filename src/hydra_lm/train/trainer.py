"""The training loop: accumulation, clipping, schedule, curriculum, eval, checkpoints, exact resume.

Inside a step nothing reads a device value back to the host: losses, grad norms and the
curriculum's loss EMA stay on the device and are read together every ``log_every`` steps.
Under torchrun the same loop runs on every rank (see ``distributed``): losses, routing statistics
and the MoE expert load are averaged over ranks each step, so every rank takes the same decisions.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np
import torch

from ..model.accounting import flops_per_token_in_phase
from ..model.factory import create_model
from ..model.routing import THRESHOLD_BUFFERS

from .batch_filter import BatchFilter
from .compile_policy import apply_speed_plan, enable_tf32, resolve_speed_options, units_compile_switch
from .clock import TrainClock, due_after_step
from .curriculum import Curriculum, CurriculumPlan
from .data_io import ValSet, train_loader
from .evaluate import evaluate, format_eval, routing_warnings
from .distributed import (any_rank, broadcast_object, full_tensor, gradient_sync, mean_across_ranks, sum_across_ranks,
                          wrap_model)
from .divergence import FiniteFlag, RollbackPolicy, parameters_finite
from .log_window import LogWindow
from .metrics import LOG_FILE, MetricsWriter, NullMetrics, measure_peak_flops, memory_mb, progress_line
from .optim import build_optimizer, check_optimizer_features, set_lr
from .parallel_compile import start_helpers
from .pretest import PretestHook
from .run import RunSetup, write_run_files
from .safe_optimizations import AnomalyMonitor, SafeOptimizations, Switch, anomaly_window
from .schedule import AdaptiveLR, lr_at
from .swa import WeightAverage
from .model_features import apply_model_features
from .moe_training import hold_routers
from .resume import continue_after_switch, finish_save, handle_divergence, restore, save_checkpoint
from .seq_len_schedule import SeqLenSchedule, carry_over
from .sharded_checkpoint import ShardedSaver
from .stall_dump import StallDump
from .step import TrainStep
from .stop_signal import EXIT_INTERRUPTED, StopRequest


# How far apart the ranks' seeds lie (a prime): rank r of one --seed draws no stream of rank 0 of a neighbouring one.
RANK_SEED_STRIDE = 1_000_000_007


class Trainer:
    def __init__(self, setup: RunSetup):
        self.s = setup
        cfg, self.cfg, self.log, self.device, self.dist = setup.cfg, setup.cfg, setup.log, setup.device, setup.dist
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        enable_tf32(self.device)
        self.plan = resolve_speed_options(cfg, self.device, self.dist.enabled, moe=setup.model_cfg.moe)
        if self.plan.parallel_compile and setup.model_cfg.arch == "hydra":
            start_helpers()  # their imports overlap the set-up below
        self.model = create_model(setup.model_cfg).to(self.device)
        self._check_features()
        mc = setup.model_cfg
        routable = (mc.arch == "hydra" and mc.mod_enabled, mc.arch == "hydra" and mc.mor_enabled and mc.recursions > 1)
        # self.model stays the HydraModel (sharded in place by FSDP2); self.wrapped is what a step calls.
        self.wrapped = wrap_model(self.model, self.dist, self.device, find_unused=any(routable) or mc.moe)
        if self.dist.enabled:  # the ranks initialised alike (FSDP2 shards each one's copy); now each its own noise
            torch.manual_seed(cfg.seed + RANK_SEED_STRIDE * self.dist.rank)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._threshold_buffers = [buffer for name, buffer in self.model.named_buffers()
                                   if name.rsplit(".", 1)[-1] in THRESHOLD_BUFFERS]
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
        self.batches = None  # the iterator over self.loader
        self._peeked: dict[str, torch.Tensor] | None = None  # a batch taken ahead: the next one
        self.saver = ShardedSaver(setup.manager, self.dist, cfg.async_checkpoint, self.log.info) \
            if self.dist.enabled else None
        self.step = 0
        self.tokens_seen = 0
        self._flops: dict[int, dict] = {}  # training FLOPs/token by seq_len, then routing state: MFU's numerator
        self.clock = TrainClock(self.device, cfg.max_steps, cfg.time_budget_s)
        self.finite = FiniteFlag(self.device)
        self.rollback = RollbackPolicy(cfg.max_rollbacks, cfg.rollback_lr_factor)
        self.saved_window: dict | None = None  # a resumed checkpoint's log window, continued by the first
        self.window: LogWindow | None = None
        if setup.resume_from is not None:
            restore(self, setup.resume_from)
        # After any restore: a captured step needs a capturable optimizer (learning rate on the device).
        self.train_step = TrainStep(self.model, apply_speed_plan(self.model, self.wrapped, self.plan), self.optimizer,
                                    self.device, self.plan, cfg.grad_accum, cfg.grad_clip, cfg.cuda_graphs_warmup)
        self.train_step.report = self.log.info
        self._graphs_announced = False
        self.use_doc_ids = cfg.document_masking
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world_size
        self.peak_flops = measure_peak_flops(self.device) if self.device.type == "cuda" else None
        if self.device.type == "cuda":  # this run's peak: not the FLOP probe's matrices nor an earlier run's
            torch.cuda.reset_peak_memory_stats(self.device)
        self.stop_request = StopRequest(self.log)
        self._valset: ValSet | None = None
        monitor = AnomalyMonitor(anomaly_window(cfg.experimental_safety_window, cfg.log_every),
                                 cfg.experimental_loss_spike_threshold, cfg.experimental_throughput_drop_threshold)
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
        self.starving: set[str] = set()
        if cfg.mor_ramp and self.s.model_cfg.mor_routing != "expert":
            raise ValueError("--mor_ramp sets the capacities of expert-choice MoR; with --model.mor_routing token "
                             "each token picks its own depth: drop --mor_ramp")
        if cfg.swa and self.dist.enabled:
            raise ValueError("--swa works in one process only (the average is an unsharded copy of the model); "
                             "drop --swa under torchrun")
        for note in apply_model_features(self.model, cfg, self.device):
            self.log.info(note)

    def _optimization_switches(self) -> list[Switch]:
        """What the anomaly monitor may switch off while running, most invasive first."""
        switches, step = [], self.train_step
        if step.graphs is not None:
            graphs = step.graphs

            def graphs_on() -> None:
                graphs.reset()
                step.graphs = graphs

            switches.append(Switch("CUDA graphs (--cuda_graph)", "cuda_graph", step.drop_graphs, graphs_on))
        if step.step_model is not self.wrapped:  # the whole model compiled (under torchrun)
            compiled = step.step_model
            switches.append(Switch("torch.compile (--compile)", "compile",
                                   lambda: setattr(step, "step_model", self.wrapped),
                                   lambda: setattr(step, "step_model", compiled)))
        elif self.plan.compile == "units":  # compiled in place (one process)
            # Not pretested: the pretest would compile a copy of the blocks, doubling the cold start.
            switches.append(Switch("torch.compile (--compile)", "compile", *units_compile_switch(self.model),
                                   pretested=False))
        if self.plan.ce_impl != "naive":
            impl = self.model.ce_impl
            switches.append(Switch("the fused chunked loss (--chunked_ce)", "chunked_ce",
                                   lambda: setattr(self.model, "ce_impl", "naive"),
                                   lambda: setattr(self.model, "ce_impl", impl)))
        return switches

    def autocast(self):
        return self.train_step.autocast()

    # ------------------------------------------------------------------ checkpoints (resume.py)
    def save(self, reason: str = "") -> bool:
        """Write a checkpoint unless anything since the last check (loss, gradients, weights) is non-finite."""
        return save_checkpoint(self, reason)

    def _resume_hint(self) -> str:
        if self.s.manager.list():
            return f"resume with: hydra-lm train --out {self.s.run_dir}"
        # --out alone would not resume a run with no checkpoint: it would start a new one from the defaults
        return "no checkpoint was saved, so there is nothing to resume: run the same command again to start over"

    def healthy(self, check_params: bool = False) -> bool:
        """Host sync (log, eval and save points only): every loss and grad norm since the last
        rollback finite, and with ``check_params`` every weight too (on every rank)."""
        ok = self.finite.read() and (not check_params or parameters_finite(self.params))
        return not any_rank(not ok, self.dist)

    # ------------------------------------------------------------------ data
    def _stage_loader(self, stage: int):
        cfg = self.cfg
        rows, length = (self.seq_schedule.shape(stage, cfg.batch_size, cfg.seq_len) if self.seq_schedule is not None
                        else (cfg.batch_size, cfg.seq_len))
        return train_loader(self.s.data, rows, length, cfg.seed, cfg.experimental_prefetch_threads,
                            cfg.prefetch_buffer_size, self.dist.rank, self.dist.world_size)

    def replace_loader(self, stage: int) -> None:
        if stage != self.seq_stage:
            self.loader.close()
            self.loader, self.seq_stage, self.batches = self._stage_loader(stage), stage, None
            self._peeked = None  # taken ahead from the old loader: its row length is not the stage's

    def _follow_seq_len_schedule(self, clock: int) -> bool:
        """Switch to the row length of the schedule's stage at ``clock``, continuing the epoch (True)."""
        stage = self.seq_schedule.stage_at(clock, self.cfg.max_steps)
        if stage == self.seq_stage:
            return False
        old = self.loader.state_dict()
        self.replace_loader(stage)
        rows, length = self.loader.batch_size, self.loader.seq_len
        self.loader.load_state_dict(carry_over(old, rows * self.dist.world_size, length))
        if self.train_step.graphs is not None:  # new shapes: capture again
            self.train_step.graphs.reset()
        recompile = " (a compiled model recompiles once for it)" if self.plan.compile else ""
        self.log.info(f"step {self.step}: sequence length {old['seq_len']} -> {length}, {rows} rows per "
                      f"micro-batch{recompile}")
        return True

    def _next_batch(self) -> dict[str, torch.Tensor]:
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return batch
        if self.batches is None:
            self.batches = iter(self.loader)
        return next(self.batches)  # the training loader loops over epochs itself

    def _step_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": batch["input_ids"], "targets": batch["targets"]}
        if self.use_doc_ids:
            inputs["doc_ids"] = batch["doc_ids"]
        return inputs

    def _prepare_first_step(self) -> None:
        """Start compiling the first step's graphs in parallel processes (``TrainStep.prepare``), on its own batch,
        taken ahead, so that the pretests and the first evaluation (its compile) run beside them; their memory is
        counted as one helper's. Only on a fresh run's step 0: no checkpoint is written before that step, so the
        batch taken ahead cannot go missing from one."""
        assert self.step == 0
        self._peeked = self._next_batch()
        self.train_step.prepare(self._step_inputs(self._peeked))

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        cfg = self.cfg
        self.stop_request.install()
        metrics = MetricsWriter(self.s.run_dir, self.log, cfg.tensorboard, cfg.wandb, cfg.wandb_project,
                                config=self.cfg.to_dict(), resume_step=self.step if self.s.resume_from else -1) \
            if self.dist.is_main else NullMetrics()
        self.metrics = metrics
        self.stall = StallDump(self.s.run_dir / LOG_FILE if self.dist.is_main else None, cfg.stall_dump_s)
        try:
            return self._loop()
        except Exception as error:
            if not self.stop_request.step_failed(error):
                raise
            self.log.info(self._resume_hint())
            return EXIT_INTERRUPTED
        except KeyboardInterrupt:  # a second signal, in the middle of a save: the checkpoints before it are intact
            self.log.warning("interrupted again before the run could stop cleanly; the last complete checkpoint is "
                             "intact (an unfinished one is cleaned up at the next start): " + self._resume_hint())
            raise
        finally:
            self.train_step.stop_warming()
            self.stall.close()
            metrics.close()
            self.loader.close()
            if self._valset is not None:
                self._valset.loader.close()
            self.stop_request.uninstall()

    def _note_repeats(self, end: int) -> None:
        """How often the run reads its training split: a step larger than the split repeats data within itself."""
        split, per_step = self.s.data.token_counts.get("train", 0), self.tokens_per_step
        if not split:
            return
        if per_step > split:
            self.log.warning(f"one step reads {per_step:,} tokens, {per_step / split:.1f}x the training split's "
                             f"{split:,}: each step repeats data; lower --batch_size or --grad_accum, or prepare more "
                             "data")
        elif not self.cfg.time_budget_s and end * per_step > 2 * split:  # a time budget's steps are not known yet
            self.log.info(f"the run reads its training split about {end * per_step / split:.1f} times")

    def _loop(self) -> int:
        cfg, s = self.cfg, self.s
        end = cfg.stop_at_step or cfg.max_steps
        self.log.info(f"model {cfg.model_size} ({s.model_cfg.arch}): {self.model.num_parameters() / 1e6:.2f}M "
                      f"parameters | data {s.data.path} (vocab {s.data.vocab_size}) | batch {cfg.batch_size} x "
                      f"{cfg.seq_len} x accum {cfg.grad_accum} = {self.tokens_per_step:,} tokens/step | "
                      f"{cfg.optimizer}, lr {cfg.lr:g} -> {cfg.min_lr:g} ({cfg.schedule}, warm-up "
                      f"{cfg.warmup_steps}) | {self.curriculum.plan.describe()}")
        self.log.info("active: " + ", ".join(self._active_features()))
        self._note_repeats(end)
        now = self.clock.position(self.step)
        if now >= end:
            self.log.info(f"nothing to do: the run is at step {self.step}, target {end}")
            return 0
        if self.step == 0:
            # The curriculum's routing at step 0 (e.g. --mod_off: every block dense), as the first step will train.
            self.curriculum.apply(self.clock.position(self.step), self.model)
            if self.plan.parallel_compile:
                self._prepare_first_step()
        PretestHook(self).before_training()
        if self.step == 0 and cfg.eval_at_start:
            self._eval()
        if self._stop_agreed():  # a signal during the pretest or the first evaluation: not a (compiling) step more
            self.log.info(f"stopped before step {self.step + 1}; {self._resume_hint()}")
            return EXIT_INTERRUPTED
        self.window = self.new_window()
        stopping, saved_step = False, None
        self.clock.start()
        compiled = self.plan.compile is not None or self.plan.cuda_graph
        compiling = compiled
        while now < end and not stopping:  # `now` is read once per step: every decision below agrees on it
            before = now
            switched = self._train_step(self.window)
            compiling = compiling or (switched and compiled)
            # Compiling (the first step, and a step after a curriculum or sequence-length switch) or capturing
            # CUDA graphs (the steps after it): start-up, not training time, which a seconds budget counts.
            if compiling:
                self.clock.bank(startup=True)
                self.window.restart_timer(self.clock.t0)  # the window's tokens/s: training steps only
                compiling = self.train_step.graphs is not None and not self.train_step.graphs.captured
            now = self.clock.position(self.step)
            stopping = self._stop_agreed()
            due = due_after_step(cfg, self.step, before, now, end, stopping)
            if (due.log or due.eval or due.save) and not self.healthy(check_params=due.save):
                if handle_divergence(self, stopping):  # it finishes a pending save, checked before it started
                    now = self.clock.position(self.step)
                    continue
                return 1
            if due.log:
                # An optimization switched off: from the last good checkpoint, or on from here (this step's
                # evaluation and save still due) without one.
                if self._log(self.window, due.regular) and continue_after_switch(self):
                    now = self.clock.position(self.step)
                    continue
                if due.regular:
                    self.window = self.new_window()
            # A stop asked for by the end of the run's last step: its checkpoint first, then its final evaluation,
            # which a first signal does not cut short (``_eval_stop``: it is the run's result, and a resume would find
            # nothing left to do), where a second one still ends the process.
            ending = stopping and now >= end
            reason = "stop_at_step" if cfg.stop_at_step and now >= end else ""
            if ending:
                self.save(reason)
            if due.eval:
                self._eval()
                self._restart_timer()
                stopping = self._stop_agreed()
            if stopping and now < end:
                break
            if due.save and not ending:
                self.save(reason)
                saved_step = self.step
                self._restart_timer()
                if now < end:  # a signal during the save: no step after it, and no second save
                    stopping = self._stop_agreed()
        interrupted = stopping and now < end
        if interrupted and saved_step != self.step:
            self.save(f"interrupted by {self.stop_request.reason}")
        finish_save(self)
        if interrupted:
            self.log.info(f"stopped at step {self.step}; {self._resume_hint()}")
            return EXIT_INTERRUPTED
        return 0

    def _stop_agreed(self) -> bool:
        """Whether to stop now: a signal on any rank stops every rank at the same step. Asked once per step
        and per evaluation batch, so it also tells the stall dump that the run is making progress."""
        self.stall.beat()
        if any_rank(self.stop_request.reason is not None, self.dist):
            self.stop_request.reason = self.stop_request.reason or "a signal on another rank"
            self.stop_request.acknowledge()
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
        self.clock.bank()
        self.window.restart_timer(self.clock.start())

    def new_window(self) -> LogWindow:
        window = LogWindow(self.device, self.saved_window)  # a resumed run continues the interrupted window
        self.saved_window = None
        return window

    def _train_step(self, window: LogWindow) -> bool:
        """One optimizer step; True when it starts a new shape or routing layout (a compiled step traces it anew,
        CUDA graphs capture it again)."""
        cfg = self.cfg
        clock = self.clock.position(self.step)
        changed = self.seq_schedule is not None and self._follow_seq_len_schedule(clock)
        msg = self.curriculum.apply(clock, self.model)
        if msg:
            self.log.info(msg)
            changed = True
            if self.train_step.graphs is not None:  # the routing's control flow changed: capture it again
                self.train_step.graphs.reset()
        if changed and (self.plan.compile is not None or self.plan.cuda_graph):
            # The steps since the clock last started trained: bank them, so that start-up (which the loop banks
            # after this step) holds the recompiling step alone, and a seconds budget's position moves on.
            self._restart_timer()
        lr = lr_at(clock, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                   schedule=cfg.schedule, wsd_decay_pct=cfg.wsd_decay_pct)
        if self.adaptive is not None:
            lr *= self.adaptive.multiplier(self.step)
        lr *= self.rollback.lr_scale
        set_lr(self.optimizer, lr)
        if self.step < cfg.moe_warmup_steps:
            hold_routers(self.optimizer)
        parts = torch.zeros(5, device=self.device)  # loss, ce, aux, ponder, moe (summed over micro-batches)
        stats = None
        for i in range(cfg.grad_accum):
            inputs = self._step_inputs(self._next_batch())
            with gradient_sync(self.wrapped, self.dist, sync=i == cfg.grad_accum - 1):
                micro_parts, micro_stats = self.train_step.micro(inputs)
            parts += micro_parts
            stats = micro_stats.clone()  # CUDA graphs reuse output memory
        keep = None
        if self.batch_filter is not None:  # every rank decides on the same (global mean) loss
            keep = self.batch_filter.keep(mean_across_ranks(parts[0] / cfg.grad_accum, self.dist))
            self.batch_filter.mask(self.params, keep)
        grad_norm = full_tensor(self.train_step.update())
        self.train_step.sample_hessian_if_due(inputs, cfg.seed, self.step)  # Sophia-G: on this step's last batch
        moe_load = self.train_step.moe_load
        graphs = self.train_step.graphs
        if graphs is not None and graphs.captured and not self._graphs_announced:
            self.log.info(f"step {self.step + 1}: training step captured as CUDA graphs, replayed from now on")
        self._graphs_announced = graphs is not None and graphs.captured
        parts = parts / cfg.grad_accum
        if self.dist.enabled:  # one small all-reduce: every rank logs and decides on the global mean (MoE load too)
            loads = [] if moe_load is None else [moe_load.flatten()]
            # The routers' running thresholds, calibrated on each rank's own rows, averaged so that every rank (and
            # the checkpoint, which keeps one rank's copy) holds the pooled one; FSDP2 leaves buffers alone.
            thresholds = [b.float().flatten() for b in self._threshold_buffers]
            flat = mean_across_ranks(torch.cat([parts, stats.flatten(), *loads, *thresholds]), self.dist)
            n = 5 + stats.numel()
            parts, stats = flat[:5], flat[5:n].reshape(stats.shape)
            if moe_load is not None:
                moe_load = flat[n:n + moe_load.numel()].reshape(moe_load.shape)
                n += moe_load.numel()
            for buffer, value in zip(self._threshold_buffers, flat[n:].split([b.numel() for b in
                                                                               self._threshold_buffers])):
                buffer.copy_(value.view_as(buffer))
        if moe_load is not None:
            window.add_moe_load(moe_load)
        # A batch the filter skipped (a non-finite loss among them) changed nothing: not a divergence.
        self.finite.fold(parts[0] if keep is None else torch.where(keep > 0, parts[0], 0.0), grad_norm)
        # A skipped batch feeds neither the loss gate (which ignores NaN) nor the window (so neither the adaptive LR
        # nor the anomaly monitor): it changed nothing.
        self.curriculum.observe(parts[1] if keep is None else torch.where(keep > 0, parts[1], float("nan")))
        window.add(parts, grad_norm, stats, lr, keep)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        if self.swa is not None:
            self.swa.update(self.model, self.clock.position(self.step))
        return changed

    def _log(self, window: LogWindow, regular: bool = True) -> bool:
        """Write a metrics record (of a window known to be finite). Only ``regular`` records (every
        log_every steps) feed the loss gate, the adaptive LR and the anomaly monitor, so interrupting
        a run cannot change their decisions. True when the monitor switched an optimization off."""
        run = {"tokens": self.tokens_seen, "memory_mb": memory_mb(self.device), "train_s": self.clock.seconds(),
               "startup_s": self.clock.startup_s,
               "mod_active": self.curriculum.mod_active, "mor_active": self.curriculum.mor_active,
               "mor_ramp": self.curriculum.mor_ramp}
        record, warnings = window.record(self.step, self.tokens_per_step, run, self.model.router_names(),
                                         [f"after_block{i}" for i in self.model.moe_blocks])
        for expert, warning in warnings.items():
            if expert not in self.starving:  # once per expert and run
                self.starving.add(expert)
                self.log.warning(f"step {self.step}: {warning}")
        loss, gnorm, tps = record["loss"], record["grad_norm"], record["tokens_per_s"]
        if self.batch_filter is not None:
            record["skipped_batches"] = int(self.batch_filter.skipped)
        if self.peak_flops:
            record["mfu"] = self._flops_per_token() * tps / (self.peak_flops * self.dist.world_size)
        self.metrics.write(record)
        self.log.info(progress_line(record, self.cfg.max_steps))
        if not regular:
            return False
        self.curriculum.check_gate(self.clock.position(self.step))
        if not window.kept:  # the filter skipped every step of the window: no loss to judge
            return False
        if self.adaptive is not None and self.adaptive.observe(self.step, loss):
            self.log.info(f"adaptive LR: loss spike at step {self.step} ({loss:.3f}); LR "
                          f"x{self.cfg.adaptive_lr_factor:g} for {self.cfg.adaptive_lr_cooldown} steps")
        tps = broadcast_object(tps, self.dist)  # rank 0's throughput: every rank takes the same decision
        return self.safe_opts.observe(self.step, loss, gnorm, tps) is not None

    def _flops_per_token(self) -> float:
        c = self.curriculum
        # the rows of the sequence-length schedule's stage (attention's FLOPs grow with them)
        return flops_per_token_in_phase(self.s.model_cfg, self.loader.seq_len, c.mod_active, c.mor_active, c.mor_ramp,
                                        cache=self._flops.setdefault(self.loader.seq_len, {}))

    def _eval(self) -> dict | None:
        if not self.s.data.token_counts.get("val"):
            if not getattr(self, "_warned_no_val", False):
                self.log.warning(f"{self.s.data.path} has no validation split: skipping evaluation")
                self._warned_no_val = True
            return None
        self.clock.bank()
        t0 = time.perf_counter()
        if self._valset is None:
            self._valset = ValSet(self.s.data, self.cfg.batch_size, self.cfg.seq_len, self.dist.rank,
                                  self.dist.world_size)
        result = evaluate(self.model, self._valset, self.device, self.cfg.eval_batches, self.autocast,
                          self.use_doc_ids, self._eval_stop, lambda t: sum_across_ranks(t, self.dist))
        if result is None:
            return None
        record = {"kind": "eval", "step": self.step, **result}
        swa = self._eval_swa() if self.clock.position(self.step) >= self.cfg.max_steps else None
        if swa is not None:
            record.update({f"swa_{k}": v for k, v in swa.items() if k.startswith(("val_loss", "val_ppl", "val_gap"))})
        record.update(eval_s=time.perf_counter() - t0, train_s=self.clock.train_s)
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
                        self.use_doc_ids, self._eval_stop)

    def _eval_stop(self) -> bool:
        """Whether an evaluation gives up for a stop signal: any but the final one, which is the run's result (a
        second signal still ends the process)."""
        stop = self._stop_agreed()  # asked on every rank alike, and beats the stall watchdog
        return stop and self.clock.position(self.step) < self.cfg.max_steps


def train(setup: RunSetup) -> int:
    """Run a configured training job; returns the process exit status (130 when interrupted)."""
    try:
        trainer = Trainer(setup)
        if setup.dist.is_main:
            write_run_files(setup, sys.argv)
        return trainer.run()
    finally:
        setup.close()
