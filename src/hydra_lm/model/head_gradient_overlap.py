"""The LM head's weight-gradient GEMMs run beside the trunk's backward, on SMs of their own.

The fused loss (model/loss.py) has every intermediate of its gradients in its forward, so it computes them there.
The head's weight gradient is the exception worth moving: its GEMMs (about 1.7 ms of a 28.6-ms step of the 100M
preset at vocabulary 50,257 on an H100) depend on nothing the trunk's backward computes, and that backward is a long
chain of small kernels (the routed units of a few tokens) during which most of the GPU idles. So, where the tied
lookup's backward can join them (``tied_lookup.HeadGradientSlot``), the loss keeps the last chunks' logit gradients
and its backward launches their GEMMs on a side stream, ``HeadGradientWork``.

That stream belongs to a CUDA green context holding all but ``TRUNK_SMS`` of the GPU's SMs. On a plain second
stream the GEMMs' thread blocks took every SM and the trunk's small kernels waited for them: inside a CUDA graph a
chain of small kernels and the four GEMMs took the sum of their times (stream priorities changed nothing), and the
step got 0.7% slower. With the GEMMs kept to 100 of an H100's 132 SMs the pair overlapped (0.63 of the shorter's
time saved), and the 100M step got 1.5% faster, for 0.9 GB more peak memory (the kept logit gradients;
benchmarks/BENCHMARKS.md, seventy-eighth session; ``benchmarks/graph_stream_overlap.py``; the merged form +0.6-1.3%
on an H100 in the eightieth). Where no green context can be made (no CUDA, or a torch build or driver without them),
and in a model without routing (``applies``), the GEMMs stay in the forward.
"""

from __future__ import annotations

import logging

import torch

# SMs left to the trunk's kernels while the head's GEMMs run: with 16 left (116 of an H100's 132 for the GEMMs)
# the two barely overlapped; with 32, well (benchmarks/graph_stream_overlap.py).
TRUNK_SMS = 32
# At most this many bytes of logit gradients are kept from the loss's forward to its backward: all four chunks of a
# 16 x 1,024 batch at vocabulary 50,257 (1.6 GB in bf16). Earlier chunks run their GEMMs in the forward.
OVERLAP_BYTES = 2 << 30

_streams: dict[int, tuple[object, torch.cuda.Stream] | None] = {}
log = logging.getLogger(__name__)


def applies(config) -> bool:
    """Whether a model of ``config`` leaves its head's GEMMs to the backward: only with routed units. A dense model's
    (or an unrouted HYDRA's) backward is a chain of large GEMMs that keep the GPU busy: the dense 100M baseline ran
    520,478 tokens/s with the overlap against 521,553 without it, for 0.9 GB more peak memory (H100, eightieth
    session)."""
    return config.arch == "hydra" and (config.mod_enabled or config.mor_enabled)


def first_kept_row(rows: int, chunk_size: int, row_bytes: int, budget: int) -> int:
    """The first of ``rows`` whose chunk keeps its logit gradients (``row_bytes`` each) for the backward: the last
    whole chunks that fit in ``budget`` bytes (``rows`` where not even the last one fits)."""
    return min(rows, max(0, -(-(rows - budget // row_bytes) // chunk_size) * chunk_size))


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The green context's stream for ``device`` (made once per process), or None where there is none to make."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _streams:
        _streams[index] = _green_stream(index)
    made = _streams[index]
    return None if made is None else made[1]


def _green_stream(index: int) -> tuple[object, torch.cuda.Stream] | None:
    sms = torch.cuda.get_device_properties(index).multi_processor_count - TRUNK_SMS
    if sms < TRUNK_SMS:  # a small GPU: the GEMMs would run slower than the time they could hide
        return None
    try:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(num_sms=sms, device_id=index)
    except (ImportError, RuntimeError) as err:
        log.info("the head's weight gradient stays in the loss's forward: no CUDA green context (%s)", err)
        return None
    return context, context.Stream()  # the context is kept: its stream dies with it


def add_chunk_gradient(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor, write: bool, gemm_sums: bool) -> None:
    """Add one chunk's ``g.T @ h`` into the head's weight gradient ``grad_w`` (``write``: the GEMM writes it there;
    ``gemm_sums``: low-precision operands summed in ``grad_w``'s precision inside the GEMM)."""
    if write:
        torch.mm(g.t(), h, out_dtype=grad_w.dtype, out=grad_w)
    elif gemm_sums:
        torch.addmm(grad_w, g.t(), h, out_dtype=grad_w.dtype, out=grad_w)
    elif grad_w.dtype == h.dtype:
        grad_w.addmm_(g.t(), h)
    else:
        grad_w.add_(g.t() @ h)


class HeadGradientWork:
    """The head's weight-gradient GEMMs of the loss's last ``chunks`` ((logit gradient, hidden) pairs), added into
    ``grad_w`` on ``stream`` (``write``: the first one writes it). ``launch`` (the loss's backward) forks them onto the
    stream; ``result`` (the tied lookup's backward, the trunk backward's last op) joins it and returns the gradient.
    Inside a CUDA graph capture too: the stream joins the capture by waiting on the captured one. Every tensor it reads
    or writes was allocated on the trunk's stream and is referenced here until the join, so the allocator cannot hand
    its memory to other work while the side stream still uses it; a work forked but never joined (a backward that
    failed, or one that stopped short of the lookup) joins when it is freed, before its tensors are."""

    def __init__(self, grad_w, chunks, write: bool, gemm_sums: bool, vocab: int, dtype: torch.dtype,
                 stream: torch.cuda.Stream):
        self.grad_w, self.chunks, self.write, self.gemm_sums = grad_w, chunks, write, gemm_sums
        self.vocab, self.dtype, self.stream = vocab, dtype, stream
        self.grad_loss = None

    def launch(self, grad_loss: torch.Tensor) -> HeadGradientWork:
        self.stream.wait_stream(torch.cuda.current_stream(self.grad_w.device))
        with torch.cuda.stream(self.stream):
            for i, (g, h) in enumerate(self.chunks):
                add_chunk_gradient(self.grad_w, g, h, self.write and i == 0, self.gemm_sums)
            self.grad_w.mul_(grad_loss)
        self.grad_loss = grad_loss  # read on the side stream: kept until the join
        return self

    def result(self) -> torch.Tensor:
        torch.cuda.current_stream(self.grad_w.device).wait_stream(self.stream)
        self.chunks = self.grad_loss = None
        return self.grad_w[:self.vocab].to(self.dtype)

    def __del__(self) -> None:
        if self.grad_loss is not None:  # launched, never joined: later kernels on the trunk's stream wait for it
            torch.cuda.current_stream(self.grad_w.device).wait_stream(self.stream)
