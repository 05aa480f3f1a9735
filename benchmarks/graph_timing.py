"""Timing of short GPU work without the host's launch cost: ``calls`` calls of ``fn`` captured in one CUDA graph,
replayed ``replays`` times between two CUDA events (shared by the micro-benchmark scripts of this folder)."""

from __future__ import annotations

import torch


def us_per_call(fn, calls: int = 20, replays: int = 10, warmup: int = 3) -> float:
    """Microseconds a call of ``fn`` (which must be capturable: no host syncs), after ``warmup`` eager calls."""
    # Warm up on a side stream, as CUDA graph capture wants for autograd: the backward's streams are set there.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)
