"""Bytes of optimizer state after one step, per optimizer, against ``hydra-lm info --memory``'s model of them
(``train.memory_estimate.optimizer_state_bytes``) and against fp32 AdamW's. A state's layout is the same on any
device, so this runs on the CPU: the trainer's optimizers as ``train.optim.build_optimizer`` makes them, and
torchao's 8-bit AdamW (the trainer's ``adam8bit`` on CUDA, which it refuses on a CPU) with its compiled step
run eagerly. Tensor-subclass states (torchao's quantised moments) count their inner tensors.

    PYTHONPATH=src python benchmarks/optimizer_state_bytes.py --model_size 100M --vocab_size 8192
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hydra_lm.config import preset_config
from hydra_lm.model.hydra import HydraModel
from hydra_lm.train.memory_estimate import optimizer_state_bytes
from hydra_lm.train.optim import build_optimizer
from hydra_lm.train.options import TrainConfig

OPTIMIZERS = ("adamw", "adam8bit", "adafactor", "lion", "clion", "muon", "sophia")


def tensor_bytes(t: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)  # scalars (step counts) are not state memory


def build(model: HydraModel, name: str) -> torch.optim.Optimizer:
    if name != "adam8bit":
        cfg = TrainConfig(optimizer=name, lr=1e-3, batch_size=16, seq_len=1024, grad_accum=1)
        return build_optimizer(model, cfg, torch.device("cpu"))
    from torchao.optim import AdamW8bit

    return AdamW8bit(list(model.parameters()), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_size", default="100M")
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = HydraModel(preset_config(args.model_size, vocab_size=args.vocab_size))
    print(f"{args.model_size}, vocabulary {args.vocab_size}: {model.num_parameters():,} parameters")
    print(f"{'optimizer':>10} {'measured MiB':>13} {'estimated MiB':>14} {'estimate off':>12} {'x adamw':>8}")
    adamw = None
    for name in args.optimizers:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = build(model, name)
        # torchao's fused step compiles C++ for minutes on a CPU: run it eagerly (its state is the same).
        eager = mock.patch.object(torch, "compile", lambda fn, **kwargs: fn) if name == "adam8bit" \
            else contextlib.nullcontext()
        with eager:
            optimizer.step()
        measured = state_bytes(optimizer)
        estimated = optimizer_state_bytes(model, name)
        adamw = measured if name == "adamw" else adamw
        ratio = f"{measured / adamw:8.3f}" if adamw else f"{'-':>8}"
        print(f"{name:>10} {measured / 2**20:13,.1f} {estimated / 2**20:14,.1f} {estimated / measured - 1:+12.1%} "
              f"{ratio}", flush=True)
        del optimizer


if __name__ == "__main__":
    main()
