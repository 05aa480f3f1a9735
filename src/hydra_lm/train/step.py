"""One training step, the same code for ``hydra-lm train`` and ``hydra-lm bench``: forward and
backward of each micro-batch, then clipping and the optimizer update; replayed as CUDA graphs when
the speed plan says so. The trainer adds what lies around a step (data, schedule, logging)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from ..data.loader import IGNORE_INDEX
from .compile_policy import SpeedPlan
from .graphed_train_step import GraphedTrainStep
from .optim import make_capturable
from .parallel_compile import Warming, release_helpers, start_warming

# What micro_step reads from the model's output.
STEP_OUTPUTS = frozenset({"loss", "ce_loss", "aux_loss", "ponder_loss", "moe_loss", "routing_stats"})


class TrainStep:
    """``micro(inputs)`` runs one micro-batch (gradients accumulate), ``update()`` clips and steps the
    optimizer: (loss parts [5], routing stats) and the gradient norm, device tensors. ``step_model``
    is what a forward calls (the model, its wrapper or a compiled module); ``graphs`` and
    ``step_model`` may be switched at run time (the trainer's anomaly monitor does)."""

    def __init__(self, model, step_model, optimizer: torch.optim.Optimizer, device: torch.device, plan: SpeedPlan,
                 grad_accum: int = 1, grad_clip: float = 1.0, graph_warmup: int = 2):
        self.model, self.step_model, self.optimizer, self.device, self.plan = model, step_model, optimizer, device, plan
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self.clip_in_update = grad_clip > 0 and _unscales_in_update(optimizer, self.params)
        if not self.clip_in_update and getattr(optimizer, "grad_scale", None) is not None:
            optimizer.grad_scale = None  # a factor left by an earlier step's clipping would scale every update
        self.moe_load: torch.Tensor | None = None  # the last micro-batch's per-expert token shares (MoE models)
        self.graphs: GraphedTrainStep | None = None
        self._warmed: set[tuple] = set()  # steps whose block graphs parallel_compile compiled (or found cached)
        self._warming: dict[tuple, Warming] = {}  # steps prepared ahead (``prepare``): their helpers still running
        self.report: Callable[[str], None] = lambda note: None  # where parallel_compile's notes go (trainer: its log)
        # With one micro-batch a step the captured backward writes the gradients (GraphedTrainStep's write_grads).
        self.grads_rewritten = plan.cuda_graph and grad_accum == 1
        if plan.cuda_graph:
            if plan.update_graphed:
                make_capturable(optimizer, device)
            self.graphs = GraphedTrainStep(self.micro_step, self.update_step, device, graph_warmup, plan.update_graphed,
                                           write_grads=self.params if self.grads_rewritten else None)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.device.type == "cuda" else None

    def autocast(self):
        if self.autocast_dtype is not None:
            # Autocast's cast cache off in every step, graphed or not. A captured step must not keep casts across
            # the capture's boundary; and with the cache, a weight used several times (the recursions' shared
            # layers) sums its uses' gradients in bf16 before the cast back, without it in fp32, so eager steps'
            # gradients differed from graphed ones (HYDRA debug model, CPU bf16 autocast: up to 0.17% per tensor;
            # benchmarks/BENCHMARKS.md, forty-eighth session).
            return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
        return contextlib.nullcontext()

    def micro(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plan.parallel_compile:
            self._warm_compile_caches(inputs)
        if self.graphs is not None:
            return self.graphs.micro(inputs)
        return self.micro_step(**{k: self._to_device(v) for k, v in inputs.items()})

    def prepare(self, inputs: dict[str, torch.Tensor], alongside: int = 1) -> None:
        """Start compiling the graphs of a coming step on ``inputs`` (the same shapes and routing switches) in
        parallel processes, to overlap other work before it (the trainer's pretests and first evaluation:
        ``alongside`` is the GPU memory that work may take, in helpers' sizes). Nothing without the parallel
        compile."""
        if self.plan.parallel_compile:
            key = self._graphs_key(inputs)
            if key not in self._warmed and key not in self._warming:
                warming = start_warming(self.model, self.plan, inputs, self.device, self.autocast_dtype, alongside)
                if warming.helpers:  # none started (e.g. no room beside that work): the step decides again, alone
                    self._warming[key] = warming

    def stop_warming(self) -> None:
        """Kill the helpers of prepared steps that will not run, and let those started ahead exit (the run ends)."""
        self._stop_prepared()
        release_helpers()

    def _stop_prepared(self) -> None:
        for warming in self._warming.values():
            warming.stop()
        self._warming.clear()

    def _graphs_key(self, inputs: dict[str, torch.Tensor]) -> tuple:
        # A step whose graphs are new: its shapes, or the blocks' curriculum switches, differ from every earlier one.
        return (tuple((k, v.shape, v.dtype) for k, v in inputs.items()),
                tuple((b.mod_active, b.mor_active, b.mor_ramp) for b in self.model.blocks))

    def _warm_compile_caches(self, inputs: dict[str, torch.Tensor]) -> None:
        key = self._graphs_key(inputs)
        if key not in self._warmed:
            self._warmed.add(key)
            warming = self._warming.pop(key, None)
            self._stop_prepared()  # prepared for other shapes or switches: those graphs would only take memory
            if warming is None:
                warming = start_warming(self.model, self.plan, inputs, self.device, self.autocast_dtype)
            note = warming.wait()
            if note:
                self.report("parallel compile: " + note)

    def update(self) -> torch.Tensor:
        return self.graphs.update() if self.graphs is not None else self.update_step()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # A copy from pageable memory would wait for the GPU to drain; from pinned memory it queues.
        if self.device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def micro_step(self, input_ids, targets, doc_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch: (loss parts [5], routing stats)."""
        kwargs = {"doc_ids": doc_ids} if doc_ids is not None else {}
        with self.autocast():
            out = self.step_model(input_ids, targets=targets, **kwargs)
        if not isinstance(out, dict) or not STEP_OUTPUTS <= out.keys():
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise ValueError(f"the model's forward(input_ids, targets=...) returned {got}; a training step reads "
                             f"{sorted(STEP_OUTPUTS)} (a HydraModel's output dict; zeros for the losses a model has "
                             "none of, an empty tensor of routing stats)")
        (out["loss"] / self.grad_accum).backward()
        self.moe_load = out["moe_load"].detach() if "moe_load" in out else None
        parts = torch.stack([out[k].detach().float() for k in ("loss", "ce_loss", "aux_loss", "ponder_loss",
                                                                "moe_loss")])
        return parts, out["routing_stats"].detach().float()

    def sample_hessian_if_due(self, inputs: dict[str, torch.Tensor], seed: int, step: int) -> None:
        """Sophia-G's curvature estimate, after an update, when its schedule asks for one (other optimizers:
        nothing): the gradients of the loss on labels drawn from the model's own predictions for ``inputs``
        (one micro-batch; padding excluded) by a generator seeded with the run's ``seed`` and the ``step`` (a
        resumed run draws the same labels), folded into the optimizer's running Hessian
        (``update_hessian``), then cleared. Eager, between graph replays. Its forward, in training mode, also
        folds that batch into the routers' calibration once more."""
        due = getattr(self.optimizer, "hessian_due", None)
        if due is None or not due():
            return
        generator = torch.Generator(self.device).manual_seed(seed * 1_000_003 + step)
        input_ids, targets = self._to_device(inputs["input_ids"]), self._to_device(inputs["targets"])
        kwargs = {"doc_ids": self._to_device(inputs["doc_ids"])} if "doc_ids" in inputs else {}
        with self.autocast():
            logits = self.step_model(input_ids, **kwargs)["logits"].float().flatten(0, 1)
        with torch.no_grad():
            sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
            sampled = torch.where(targets.flatten() == IGNORE_INDEX, IGNORE_INDEX, sampled)
        F.cross_entropy(logits, sampled, ignore_index=IGNORE_INDEX).backward()
        self.optimizer.update_hessian()
        self.optimizer.zero_grad(set_to_none=self.graphs is None)

    def update_step(self) -> torch.Tensor:
        """Clip (or only measure) the gradient norm, step the optimizer, clear the gradients."""
        if self.grad_clip > 0 and not self.clip_in_update:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        else:  # without clipping still measured for the log (clipping by inf would turn an overflow into NaN grads)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if self.clip_in_update:
            # clip_grad_norm_'s factor, applied by the fused update as it reads each gradient (it divides by
            # grad_scale and stores the result): no pass over the gradients of its own, which took 0.23 ms of a
            # 27.5-ms step of the 100M preset on an H200 (+0.3% tokens/s; benchmarks/BENCHMARKS.md, fifty-first
            # session).
            factor = torch.clamp(self.grad_clip / (grad_norm + 1e-6), max=1.0)
            self.optimizer.grad_scale = (1.0 / factor).float()  # the kernel reads an fp32 scale
        self.optimizer.step()
        # A captured backward accumulates into gradients that exist: zero them in place instead. A captured update
        # whose backward rewrites them leaves them (zeroing them took 0.1 ms of a 28-ms step of the 100M preset on
        # an H200; benchmarks/BENCHMARKS.md, forty-eighth session); whoever turns the graphs off clears them.
        if not (self.grads_rewritten and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.optimizer.zero_grad(set_to_none=self.graphs is None)
        return grad_norm

    def drop_graphs(self) -> None:
        """Run eagerly from now on. The gradients a graphed update left are cleared: eager steps add into them."""
        self.graphs = None
        self.optimizer.zero_grad(set_to_none=True)


def _unscales_in_update(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether ``optimizer`` divides the gradients by its ``grad_scale`` attribute inside its update (torch's fused
    Adam and AdamW, the mechanism ``torch.amp.GradScaler`` uses), so that clipping can ride on it. Plain tensors
    only: a DTensor's norm (FSDP2) is not a tensor the fused kernel takes."""
    from torch.distributed.tensor import DTensor

    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))
            and not any(isinstance(p, DTensor) for p in params))
