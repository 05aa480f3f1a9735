"""How much of each compiled block graph its deeper units make up (CPU is enough: it counts graph nodes).

    python benchmarks/block_graph_nodes.py [--dim 256] [--seq_len 1024]

The 100M preset's layout (narrowed to ``--dim``) with 1, 2, 3 and 4 recursions, compiled as the trainer compiles it
(``compile_policy.compile_units``: each block layout one graph with its routing) but with a backend that only counts
the nodes of AOT autograd's forward and backward graphs; one training step of one row. A unit adds about the same
nodes whatever its token count, so the count per recursion is the price, in compile time, of the deep units that
run a few tokens per row (inductor's time grows with its scheduler nodes: benchmarks/BENCHMARKS.md, forty-second
session).
"""

from __future__ import annotations

import argparse

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import hydra_lm
from hydra_lm.train.compile_policy import compile_units


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=1024)
    args = ap.parse_args()
    graphs: list[tuple[str, int]] = []

    def counting(kind: str):
        def compiler(gm, example_inputs):
            graphs.append((kind, sum(1 for n in gm.graph.nodes if n.op == "call_function")))
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))
    print("| recursions | tokens per row entering each depth (block 0 / block 1) | forward nodes per layout | "
          "backward nodes per layout |")
    print("|---|---|---|---|")
    for recursions in (1, 2, 3, 4):
        torch._dynamo.reset()
        graphs.clear()
        model = hydra_lm.create_model("100M", vocab_size=1024, dim=args.dim, n_heads=2, n_kv_heads=1,
                                      max_seq_len=args.seq_len, recursions=recursions).train()
        compile_units(model, backend=backend, fullgraph=True)
        ids = torch.randint(0, 1024, (1, args.seq_len))
        model(ids, targets=torch.roll(ids, -1, 1))["loss"].backward()
        depths = " / ".join("/".join(map(str, b.tokens_per_depth(args.seq_len))) for b in model.blocks[:2])
        fw = " + ".join(str(n) for kind, n in graphs if kind == "forward")
        bw = " + ".join(str(n) for kind, n in graphs if kind == "backward")
        print(f"| {recursions} | {depths} | {fw} | {bw} |", flush=True)


if __name__ == "__main__":
    main()
