"""The fused loss's per-chunk cross-entropy and its logit gradient in one Triton kernel, two passes over the logits.

``loss._chunk_loss_and_grad`` (its reference) compiled by inductor reads a chunk's [rows, V] logits three times and
writes the gradient once: a looped max, a looped sum of exponentials, then the gradient (inductor's online softmax
does not apply: the log-sum-exp feeds a second output). That kernel took 0.52 ms of a 100M step's 28.5 ms for each
of its four 4,096 x 50,304 chunks on an H200 (benchmarks/BENCHMARKS.md, forty-eighth session). Here one program a
row keeps a running max and sum in one pass, then writes ``(softmax - onehot) * scale`` in a second: two reads and
one write. Liger's cross-entropy kernel works the same way but is reached only through its fused loss, which reads
a token count on the host, so a CUDA graph cannot hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # columns a program holds per iteration
_WARPS = 8


@triton.jit
def _ce_rows_kernel(logits_ptr, grad_ptr, targets_ptr, scale_ptr, loss_ptr, stride, vocab, padded,
                    ignore_index, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    # Pass 1: running max and sum of exp over the real vocabulary (columns past it are padding, -inf).
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(targets_ptr + row)
    valid = t != ignore_index
    # A target outside the vocabulary reads nothing out of bounds, makes its row's loss NaN, which the trainer's
    # anomaly check reports (PyTorch's ops would stop the device on an assert), and gives its row no gradient.
    in_range = (t >= 0) & (t < vocab)
    safe_t = tl.where(valid & in_range, t, 0)
    picked = tl.load(base + safe_t).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, tl.where(in_range, lse - picked, float("nan")), 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid & in_range, tl.load(scale_ptr).to(tl.float32), 0.0)
        out = grad_ptr + row * padded  # the gradient is a fresh contiguous [n, padded]
        # Pass 2: d loss / d logits; 0 on the padding columns and on ignored or out-of-vocabulary rows.
        for start in range(0, padded, BLOCK):
            c = start + cols
            x = tl.load(base + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
            g = (tl.exp(x - lse) - (c == safe_t).to(tl.float32)) * scale
            tl.store(out + c, g.to(grad_ptr.dtype.element_ty), mask=c < padded)


@torch.library.custom_op("hydra_lm::cross_entropy_rows", mutates_args=())
def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, vocab: int,
                       ignore_index: int, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [n, P] (P >= ``vocab``; columns from ``vocab`` on are padding and ignored), ``targets`` [n] with
    ``ignore_index`` for rows that count nothing, ``scale`` a 0-dim tensor: (loss per row in fp32, 0 on ignored
    rows, NaN where a target lies outside [0, vocab); with ``need_grad`` the gradient ``(softmax - onehot) * scale``
    of the summed loss w.r.t. the logits in their dtype, 0 on ignored and out-of-vocabulary rows and on padding
    columns, else an empty tensor)."""
    if logits.stride(1) != 1:
        raise ValueError("cross_entropy_rows: the logits' columns must be contiguous")
    n, padded = logits.shape
    if vocab > padded or targets.shape != (n,):  # else the kernel reads past a row, or past the targets
        raise ValueError(f"cross_entropy_rows: logits {tuple(logits.shape)}, targets {tuple(targets.shape)}, vocab "
                         f"{vocab}; need vocab <= the logits' columns and one target per row")
    targets = targets.contiguous()  # the kernel reads row r's target at offset r
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    grad = logits.new_empty((n, padded) if need_grad else (0,))
    if n:
        _ce_rows_kernel[(n,)](logits, grad, targets, scale, loss, logits.stride(0), vocab, padded, ignore_index,
                              BLOCK=_BLOCK, WRITE_GRAD=need_grad, num_warps=_WARPS)
    return loss, grad


@cross_entropy_rows.register_fake
def _(logits, targets, scale, vocab, ignore_index, need_grad):
    grad = logits.new_empty(tuple(logits.shape) if need_grad else (0,))
    return logits.new_empty(logits.shape[0], dtype=torch.float32), grad
