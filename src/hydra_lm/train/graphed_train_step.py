"""The trainer's step as CUDA graphs (``hydra-lm train --cuda_graph``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..model.cuda_graphs import GraphedStep


class GraphedTrainStep:
    """The trainer's step as CUDA graphs. ``micro(batch)`` copies one micro-batch into fixed device
    buffers and replays forward + backward, which accumulate into the gradients in place (so it can
    run ``grad_accum`` times per step); ``update()`` replays clipping, the optimizer step and the
    in-place zeroing of the gradients (none with ``write_grads``) when ``graph_update`` (a capturable
    optimizer), else runs them eagerly on the gradients the graph wrote. ``micro_fn(**buffers)`` and
    ``update_fn()`` are the eager functions; each graph is captured after ``warmup`` eager calls (see
    ``GraphedStep``).

    ``write_grads`` (the parameters; for a step of one micro-batch): their gradients are set to None
    before the forward + backward is captured, so the captured backward writes each gradient where a
    graph kernel put it instead of adding it to a zeroed ``.grad`` (one fp32 add per parameter and
    step, 5% of a batch-64 step of the 100M model with MoD only; a shared weight's later uses still
    add). The ``.grad`` tensors then live in the graph's memory and every replay rewrites them; the
    update, which reads them, is captured after the forward + backward and leaves them; ``reset()``
    clears them, so the eager warm-up steps before the next capture start from none. With several
    micro-batches per step the gradients must accumulate: leave it None."""

    def __init__(self, micro_fn: Callable[..., Any], update_fn: Callable[[], Any], device: torch.device,
                 warmup: int = 2, graph_update: bool = True, write_grads: list[torch.Tensor] | None = None):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

        def clear_grads() -> None:
            for p in write_grads:
                p.grad = None

        self._clear_grads = clear_grads if write_grads else None
        self._micro = GraphedStep(lambda: micro_fn(**self._buffers), warmup, before_capture=self._clear_grads)
        self._update = GraphedStep(update_fn, warmup) if graph_update else update_fn

    @property
    def captured(self) -> bool:
        return self._micro.captured and getattr(self._update, "captured", True)

    def reset(self) -> None:
        if self._clear_grads is not None:
            self._clear_grads()
        self._micro.reset()
        if isinstance(self._update, GraphedStep):
            self._update.reset()

    def micro(self, batch: dict[str, torch.Tensor]) -> Any:
        if self._buffers and batch.keys() != self._buffers.keys():
            # A key left out would run on the previous batch's buffer (an old document mask, say).
            raise ValueError(f"CUDA-graphed training step: every batch must hold the same tensors; this one has "
                             f"{sorted(batch)}, the first had {sorted(self._buffers)} (pass the same keys, e.g. "
                             "doc_ids in every batch or in none, or train without CUDA graphs)")
        for name, value in batch.items():
            buf = self._buffers.get(name)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                if self._micro.captured:
                    raise ValueError(f"CUDA-graphed training step: {name} is now {tuple(value.shape)} "
                                     f"{value.dtype}, it was captured as {tuple(buf.shape)} {buf.dtype}; a "
                                     "captured step needs fixed batch shapes (train without CUDA graphs)")
                buf = self._buffers[name] = torch.empty(value.shape, dtype=value.dtype, device=self.device)
            # From pinned memory the copy queues behind the previous replay instead of waiting for it.
            buf.copy_(value.pin_memory() if value.device.type == "cpu" else value, non_blocking=True)
        return self._micro()

    def update(self) -> Any:
        return self._update()
