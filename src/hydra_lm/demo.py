"""``hydra-lm demo``: build the debug model, run a forward pass and a greedy generation on CPU."""

from __future__ import annotations

import time

import torch

from . import create_model
from .model.accounting import count_parameters


def run_demo(seed: int = 0) -> None:
    torch.manual_seed(seed)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = torch.tensor([list(text.encode("utf-8"))])  # bytes as tokens: no tokenizer needed
    model = create_model("debug", vocab_size=256).eval()
    params = count_parameters(model)
    print(f"debug preset, byte vocabulary: {params.total / 1e6:.1f}M parameters "
          f"({params.effective / 1e6:.1f}M effective with shared recursions)")
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids, targets=torch.roll(ids, -1, dims=1))
    print(f"forward on {ids.shape[1]} tokens: loss {out['ce_loss']:.3f} (untrained; ln 256 = 5.545) "
          f"in {time.perf_counter() - start:.2f}s")
    for name, (frac, gate, _) in zip(model.router_names(), out["routing_stats"].tolist()):
        print(f"  router {name}: {frac:.0%} of tokens executed (causal routing), mean gate {gate:.3f}")
    start = time.perf_counter()
    generated = model.generate(ids[:, :16], max_new_tokens=32)
    print(f"greedy generation of 32 tokens in {time.perf_counter() - start:.2f}s (untrained weights: noise)")
    print(repr(bytes(generated[0].tolist()).decode("utf-8", errors="replace")))
