"""Milliseconds per optimizer step of ``--optimizer muon`` (Muon on the hidden matrices, AdamW on the
rest) on a model's parameters with random gradients: torch.optim.Muon as the Muon part (eager), ours
(``hydra_lm.train.muon.Muon``) eager, and ours replayed as a CUDA graph, as the trainer runs it.

    PYTHONPATH=src python benchmarks/muon_step_time.py [--model_size 100M] [--vocab_size 8192]
"""

import argparse
import time

import torch

from hydra_lm import create_model
from hydra_lm.train import hybrid_optimizer, optim
from hydra_lm.train.options import TrainConfig


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_size", default="100M")
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--dense_layers", type=int, default=7, help="depth of the dense model timed beside HYDRA")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ours = hybrid_optimizer.Muon
    models = {"hydra": {}, f"dense {args.dense_layers} layers": {"arch": "dense", "n_layers": args.dense_layers}}
    for name, overrides in models.items():
        model = create_model(args.model_size, vocab_size=args.vocab_size, **overrides).to(dev)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        row = []
        for variant in ("torch.optim.Muon eager", "ours eager", "ours CUDA graph"):
            hybrid_optimizer.Muon = ours if variant.startswith("ours") else (
                lambda groups, lr: torch.optim.Muon(groups, lr=lr, adjust_lr_fn="match_rms_adamw"))
            opt = optim.build_optimizer(model, TrainConfig(optimizer="muon", lr=6e-4), dev)
            step = opt.step
            if variant.endswith("graph"):
                optim.make_capturable(opt, dev)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        opt.step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    opt.step()
                step = graph.replay
            row.append(f"{variant} {timed(step):.2f} ms")
        hybrid_optimizer.Muon = ours
        print(f"{name}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
