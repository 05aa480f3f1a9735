"""The SwiGLU MLP's forward + backward in three forms, each compiled alone and timed from a CUDA graph of 20 calls
(us a call; needs CUDA). The profile of the 100M step puts SwiGLU's backward pointwise kernel at about 2.5 TB/s
against the forward's 4.2 (BENCHMARKS.md, forty-second session); these are the candidate fixes:

- ``fused``: ``model/layers.SwiGLUMLP`` as it is (gate and up one matmul, its output split; the backward
  concatenates the two halves' gradients, which inductor lowers as one pointwise kernel over both);
- ``fused, cat as copies``: the same with inductor's pointwise concatenation off, so each half's gradient is
  written into its slice of the output by a kernel of its own;
- ``two matmuls``: gate and up as separate matmuls (no split, no concatenation; one more, smaller GEMM each way).

Every variant starts from the same weights; its output and gradients are checked against the first's, a ``(!)``
marks a mismatch.

    python benchmarks/swiglu_variants.py [--tokens 16384] [--dim 768] [--hidden 3072]
"""

from __future__ import annotations

import argparse

import torch
import torch._inductor.config
import torch.nn.functional as F

from graph_timing import us_per_call  # this folder's helper (the script's folder is on sys.path)

from hydra_lm.model.layers import SwiGLUMLP


def two_matmuls(x, w_gate_up, w_down):
    gate_w, up_w = w_gate_up.chunk(2, dim=0)
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), w_down)


def fused(x, w_gate_up, w_down):
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384, help="rows (the 100M step's full-row depth: 16 x 1024)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--hidden", type=int, default=3072)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    mlp = SwiGLUMLP(args.dim, args.hidden).to(dev)
    x0 = torch.randn(args.tokens, args.dim, device=dev)
    g = torch.randn(args.tokens, args.dim, device=dev, dtype=torch.bfloat16)
    # Inductor's limits on the inputs of a concatenation it writes as one pointwise kernel (the second is newer
    # than torch 2.11, so only the options this torch knows are set).
    no_cat = {k: 0 for k in ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")
              if hasattr(torch._inductor.config, k)}
    variants = [
        ("fused (the model's)", torch.compile(fused)),
        ("fused, cat as copies", torch.compile(fused, options=no_cat)),
        ("two matmuls", torch.compile(two_matmuls)),
    ]
    reference = None
    for name, fn in variants:
        w1 = mlp.gate_up.weight.detach().clone().requires_grad_()
        w2 = mlp.down.weight.detach().clone().requires_grad_()
        x = x0.detach().clone().requires_grad_()

        # Gradients returned, not accumulated into .grad, so that every call does the same work.
        def step(fn=fn, x=x, w1=w1, w2=w2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fn(x, w1, w2)
            torch.autograd.grad(out, (x, w1, w2), g)

        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(x, w1, w2)
        result = [out.detach().float(), *(t.float() for t in torch.autograd.grad(out, (x, w1, w2), g))]
        del out  # its graph would keep autograd's nodes for the leaves on this stream, which the capture cannot use
        if reference is None:
            reference = result
        diff = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-9) for a, b in zip(result, reference))
        us = us_per_call(step)
        flag = "" if diff < 2e-2 else " (!)"
        print(f"{name:<22} {us:8.1f} us (largest relative difference {diff:.1e}){flag}", flush=True)
    gemm_flops = 6 * args.tokens * args.dim * 3 * args.hidden
    print(f"the three GEMMs' forward + backward: {gemm_flops / 1e12:.3f} TFLOP a call")


if __name__ == "__main__":
    main()
