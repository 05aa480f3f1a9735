"""``hydra-lm info --memory`` and ``compute_memory_footprint``: peak training memory of a preset or a
built model for a batch shape and an optimizer.

Weights, gradients and optimizer state are counted from the parameter shapes. Activations are
measured, not guessed: one forward pass runs on fake tensors (shapes only, no memory) and every
tensor autograd saves for the backward pass is summed once per storage. The backward pass adds a
working set of about twice the largest saved tensor (its gradient and the recomputed softmax of
the loss), or on CUDA the fused loss's chunk of logits if that is larger; on CUDA a routed, tied model's fused loss
also keeps the logit gradients and hidden rows of its last chunks into the backward (model/head_gradient_overlap.py).
With gradient checkpointing a checkpointed block holds only its inputs, and backward recomputes its saved tensors and
holds them while it runs through the block: the largest block's are added to the working set. ``device`` picks the
trainer's defaults there: "cpu" counts fp32 activations and the plain loss, "cuda" bf16 autocast (its cast
cache off, as in the trainer's step) and the fused chunked loss (weights, gradients and optimizer state stay
fp32 on both). Sophia's Hessian estimate adds a pass over the batch's whole logits. Checked against a CPU run's
peak RSS (glibc's dynamic mmap threshold off, so freed memory is given back) within 15% on the debug preset,
routed, dense and checkpointed; the CUDA figures against measured H100 runs in benchmarks/BENCHMARKS.md (made
while the trainer's autocast still cached its casts, as the estimate then did).
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config import HydraConfig, preset_config
from ..model import HydraModel, moe
from ..model.head_gradient_overlap import OVERLAP_BYTES, applies, first_kept_row
from ..model.loss import VOCAB_ALIGN
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
    """The same estimate for a built model: its config, its gradient-checkpointing setting and its routing
    curriculum as it stands."""
    block = model.blocks[0]
    return measure_training_memory(model.config, batch_size, seq_len, optimizer,
                                   model.gradient_checkpointing, model.checkpoint_every, device,
                                   curriculum=(block.mod_active, block.mor_active, block.mor_ramp))


def measure_training_memory(cfg: HydraConfig, batch_size: int, seq_len: int, optimizer: str = "adamw",
                            gradient_checkpointing: bool = False, checkpoint_every: int = 1,
                            device: str = "cpu", fused_loss: bool = True, ce_chunk_size: int | None = None,
                            curriculum: tuple[bool, bool, float] = (True, True, 1.0)) -> dict[str, float]:
    """The estimate itself, from a config: one forward on fake tensors, saved activations summed. On CUDA the loss
    is the fused one of ``ce_chunk_size`` tokens per chunk (the model's default when None) unless ``fused_loss`` is
    False (``--no-chunked_ce``: the whole logits). ``curriculum``: the routing (mod_active, mor_active, mor_ramp) as
    ``HydraModel.set_curriculum`` takes it; MoD off runs every token through every block, MoR off every recursion.
    With ``gradient_checkpointing`` a checkpointed block keeps only its inputs, and backward recomputes its saved
    tensors and holds them while it runs through that block: the largest block's are added to the working set."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"--batch_size {batch_size} and --seq_len {seq_len} must be >= 1")
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: the memory estimate models one of {', '.join(DEVICES)}")
    if seq_len > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=seq_len)
    saved: dict[int, int] = {}  # storage -> bytes, of every tensor autograd saves
    outside: set[int] = set()  # the storages saved outside checkpointed blocks, or their inputs: held until backward
    inside: dict[int, set[int]] = {}  # checkpointed block -> the storages it saves: recomputed in backward
    current: list[int | None] = [None]  # the checkpointed block running

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        (outside if current[0] is None else inside[current[0]]).add(storage._cdata)
        return t

    def enter(index: int, args: tuple) -> None:
        current[0] = index
        for t in args:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                saved[storage._cdata] = storage.nbytes()
                outside.add(storage._cdata)

    cuda = device == "cuda"
    with FakeTensorMode():
        model = HydraModel(cfg)
        model.set_curriculum(*curriculum)
        # The blocks HydraModel._trunk checkpoints, traced without checkpointing: which tensors each saves.
        for i, block in enumerate(model.blocks):
            if gradient_checkpointing and i % checkpoint_every == 0:
                inside[i] = set()
                block.register_forward_pre_hook(lambda _, args, i=i: enter(i, args))
                block.register_forward_hook(lambda *_: current.__setitem__(0, None))
        fused = cuda and fused_loss
        model.ce_impl = "chunked" if fused else "naive"
        if ce_chunk_size is not None:
            model.ce_chunk_size = ce_chunk_size
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        # The CPU's autocast casts the same matmuls to bf16 as CUDA's: the fake tensors need no GPU. Its cast cache
        # off, as in the trainer's step (step.TrainStep.autocast): a shared weight is cast and saved once per use.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cuda, cache_enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), _experts_by_shape(cuda):
            model(ids, targets=ids)
        persistent = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}  # not recomputed
        params = sum(p.numel() for p in model.parameters()) * 4
        states = optimizer_state_bytes(model, optimizer)
        update = muon_update_bytes(model) if cuda and optimizer == "muon" else 0
    recomputed = max((sum(saved[s] for s in block - outside - persistent) for block in inside.values()), default=0)
    backward = 2 * max(saved.values(), default=0) + recomputed
    kept = 0
    padded = -(-cfg.vocab_size // VOCAB_ALIGN) * VOCAB_ALIGN
    if cuda and fused and cfg.tie_embeddings and applies(cfg):  # the logit gradients the loss keeps for the backward
        rows, row_bytes = batch_size * seq_len, padded * 2
        kept_rows = rows - first_kept_row(rows, model.ce_chunk_size, row_bytes, OVERLAP_BYTES)
        kept = kept_rows * (row_bytes + cfg.dim * 2)  # and the chunks' bf16 hidden rows, their GEMMs' other operand
    if cuda:  # the fused loss's one chunk of bf16 logits and their gradient (a kept gradient is counted above), or the
        # plain loss's whole fp32 logits and bf16 gradient, while the activations are held
        rows = min(model.ce_chunk_size, batch_size * seq_len) if fused else batch_size * seq_len
        backward = max(backward, rows * padded * (2 + (0 if kept else 2)) if fused else rows * cfg.vocab_size * 6)
    if optimizer == "sophia":  # its Hessian estimate's whole fp32 logits, their softmax and their gradient
        backward = max(backward, batch_size * seq_len * cfg.vocab_size * 4 * 3)
    parts = {"weights_mb": params / MB, "gradients_mb": params / MB, "optimizer_mb": states / MB,
             "activations_mb": sum(saved[s] for s in outside) / MB, "backward_mb": backward / MB,
             "update_mb": update / MB, "head_gradient_mb": kept / MB}
    return {**parts, "peak_mb": sum(parts.values())}


@contextlib.contextmanager
def _experts_by_shape(cuda: bool):
    """MoE experts as one product of their shapes: fake tensors hold no values, so the eager expert loop cannot read
    the row offsets it slices by. Each form saves the same storages: the grouped GEMM on CUDA saves the tokens' and
    all experts' bf16 copies, the loop elsewhere the tokens and the fp32 expert weights (parameters)."""
    def product(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        dtype = torch.bfloat16 if cuda else x.dtype
        return x.to(dtype) @ weight.to(dtype)[0]

    real, moe.expert_matmul = moe.expert_matmul, product
    try:
        yield
    finally:
        moe.expert_matmul = real


def available_host_mb() -> float | None:
    """Memory the kernel can hand out without swapping (``MemAvailable``, Linux); None where it is not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# What to change when a step does not fit the memory, by command: the host check below and the CLI's line for a GPU that
# ran out of memory.
FIT_ADVICE = {
    "train": "lower --batch_size (--grad_accum keeps the tokens per step) or --seq_len, turn on "
             "--gradient_checkpointing, or use a smaller --model_size",
    "bench": "lower --batch_size or --seq_len, or use a smaller --model_size",
}


def check_fits_host(peak_mb: float, what: str, advice: str, processes: int = 1) -> None:
    """Refuse a CPU run whose estimated peak (per process, ``processes`` of them on this host) exceeds the host's
    available memory: Linux's out-of-memory killer would end it with no message, and on a GPU the allocator's own
    error says as much already."""
    available = available_host_mb()
    need = peak_mb * processes
    if available is None or need <= available:
        return
    each = f" ({processes} processes of {peak_mb:,.0f} MB)" if processes > 1 else ""
    raise ValueError(f"{what}: its estimated training peak is {need:,.0f} MB{each}, but this machine has "
                     f"{available:,.0f} MB available, so the kernel would kill it; {advice} "
                     "(`hydra-lm info --memory` shows the estimate by part)")


def describe_memory(model_size: str, batch_size: int, seq_len: int, optimizer: str = "adamw", arch: str = "hydra",
                    vocab_size: int | None = None, device: str = "cuda") -> list[str]:
    m = estimate_training_memory(model_size, batch_size, seq_len, optimizer, arch, vocab_size, device)
    precision = "bf16 autocast, fused loss" if device == "cuda" else "fp32, plain loss"
    return [f"training memory of {model_size} ({arch}), batch {batch_size} x {seq_len}, {optimizer}, on {device} "
            f"({precision}): peak about {m['peak_mb']:,.0f} MB",
            f"  weights {m['weights_mb']:,.0f} | gradients {m['gradients_mb']:,.0f} | optimizer state "
            f"{m['optimizer_mb']:,.0f} | saved activations {m['activations_mb']:,.0f} | working set (backward "
            f"or loss chunk) {m['backward_mb']:,.0f}" + (f" | the graphed update's own {m['update_mb']:,.0f}"
                                                         if m["update_mb"] else "")
            + (f" | logit gradients kept for the head's gradient {m['head_gradient_mb']:,.0f}"
               if m["head_gradient_mb"] else "") + " MB"]
