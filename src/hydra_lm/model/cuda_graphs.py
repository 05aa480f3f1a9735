"""A step of work (the trainer's forward + backward, its update) captured as one CUDA graph. (The
decode step captures its segments itself, ``decode_step.DecodeStep``: it needs several graphs per step.)

``torch.compile(mode="reduce-overhead")`` graphs only what inductor compiled, one compiled region at a time: a
HYDRA step (each block compiled with its routing, ``train.compile_policy.compile_units``, and the eager ops
between the blocks, or nothing compiled at all) would still be bound by the host issuing its many small kernels.
Capturing at the PyTorch level instead graphs everything the step launches (compiled blocks, eager ops, loss,
optimizer) and replays it with one launch.
PyTorch's ``make_graphed_callables`` graphs modules, not an optimizer step or a decode loop's
cache updates, so this small wrapper does the documented whole-network capture.

Requirements of the step (all hold for a HYDRA step in top-k mode): static
shapes, no host synchronisation, inputs read from fixed tensors that the caller refills in place;
for training, an optimizer with ``capturable=True`` (step counter and learning rate on the device)
and gradients that are None before the first call or kept allocated and zeroed in place; autocast
with ``cache_enabled=False``.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable

import torch


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool=None):
    """``torch.cuda.graph(graph, pool=pool)`` with Python's automatic garbage collection paused. A
    collection inside the capture may free another CUDA graph (a previous run's, in a process that
    trains several), and destroying a graph is not permitted while a stream captures: a `compare`
    run failed that way ("operation not permitted when stream is capturing (function reset)",
    eighteenth session; with this guard the same run finished once, nineteenth session: not proof
    that it is the fix). ``torch.cuda.graph`` collects once before the capture begins, which stays."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if was_enabled:
            gc.enable()


class GraphedStep:
    """Call ``step()`` as often as the eager step: the first ``warmup`` calls run eagerly on a side
    stream (compilation, optimizer state, lazy initialisation), the next one captures the step and
    replays it, every later one only replays. Each call is exactly one step on the current contents
    of the input tensors. Returns what the step function returned; those tensors are overwritten
    by the next replay, so clone what must outlive it.

    ``reset()`` drops the graph (and its memory), e.g. when the model's control flow changed
    (curriculum switches); the next call captures again, after ``warmup`` eager calls.
    ``before_capture()``, when given, runs right before each capture.
    """

    def __init__(self, step_fn: Callable[[], Any], warmup: int = 3,
                 before_capture: Callable[[], None] | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep needs a CUDA device: CUDA graphs do not exist on the CPU")
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one eager step must precede the capture")
        self._fn = step_fn
        self._before_capture = before_capture
        self.warmup = warmup
        self._eager_calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def reset(self) -> None:
        self._graph, self._outputs, self._eager_calls = None, None, 0

    def __call__(self) -> Any:
        if self._graph is None:
            if self._eager_calls < self.warmup:
                self._eager_calls += 1
                return self._on_side_stream()
            self._capture()
        self._graph.replay()
        return self._outputs

    def _on_side_stream(self) -> Any:
        # Warm-up away from the default stream, as capture requires (lazy cuBLAS/cuDNN workspaces and
        # autograd's stream bookkeeping must not be first created inside the capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self._fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        if self._before_capture is not None:
            self._before_capture()
        torch.cuda.synchronize()
        with capture(graph):
            self._outputs = self._fn()
        self._graph = graph
