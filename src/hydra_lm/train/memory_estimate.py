"""``hydra-lm info --memory`` and ``compute_memory_footprint``: peak training memory of a preset or a
built model for a batch shape and an optimizer.

Weights, gradients and optimizer state are counted from the parameter shapes. Activations are
measured, not guessed: one forward pass runs on fake tensors (shapes only, no memory) and every
tensor autograd saves for the backward pass is summed once per storage. The backward pass adds a
working set of about twice the largest saved tensor (its gradient and the recomputed softmax of
the loss), or on CUDA the fused loss's chunk of logits if that is larger. ``device`` picks the
trainer's defaults there: "cpu" counts fp32 activations and the plain loss, "cuda" bf16 autocast
and the fused chunked loss (weights, gradients and optimizer state stay fp32 on both). Sophia's
Hessian estimate adds a pass over the batch's whole logits. Checked against a CPU run's peak RSS
(glibc's dynamic mmap threshold off, so freed memory is given back) within 15% on the debug preset;
the CUDA figures against measured H100 runs in benchmarks/BENCHMARKS.md.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config import HydraConfig, preset_config
from ..model import HydraModel
from .optim import takes_muon

DEVICES = ("cuda", "cpu")

MB = 2 ** 20


def optimizer_state_bytes(model: torch.nn.Module, optimizer: str) -> int:
    """Bytes of optimizer state for fp32 parameters."""
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if optimizer in ("adamw", "sophia"):
            total += 8 * n  # two fp32 moments (Sophia: momentum and Hessian diagonal)
        elif optimizer == "adam8bit":
            total += 2 * n  # two 8-bit moments (block scales are a rounding error)
        elif optimizer in ("lion", "clion"):
            total += 4 * n  # one momentum
        elif optimizer == "adafactor":
            # Factored second moment for matrices: one row and one column vector; full for vectors.
            total += 4 * (p.shape[:-1].numel() + p.shape[:-2].numel() * p.shape[-1] if p.dim() >= 2 else n)
        elif optimizer == "muon":
            total += 4 * n if takes_muon(name, p) else 8 * n
        else:
            raise ValueError(f"--optimizer {optimizer!r}: no memory model for it")
    return total


def muon_update_bytes(model: torch.nn.Module) -> int:
    """Working memory of Muon's step replayed as a CUDA graph (train/muon.py): the graph keeps it for good.
    The step takes one shape at a time; at its widest it holds that shape's fp32 Nesterov updates twice
    (the list and their stack), 8 bytes per weight of the largest group of equal-shaped matrices."""
    groups: dict[tuple[int, ...], int] = {}
    for name, p in model.named_parameters():
        if takes_muon(name, p):
            groups[tuple(p.shape)] = groups.get(tuple(p.shape), 0) + p.numel()
    return 8 * max(groups.values(), default=0)


def estimate_training_memory(model_size: str, batch_size: int, seq_len: int, optimizer: str = "adamw",
                             arch: str = "hydra", vocab_size: int | None = None,
                             device: str = "cpu") -> dict[str, float]:
    """MB per part and ``peak_mb``, their sum, for a preset trained on ``device`` ("cpu" or "cuda")."""
    overrides = {"arch": arch}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return measure_training_memory(preset_config(model_size, **overrides), batch_size, seq_len, optimizer,
                                   device=device)


def compute_memory_footprint(model: HydraModel, batch_size: int, seq_len: int,
                             optimizer: str = "adamw", device: str = "cpu") -> dict[str, float]:
    """The same estimate for a built model: its config and its gradient-checkpointing setting."""
    return measure_training_memory(model.config, batch_size, seq_len, optimizer,
                                   model.gradient_checkpointing, model.checkpoint_every, device)


def measure_training_memory(cfg: HydraConfig, batch_size: int, seq_len: int, optimizer: str = "adamw",
                            gradient_checkpointing: bool = False, checkpoint_every: int = 1,
                            device: str = "cpu", fused_loss: bool = True, ce_chunk_size: int | None = None
                            ) -> dict[str, float]:
    """The estimate itself, from a config: one forward on fake tensors, saved activations summed. On CUDA the loss
    is the fused one of ``ce_chunk_size`` tokens per chunk (the model's default when None) unless ``fused_loss`` is
    False (``--no-chunked_ce``: the whole logits)."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"--batch_size {batch_size} and --seq_len {seq_len} must be >= 1")
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: the memory estimate models one of {', '.join(DEVICES)}")
    if seq_len > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=seq_len)
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return t

    cuda = device == "cuda"
    with FakeTensorMode():
        model = HydraModel(cfg)
        model.gradient_checkpointing, model.checkpoint_every = gradient_checkpointing, checkpoint_every
        fused = cuda and fused_loss
        model.ce_impl = "chunked" if fused else "naive"
        if ce_chunk_size is not None:
            model.ce_chunk_size = ce_chunk_size
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        # The CPU's autocast casts the same matmuls to bf16 as CUDA's: the fake tensors need no GPU.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cuda), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(ids, targets=ids)
        params = sum(p.numel() for p in model.parameters()) * 4
        states = optimizer_state_bytes(model, optimizer)
        update = muon_update_bytes(model) if cuda and optimizer == "muon" else 0
    backward = 2 * max(saved.values(), default=0)
    if cuda:  # the loss's fp32 logits and their bf16 gradient (the fused loss's one chunk), while activations are held
        rows = min(model.ce_chunk_size, batch_size * seq_len) if fused else batch_size * seq_len
        backward = max(backward, rows * cfg.vocab_size * (4 + 2))
    if optimizer == "sophia":  # its Hessian estimate's whole fp32 logits, their softmax and their gradient
        backward = max(backward, batch_size * seq_len * cfg.vocab_size * 4 * 3)
    parts = {"weights_mb": params / MB, "gradients_mb": params / MB, "optimizer_mb": states / MB,
             "activations_mb": sum(saved.values()) / MB, "backward_mb": backward / MB, "update_mb": update / MB}
    return {**parts, "peak_mb": sum(parts.values())}


def describe_memory(model_size: str, batch_size: int, seq_len: int, optimizer: str = "adamw", arch: str = "hydra",
                    vocab_size: int | None = None, device: str = "cuda") -> list[str]:
    m = estimate_training_memory(model_size, batch_size, seq_len, optimizer, arch, vocab_size, device)
    precision = "bf16 autocast, fused loss" if device == "cuda" else "fp32, plain loss"
    return [f"training memory of {model_size} ({arch}), batch {batch_size} x {seq_len}, {optimizer}, on {device} "
            f"({precision}): peak about {m['peak_mb']:,.0f} MB",
            f"  weights {m['weights_mb']:,.0f} | gradients {m['gradients_mb']:,.0f} | optimizer state "
            f"{m['optimizer_mb']:,.0f} | saved activations {m['activations_mb']:,.0f} | working set (backward "
            f"or loss chunk) {m['backward_mb']:,.0f}" + (f" | the graphed update's own {m['update_mb']:,.0f}"
                                                         if m["update_mb"] else "") + " MB"]
