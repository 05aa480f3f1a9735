"""The training loop: accumulation, clipping, schedule, curriculum, eval, checkpoints, exact resume.

Inside a step nothing reads a device value back to the host: losses, grad norms and the
curriculum's loss EMA stay on the device and are read together every ``log_every`` steps.
Under torchrun the same loop runs on every rank (see ``distributed``): losses and routing
statistics are averaged over ranks each step, so every rank takes the same decisions.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..model.factory import create_model
from ..model.loss import resolve_impl
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from .batch_filter import BatchFilter
from .checkpoint import DISK_FULL, CheckpointError, capture_rng, disk_full_error, restore_rng, verify
from .curriculum import Curriculum, CurriculumPlan
from .data_io import ValSet, train_loader
from .evaluate import evaluate, format_eval, routing_warnings
from .distributed import (any_rank, broadcast_object, full_tensor, gather_objects, gradient_sync, mean_across_ranks,
                          sum_across_ranks, wrap_model)
from .divergence import FiniteFlag, RollbackPolicy, parameters_finite
from .metrics import MetricsWriter, NullMetrics, measure_peak_flops, memory_mb, progress_line
from .graphed_train_step import GraphedTrainStep
from .optim import build_optimizer, check_optimizer_features, make_capturable, portable_optimizer_state, set_lr
from .run import RunSetup, write_run_files
from .safe_optimizations import AnomalyMonitor, SafeOptimizations, Switch
from .schedule import AdaptiveLR, lr_at
from .sharded_checkpoint import RANK_FILE, ShardedSaver, load_dcp, load_optimizer, load_single_into_sharded

EXIT_INTERRUPTED = 130
REPEATED_SIGNAL_S = 2.0  # signals closer together than this count as one request


class Trainer:
    def __init__(self, setup: RunSetup):
        self.s = setup
        cfg, self.cfg, self.log, self.device, self.dist = setup.cfg, setup.cfg, setup.log, setup.device, setup.dist
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.model = create_model(setup.model_cfg).to(self.device)
        self._check_features()
        mc = setup.model_cfg
        routable = (mc.arch == "hydra" and mc.mod_enabled, mc.arch == "hydra" and mc.mor_enabled and mc.recursions > 1)
        # self.model stays the HydraModel (sharded in place by FSDP2); self.wrapped is what a step calls.
        self.wrapped = wrap_model(self.model, self.dist, self.device, find_unused=any(routable) or mc.moe)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg, self.device)
        self.curriculum = Curriculum(CurriculumPlan.from_config(cfg, routable))
        self.adaptive = AdaptiveLR(cfg.adaptive_lr_spike, cfg.adaptive_lr_factor, cfg.adaptive_lr_cooldown) \
            if cfg.adaptive_lr else None
        self.batch_filter = BatchFilter(cfg.batch_filter_k, self.device, warmup=cfg.batch_filter_warmup) \
            if cfg.batch_filter else None
        self.loader = train_loader(setup.data, cfg.batch_size, cfg.seq_len, cfg.seed,
                                   cfg.experimental_prefetch_threads, cfg.prefetch_buffer_size, self.dist.rank,
                                   self.dist.world_size)
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
        if cfg.compile and cfg.compile_regions:
            self.model.use_layer_regions(True)
        if cfg.compile and cfg.compile_units:
            self.model.compile_units(mode=cfg.compile_mode)  # routing stays eager: the step calls the model
            self.step_model = self.wrapped
        else:
            self.step_model = torch.compile(self.wrapped, mode=cfg.compile_mode) if cfg.compile else self.wrapped
        # CUDA graphs: each forward starts a new graph replay; outputs of the last one are consumed by then.
        self._graph_steps = cfg.compile and cfg.compile_mode == "reduce-overhead" and self.device.type == "cuda"
        self.graphs: GraphedTrainStep | None = None
        self._graphs_announced = False
        if cfg.cuda_graph:
            make_capturable(self.optimizer, self.device)
            self.graphs = GraphedTrainStep(self._micro_step, self._update, self.device)
        self.use_doc_ids = cfg.document_masking
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * self.dist.world_size
        self.peak_flops = measure_peak_flops(self.device) if self.device.type == "cuda" else None
        self._create_graph = False
        self._stop: str | None = None
        self._signal_at: float | None = None
        self._valset: ValSet | None = None
        self._iter = None
        monitor = AnomalyMonitor(cfg.experimental_safety_window, cfg.experimental_loss_spike_threshold,
                                 cfg.experimental_throughput_drop_threshold)
        self.safe_opts = SafeOptimizations(self._optimization_switches(), monitor, self.log.warning,
                                           lambda record: self.metrics.write(record))

    # ------------------------------------------------------------------ setup helpers
    def _check_features(self) -> None:
        cfg = self.cfg
        if cfg.compile and cfg.compile_mode == "reduce-overhead" and self.dist.enabled:
            raise ValueError("--compile_mode reduce-overhead (CUDA graphs) works in one process only: FSDP2/DDP "
                             "communication hooks cannot be captured; use --compile_mode default under torchrun")
        if cfg.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"--cuda_graph needs a CUDA device (this run is on {self.device}): CUDA graphs do not "
                             "exist there; drop --cuda_graph")
        if cfg.cuda_graph and self.dist.enabled:
            raise ValueError("--cuda_graph works in one process only: FSDP2/DDP communication cannot be captured; "
                             "drop --cuda_graph under torchrun")
        if cfg.compile_units and self.dist.enabled:
            raise ValueError("--compile_units works in one process only; under torchrun use --compile (whole "
                             "model) or --compile --compile_regions")
        if cfg.time_budget_s and self.dist.enabled:
            raise ValueError("--time_budget_s works in one process only (ranks time their steps differently and "
                             "would disagree on the schedule); under torchrun use --max_steps")
        check_optimizer_features(cfg, self.dist)
        if cfg.chunked_ce:
            # --ce_impl auto: Liger's fused kernel on CUDA when installed (eager only), else the chunked
            # fallback; a CUDA graph cannot hold Liger (it reads a token count on the host).
            self.model.ce_impl = "chunked" if cfg.cuda_graph and cfg.ce_impl == "auto" else cfg.ce_impl
            self.model.ce_chunk_size = cfg.chunked_ce_size
            resolve_impl(self.model.ce_impl, self.device)  # --ce_impl liger without the package or CUDA: refused now
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing = True
            self.model.checkpoint_every = cfg.checkpoint_every or 1

    def _optimization_switches(self) -> list[Switch]:
        """What the anomaly monitor may switch off while running, most invasive first."""
        switches = []
        if self.graphs is not None:
            graphs = self.graphs

            def graphs_on() -> None:
                graphs.reset()
                self.graphs = graphs

            switches.append(Switch("CUDA graphs (--cuda_graph)", lambda: setattr(self, "graphs", None), graphs_on))
        if self.step_model is not self.wrapped:
            compiled = self.step_model
            switches.append(Switch("torch.compile (--compile)", lambda: setattr(self, "step_model", self.wrapped),
                                   lambda: setattr(self, "step_model", compiled)))
        if self.cfg.chunked_ce:
            impl = self.model.ce_impl
            switches.append(Switch("the fused chunked loss (--chunked_ce)",
                                   lambda: setattr(self.model, "ce_impl", "naive"),
                                   lambda: setattr(self.model, "ce_impl", impl)))
        return switches

    def autocast(self):
        if self.device.type == "cuda":
            # Autocast's cast cache would keep tensors across a graph capture's boundary.
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not self.cfg.cuda_graph)
        return contextlib.nullcontext()

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
        if self.adaptive is not None and st.get("adaptive_lr"):
            self.adaptive.load_state_dict(st["adaptive_lr"])
        if st.get("rollback"):
            self.rollback.load_state_dict(st["rollback"])
        if self.batch_filter is not None and st.get("batch_filter"):
            self.batch_filter.load_state_dict(st["batch_filter"])
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
            "loader": self.loader.state_dict(),
            "batch_filter": self.batch_filter.state_dict() if self.batch_filter is not None else None,
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
                path = self.s.manager.save(self.step, self.model, trainer_tensors, state)
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
        if self.graphs is not None:
            self.graphs.reset()
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
        if self.step == 0 and cfg.eval_at_start:
            self._eval()
        self._window = self._new_window()
        stopping = False
        self._train_t0 = time.perf_counter()
        compiling = cfg.compile or cfg.cuda_graph
        while now < end and not stopping:  # `now` is read once per step: every decision below agrees on it
            before = now
            self._train_step(self._window)
            if compiling:  # compiling (first step) or capturing CUDA graphs (first steps): not training time
                self._bank_train_time(startup=True)
                compiling = self.graphs is not None and not self.graphs.captured
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
        scope = ", layer regions" if cfg.compile_regions else ", routed units" if cfg.compile_units else ""
        compiled = f"torch.compile ({cfg.compile_mode}{scope})"
        feats += [name for name, on in ((compiled, cfg.compile), ("whole-step CUDA graphs", cfg.cuda_graph),
                                        ("gradient checkpointing", cfg.gradient_checkpointing),
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

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # A copy from pageable memory would wait for the GPU to drain; from pinned memory it queues.
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _train_step(self, window) -> None:
        cfg = self.cfg
        clock = self._clock()
        msg = self.curriculum.apply(clock, self.model)
        if msg:
            self.log.info(msg)
            if self.graphs is not None:  # the routing's control flow changed: capture it again
                self.graphs.reset()
        lr = lr_at(clock, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                   schedule=cfg.schedule, wsd_decay_pct=cfg.wsd_decay_pct)
        if self.adaptive is not None:
            lr *= self.adaptive.multiplier(self.step)
        lr *= self.rollback.lr_scale
        set_lr(self.optimizer, lr)
        hessian_due = getattr(self.optimizer, "hessian_due", None)  # Sophia: this step's backward keeps its graph
        self._create_graph = hessian_due is not None and hessian_due()
        parts = torch.zeros(5, device=self.device)  # loss, ce, aux, ponder, moe (summed over micro-batches)
        stats = None
        for i in range(cfg.grad_accum):
            batch = self._next_batch()
            inputs = {"input_ids": batch["input_ids"], "targets": batch["targets"]}
            if self.use_doc_ids:
                inputs["doc_ids"] = batch["doc_ids"]
            with gradient_sync(self.wrapped, self.dist, sync=i == cfg.grad_accum - 1):
                if self.graphs is not None:
                    micro_parts, micro_stats = self.graphs.micro(inputs)
                else:
                    micro_parts, micro_stats = self._micro_step(**{k: self._to_device(v) for k, v in inputs.items()})
            parts += micro_parts
            stats = micro_stats.clone()  # CUDA graphs reuse output memory
        if self.batch_filter is not None:  # every rank decides on the same (global mean) loss
            keep = self.batch_filter.keep(mean_across_ranks(parts[0] / cfg.grad_accum, self.dist))
            self.batch_filter.mask(self.params, keep)
        grad_norm = full_tensor(self.graphs.update() if self.graphs is not None else self._update())
        if self.graphs is not None and self.graphs.captured and not self._graphs_announced:
            self.log.info(f"step {self.step + 1}: training step captured as CUDA graphs, replayed from now on")
        self._graphs_announced = self.graphs is not None and self.graphs.captured
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

    def _micro_step(self, input_ids, targets, doc_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch: (loss parts [5], routing stats)."""
        if self._graph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        kwargs = {"doc_ids": doc_ids} if doc_ids is not None else {}
        # Only SDPA's math kernel has a second derivative (Sophia's Hessian steps).
        math_only = sdpa_kernel(SDPBackend.MATH) if self._create_graph else contextlib.nullcontext()
        with self.autocast(), math_only:
            out = self.step_model(input_ids, targets=targets, **kwargs)
        (out["loss"] / self.cfg.grad_accum).backward(create_graph=self._create_graph)
        parts = torch.stack([out[k].detach().float() for k in ("loss", "ce_loss", "aux_loss", "ponder_loss",
                                                                "moe_loss")])
        return parts, out["routing_stats"].detach().float()

    def _update(self) -> torch.Tensor:
        """Clip (or only measure) the gradient norm, step the optimizer, clear the gradients."""
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        else:  # still measured for the log; clipping by inf would turn an overflowed norm into NaN grads
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        self.optimizer.step()
        # A captured backward accumulates into gradients that exist: zero them in place instead.
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        return grad_norm

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
        record = {"kind": "eval", "step": self.step, **result, "eval_s": time.perf_counter() - t0,
                  "train_s": self.train_s}
        self.metrics.write(record)
        self.log.info(f"eval step {self.step}: {format_eval(result)}")
        for warning in routing_warnings(result):
            self.log.warning(f"eval step {self.step}: {warning}")
        return result


def train(setup: RunSetup) -> int:
    """Run a configured training job; returns the process exit status (130 when interrupted)."""
    try:
        trainer = Trainer(setup)
        if setup.dist.is_main:
            write_run_files(setup, sys.argv)
        return trainer.run()
    finally:
        setup.close()
