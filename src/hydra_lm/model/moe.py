"""Optional Mixture-of-Experts feed-forward block (Switch-style balancing, router jitter, top-k).

Tokens are dispatched only to the experts they are routed to: assignments are sorted by expert
and each expert runs on its contiguous slice. No token is dropped. On CUDA with bf16 the experts
run as one grouped GEMM (``torch._grouped_mm``: static shapes, compile-friendly, and no host sync on the GPUs its
fast kernel serves, compute capability 9.x and 10.x: elsewhere torch's own fallback reads the offsets on the host,
``grouped_mm_syncs``); without it a loop over experts does the same work on the same slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm


def grouped_mm_dtype(x: torch.Tensor) -> torch.dtype | None:
    """bf16 when the grouped GEMM kernel can run (CUDA, bf16 inputs or bf16 autocast), else None."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda):
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return dtype if dtype == torch.bfloat16 else None


def grouped_mm_syncs(device: torch.device) -> bool:
    """Whether the experts' GEMMs on ``device`` read their offsets on the host (so a step with MoE cannot be captured
    in a CUDA graph): torch's grouped GEMM runs without a sync on compute capability 9.x and 10.x only (Hopper,
    Blackwell; elsewhere its fallback copies the offsets to the host), and the loop over experts always syncs."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability(device)[0] not in (9, 10)


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row slice ``offsets[e-1]:offsets[e]`` of ``x`` [M, K] times ``weight[e]`` [K, N]."""
    dtype = grouped_mm_dtype(x)
    if dtype is not None:
        return torch._grouped_mm(x.to(dtype), weight.to(dtype), offs=offsets.to(torch.int32))
    ends = offsets.tolist()  # host sync: eager fallback only
    out = x.new_empty(x.shape[0], weight.shape[-1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = x[start:end] @ weight[e].to(x.dtype)
        start = end
    return out


class MoEFeedForward(nn.Module):
    """``x + sum_k gate_k * expert_k(norm(x))`` over each token's top-k experts."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 1, jitter: float = 0.0,
                 eps: float = 1e-6):
        super().__init__()
        self.n_experts, self.top_k, self.jitter = n_experts, top_k, jitter
        self.norm = RMSNorm(dim, eps)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, jitter: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (x + moe(x), balancing loss, fraction of assignments per expert [E]). ``jitter=False``: no
        router jitter even in training mode (cached decoding, which must route as the eval forward)."""
        b, t, dim = x.shape
        h = self.norm(x).reshape(b * t, dim)
        router_in = h
        if jitter and self.training and self.jitter > 0:
            router_in = h * torch.empty_like(h).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        # fp32 at least (bf16 router logits), fp64 kept for float64 reference models
        logits = self.router(router_in)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        gate, expert = torch.topk(probs, self.top_k, dim=-1)  # [M, k]
        if self.top_k > 1:
            # Renormalise over the chosen experts; with k=1 keep the raw probability, otherwise the
            # gate would be a constant 1 and the router would get no gradient from the LM loss.
            gate = gate / gate.sum(-1, keepdim=True)
        counts = F.one_hot(expert, self.n_experts).sum((0, 1))  # static shape [E]
        fraction = counts.float() / expert.numel()
        loss = self.n_experts * (fraction * probs.mean(0)).sum()

        flat_expert = expert.reshape(-1)
        order = torch.sort(flat_expert, stable=True).indices
        token = order // self.top_k
        xs = h[token]
        offsets = counts.cumsum(0)
        up = expert_matmul(xs, self.w_gate_up, offsets)
        g, u = up.chunk(2, dim=-1)
        ys = expert_matmul(F.silu(g) * u, self.w_down, offsets)
        ys = ys * gate.reshape(-1)[order, None].to(ys.dtype)
        # Back to (token, choice) order and summed over the k choices: deterministic, where an index_add_ of the
        # k contributions per token adds with atomics on CUDA, in a varying order.
        ys = ys.to(h.dtype)
        out = torch.empty_like(ys).index_copy_(0, order, ys).view(b * t, self.top_k, dim).sum(1)
        return x + out.reshape(b, t, dim), loss, fraction
