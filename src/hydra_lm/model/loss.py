"""Cross-entropy of the LM head without materialising [N, V] logits.

``linear_cross_entropy(hidden, weight, targets)`` equals
``F.cross_entropy(hidden @ weight.T, targets, ignore_index=...)`` but picks an implementation that
keeps at most one chunk of logits alive:

- ``liger``: Liger's fused linear cross-entropy Triton kernel (CUDA only, optional package).
- ``chunked``: chunk by chunk along the tokens, with the gradients computed during the forward; runs
  everywhere and traces under ``torch.compile(fullgraph=True)``. The exception: a routed model's tied head on a GPU
  with green contexts keeps the last chunks' logit gradients (up to ``head_gradient_overlap.OVERLAP_BYTES``) and runs
  their weight-gradient GEMMs in the backward, beside the trunk's (model/head_gradient_overlap.py). On CUDA each
  chunk's softmax and logit gradient is one Triton kernel (kernels/cross_entropy_rows.py), elsewhere PyTorch ops.
- ``naive``: materialises the logits; the reference the other two are tested against.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from ..kernels import TRITON_AVAILABLE
from . import head_gradient_overlap
from .head_gradient_overlap import HeadGradientWork, add_chunk_gradient

IMPLS = ("auto", "liger", "chunked", "naive")
LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


@functools.lru_cache(maxsize=None)
def _liger_loss(ignore_index: int):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation ``impl`` stands for on ``device``; raises for a request that cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"linear cross-entropy impl {impl!r}: choose one of {list(IMPLS)}")
    if impl == "auto":
        # Liger's forward reads the non-ignored token count on the host (.item()), which would break
        # a fullgraph trace; the chunked path compiles into the same graph instead.
        use_liger = LIGER_INSTALLED and device.type == "cuda" and not torch.compiler.is_compiling()
        return "liger" if use_liger else "chunked"
    if impl == "liger":
        if not LIGER_INSTALLED:
            raise ValueError("linear cross-entropy impl 'liger' needs the liger-kernel package: "
                             "pip install liger-kernel (or use impl='chunked')")
        if device.type != "cuda":
            raise ValueError(f"linear cross-entropy impl 'liger' runs on CUDA tensors only, got {device.type}; "
                             "use impl='chunked'")
    return impl


def _compute_dtypes(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(matmul dtype, softmax / accumulation dtype). Matmuls follow autocast the way ``F.linear``
    would; the softmax and the loss never run below fp32."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        mm = torch.get_autocast_dtype(device_type)
    else:
        mm = torch.promote_types(hidden.dtype, weight.dtype)
    return mm, torch.promote_types(mm, torch.float32)


# Vocabulary padding of the fused loss's matmuls: with V = 50257 (GPT-2) the [chunk, V] operands are
# not 16-byte aligned and cuBLAS falls back to kernels several times slower (measured on an H100).
VOCAB_ALIGN = 64


def _rows_kernel_applies(hidden: torch.Tensor, acc_dtype: torch.dtype) -> bool:
    """Whether each chunk's loss and logit gradient run the Triton kernel (kernels/cross_entropy_rows.py, on CUDA;
    it computes in fp32; Triton installed) instead of ``_chunk_loss_and_grad``."""
    return hidden.is_cuda and acc_dtype == torch.float32 and TRITON_AVAILABLE


def _chunk_loss_and_grad(h, w, t, valid, row_scale, vocab: int, need_grad: bool):
    """One block of rows: (summed loss, d loss / d logits in ``h``'s dtype or None). ``w`` may have
    padding rows past ``vocab``; their logits are masked out, so their gradient is exactly 0. A valid target outside
    [0, vocab) gives a NaN loss and no gradient, as the Triton kernel does (the padding's -inf logit would give inf)."""
    acc_dtype = row_scale.dtype
    inside = (t >= 0) & (t < vocab)
    safe_t = torch.where(valid & inside, t, torch.zeros_like(t)).unsqueeze(1)
    logits = (h @ w.t()).to(acc_dtype)
    if logits.shape[1] != vocab:
        logits[:, vocab:] = float("-inf")
    lse = torch.logsumexp(logits, dim=1)
    picked = logits.gather(1, safe_t).squeeze(1)
    part = torch.where(valid, torch.where(inside, lse - picked, torch.full_like(lse, float("nan"))),
                       torch.zeros_like(lse)).sum()
    if not need_grad:
        return part, None
    row_scale = row_scale * inside.unsqueeze(1)
    # d loss / d logits = (softmax - onehot) * scale on valid rows, 0 on ignored ones.
    if torch.compiler.is_compiling():
        # Out of place, Inductor fuses the whole chain (cast, exp, one-hot, scale, downcast) into
        # one kernel that writes g in the matmul dtype; in-place ops and scatter would split it
        # into kernels passing fp32 [chunk, V] buffers between them.
        hit = torch.arange(logits.shape[1], device=logits.device) == safe_t
        g = ((logits - lse.unsqueeze(1)).exp() - hit.to(acc_dtype)) * row_scale
    else:
        # Eager runs op by op: reusing the logits buffer keeps a chunk at one fp32 [chunk, V].
        g = logits.sub_(lse.unsqueeze(1)).exp_()
        g.scatter_add_(1, safe_t, -valid.to(acc_dtype).unsqueeze(1))
        g.mul_(row_scale)
    return part, g.to(h.dtype)


@functools.lru_cache(maxsize=None)
def _compiled_chunk_fn(backend, mode):
    # Static shapes: every full chunk reuses one graph (a shorter last chunk adds a second).
    return torch.compile(_chunk_loss_and_grad, fullgraph=True, dynamic=False, backend=backend, mode=mode)


def _chunked_pass(hidden, weight, targets, ignore_index, chunk_size, need_gh, need_gw,
                  compile_chunks=None, side_stream: torch.cuda.Stream | None = None):
    """Mean loss over the valid targets, and when asked the gradients of that loss w.r.t. ``hidden`` and ``weight``, one
    [chunk, V] block of logits at a time. ``compile_chunks`` ({"backend", "mode"} for
    ``torch.compile``, or None): run each chunk's logits, loss and logit gradient as one compiled
    graph (ignored inside an enclosing ``torch.compile``, which compiles them anyway). ``side_stream``
    (``head_gradient_overlap.side_stream``): the weight gradient's GEMMs of the last chunks whose logit gradients fit
    in ``head_gradient_overlap.OVERLAP_BYTES`` are returned undone, as a ``HeadGradientWork`` to run there, in place of
    the weight's gradient."""
    n, vocab = hidden.shape[0], weight.shape[0]
    mm_dtype, acc_dtype = _compute_dtypes(hidden, weight)
    padded = -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN
    if padded != vocab:  # cast and pad in one copy (a cast, then a cat, moved the weight twice)
        w = weight.new_empty((padded, weight.shape[1]), dtype=mm_dtype)
        w[:vocab].copy_(weight)
        w[vocab:].zero_()
    else:
        w = weight.to(mm_dtype)
    valid_all = targets != ignore_index
    # Stays a tensor: dividing by a host number would sync the device every step. Clamping makes
    # a batch with no valid target give loss 0 and zero gradients instead of 0/0.
    scale = 1.0 / valid_all.sum().clamp(min=1).to(acc_dtype)
    kernel = _rows_kernel_applies(hidden, acc_dtype)
    if kernel:
        from ..kernels.cross_entropy_rows import cross_entropy_rows  # imports Triton: only where the kernel runs
    chunk_fn = _chunk_loss_and_grad
    if not kernel and compile_chunks is not None and not torch.compiler.is_compiling():
        chunk_fn = _compiled_chunk_fn(compile_chunks.get("backend", "inductor"), compile_chunks.get("mode"))
    total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    grad_h = torch.empty_like(hidden) if need_gh else None
    # Summing per-chunk products of a low-precision matmul needs a wider accumulator.
    gw_dtype = torch.promote_types(weight.dtype, acc_dtype)
    # Low-precision operands summed into the fp32 buffer inside the GEMM: no separate fp32 add over [V, E]
    # per chunk (4 of 0.14 ms a step at vocabulary 50,257, width 768, on an H200), and the first chunk's
    # GEMM writes the buffer, so it needs no zero fill (0.035 ms a step there).
    gemm_sums = hidden.is_cuda and gw_dtype != mm_dtype and not torch.compiler.is_compiling() and n > 0
    grad_w = None
    if need_gw:
        grad_w = (torch.empty if gemm_sums else torch.zeros)((padded, weight.shape[1]), dtype=gw_dtype,
                                                              device=weight.device)
    # The chunks from ``kept`` on leave their weight-gradient GEMMs to the backward (head_gradient_overlap).
    kept = n
    if need_gw and side_stream is not None:
        row_bytes = padded * mm_dtype.itemsize
        kept = head_gradient_overlap.first_kept_row(n, chunk_size, row_bytes, head_gradient_overlap.OVERLAP_BYTES)
    deferred = []
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h = hidden[start:end].to(mm_dtype)
        if kernel:
            rows, g = cross_entropy_rows(h @ w.t(), targets[start:end], scale, vocab, ignore_index,
                                         need_gh or need_gw)
            part = rows.sum()
        else:
            valid = valid_all[start:end]
            row_scale = (valid.to(acc_dtype) * scale).unsqueeze(1)
            part, g = chunk_fn(h, w, targets[start:end], valid, row_scale, vocab, need_gh or need_gw)
        total = total + part
        if need_gh:
            grad_h[start:end] = g @ w
        if need_gw and start >= kept:
            deferred.append((g, h))
        elif need_gw:
            add_chunk_gradient(grad_w, g, h, gemm_sums and start == 0, gemm_sums)
        # Freed before the next chunk's logits exist: else three [chunk, V] tensors would be alive there, at the
        # forward's peak (412 MB more at vocabulary 50,257 and 4,096 rows in bf16).
        del g
    loss = total * scale
    if deferred:
        return loss, grad_h, HeadGradientWork(grad_w, deferred, gemm_sums and kept == 0, gemm_sums, vocab,
                                              weight.dtype, side_stream)
    return loss, grad_h, None if grad_w is None else grad_w[:vocab].to(weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The forward already holds every intermediate the gradient needs, so it computes the gradient
    there and backward only scales it: no logits are recomputed between the two. With a ``grad_sink`` the head's
    weight-gradient GEMMs of the last chunks are the exception where a side stream of SMs of its own exists: the
    backward runs them beside the trunk's (model/head_gradient_overlap.py)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, need_gh, need_gw, compile_chunks, grad_sink):
        # Only where the hidden states need a gradient: else no trunk backward to overlap, and no lookup to join.
        overlaps = grad_sink is not None and grad_sink.overlap and need_gh
        side = head_gradient_overlap.side_stream(hidden.device) if overlaps else None
        loss, grad_h, grad_w = _chunked_pass(hidden, weight, targets, ignore_index, chunk_size, need_gh, need_gw,
                                             compile_chunks, side)
        ctx.need_gh, ctx.need_gw, ctx.grad_sink = need_gh, need_gw, grad_sink
        ctx.work = grad_w if isinstance(grad_w, HeadGradientWork) else None
        ctx.deferred = ctx.work is not None
        ctx.save_for_backward(*[g for g in (grad_h, grad_w) if isinstance(g, torch.Tensor)])
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.deferred and ctx.work is None:
            raise RuntimeError("a second backward through the fused loss (retain_graph=True): its head gradient's "
                               "GEMMs ran in the first one, beside the trunk's backward, and their inputs are gone; "
                               "for several backwards run a forward for each, or set model.ce_impl = 'naive'")
        saved = iter(ctx.saved_tensors)
        grad_h = next(saved) * grad_loss if ctx.need_gh else None
        if ctx.work is not None:
            # The tied lookup's backward (model/tied_lookup.py) joins it, adds its rows and returns the gradient.
            ctx.grad_sink.put(ctx.work.launch(grad_loss))
            ctx.work = None
            return grad_h, None, None, None, None, None, None, None, None
        grad_w = next(saved) * grad_loss if ctx.need_gw else None
        if grad_w is not None and ctx.grad_sink is not None and ctx.need_gh:
            # The tied lookup's backward adds its rows into it and returns it as the weight's gradient
            # (model/tied_lookup.py). Only where the hidden states need a gradient: else no backward reaches the lookup.
            ctx.grad_sink.put(grad_w)
            grad_w = None
        return grad_h, grad_w, None, None, None, None, None, None, None


def _check(hidden, weight, targets, chunk_size):
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: "
                         "need hidden [..., E] and weight [V, E]")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 ignore_index: int = -100, chunk_size: int = 4096,
                                 compile_chunks: dict | None = None, grad_sink=None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` (hidden [..., E], weight [V, E], targets [...]) over
    the targets that are not ``ignore_index``; at most ``chunk_size`` rows of logits exist at once.
    The mean over zero valid targets is 0 (``F.cross_entropy`` gives NaN). ``compile_chunks``
    ({"backend", "mode"}): each chunk's work as one compiled graph, for callers that do not compile
    the loss themselves. ``grad_sink`` (a ``tied_lookup.HeadGradientSlot``): the backward puts the weight's gradient
    there instead of returning it, for the tied lookup's backward to complete and return."""
    _check(hidden, weight, targets, chunk_size)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    need_gh = hidden.requires_grad and torch.is_grad_enabled()
    need_gw = weight.requires_grad and torch.is_grad_enabled()
    if not (need_gh or need_gw):
        return _chunked_pass(hidden, weight, targets, ignore_index, chunk_size, False, False, compile_chunks)[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_size, need_gh, need_gw,
                                            compile_chunks, grad_sink)


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The mean ``F.cross_entropy`` of logits [..., V] in at least fp32, with the chunked path's 0 (not NaN) for a batch
    that has no valid target: the loss of the model's unfused path (``HydraModel`` with ``ce_impl="naive"``)."""
    logits = logits.reshape(-1, logits.shape[-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    flat = targets.reshape(-1).long()  # int32 targets pass the model's check (the chunked path takes them as they are)
    total = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="sum")
    return total / (flat != ignore_index).sum().clamp(min=1).to(total.dtype)


def naive_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """Reference: full [N, V] logits and ``logits_cross_entropy``."""
    _check(hidden, weight, targets, 1)
    return logits_cross_entropy(F.linear(hidden.reshape(-1, hidden.shape[-1]), weight), targets, ignore_index)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, impl: str = "auto", chunk_size: int = 4096,
                         compile_chunks: dict | None = None, grad_sink=None) -> torch.Tensor:
    """Mean cross-entropy of the LM head ``hidden @ weight.T`` against ``targets`` through the
    implementation ``impl`` picks (see the module docstring). ``auto``: Liger on CUDA when it is
    installed and enabled, outside ``torch.compile``; otherwise ``chunked`` (``compile_chunks``, ``grad_sink``: see
    ``chunked_linear_cross_entropy``; the other paths leave ``grad_sink`` empty)."""
    chosen = resolve_impl(impl, hidden.device)
    if chosen == "naive":
        return naive_linear_cross_entropy(hidden, weight, targets, ignore_index)
    if chosen == "chunked":
        return chunked_linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_size, compile_chunks,
                                            grad_sink)
    _check(hidden, weight, targets, chunk_size)
    flat_h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    return _liger_loss(ignore_index)(weight, flat_h, targets.reshape(-1).contiguous())
