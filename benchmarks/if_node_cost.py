"""What a CUDA graph IF node costs (``hydra_lm.model.graph_conditionals``), the decode step's way to skip units.

A graph repeats N times: a captured child graph of one tiny kernel, then an IF node (its condition kernel and the
conditional node) on a flag that is always true or always false, whose body is empty, a child graph of 1 or 10
kernels, or a memset node. Without IF nodes the same child graphs time the kernels alone. Times are per repeat,
from CUDA events around 300 launches of the whole graph (needs CUDA and ``cuda-bindings``).

    python benchmarks/if_node_cost.py [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch

from hydra_lm.model import graph_conditionals
from hydra_lm.model.cuda_graphs import capture


def _us_per_launch(launch, n: int = 300) -> float:
    for _ in range(20):
        launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / n


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=20, help="N: child graphs (and IF nodes) in the graph")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    reason = graph_conditionals.unavailable_reason(device)
    if reason is not None:
        raise SystemExit(f"if_node_cost: IF nodes cannot be built here: {reason}")
    n = args.repeats
    counter = torch.zeros(1, device=device)
    pool = torch.cuda.graph_pool_handle()

    def child(kernels: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with capture(graph, pool=pool):
            for _ in range(kernels):
                counter.add_(1)
        return graph

    def memset(composed: graph_conditionals.ConditionalGraph, body) -> None:
        driver = composed._driver
        params = driver.CUDA_MEMSET_NODE_PARAMS()
        params.dst, params.value, params.elementSize = counter.data_ptr(), 0, 4
        params.width, params.height, params.pitch = 1, 1, 4
        composed._keep.append(params)
        composed._append(body, lambda b, deps: graph_conditionals._check(
            driver.cuGraphAddMemsetNode(b, deps, len(deps), params, composed._ctx)))

    rows = {}
    for kernels in (1, 11):
        composed = graph_conditionals.ConditionalGraph(device)
        for _ in range(n):
            composed.add(child(kernels))
        composed.instantiate()
        rows[f"child graph of {kernels} kernel(s), no IF node"] = _us_per_launch(composed.launch) / n
    for taken in (True, False):
        flag = torch.full((), taken, dtype=torch.bool, device=device)
        for body_kind in ("empty", "child graph of 1 kernel", "child graph of 10 kernels", "memset node"):
            composed = graph_conditionals.ConditionalGraph(device)
            for _ in range(n):
                composed.add(child(1))
                body = composed.add_if(flag)
                if body_kind == "memset node":
                    memset(composed, body)
                elif body_kind != "empty":
                    composed.add(child(int(body_kind.split()[3])), body)
            composed.instantiate()
            rows[f"IF {'true' if taken else 'false'}, body {body_kind}"] = _us_per_launch(composed.launch) / n
    for name, us in rows.items():
        print(f"{name:45s} {us:7.2f} us per repeat")
    return rows


if __name__ == "__main__":
    main()
