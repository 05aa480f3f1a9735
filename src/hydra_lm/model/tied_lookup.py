"""The tied embedding's lookup, whose gradient is added into the LM head's gradient in place.

With tied weights autograd sums two [V, E] gradients for the one matrix: the head's (the fused loss's) and the
lookup's, which ``nn.Embedding`` writes as a dense [V, E] tensor, zero but for the rows of the batch's tokens. At
vocabulary 50,257 and width 768 building that tensor and adding it took about 0.46 ms of a 27.5-ms step of the 100M
preset on an H200. Here the fused loss leaves its head gradient in a ``HeadGradientSlot`` (its backward runs first:
the loss is the last op of the forward) instead of returning it, and the lookup's backward adds each token's row
into it (``kernels/sorted_index_add.py``: deterministic, so a resumed run repeats the uninterrupted one bit for bit)
and returns it as the weight's one gradient from that forward. Autograd takes it as ``.grad`` without a copy, or
sums it with other forwards' as usual. The lookup returns what the loss handed over rather than the loss returning a
tensor the lookup later changes: autograd may already have summed that tensor into another forward's gradient by
then (tested: two forwards, one backward). A slot serves one forward. Without a head gradient in it (another loss
path) the lookup's backward is ``nn.Embedding``'s. The kernel's part takes about 0.1 ms there: +1.4% tokens/s
(benchmarks/BENCHMARKS.md, fifty-second session). Where the loss's backward left the head gradient's GEMMs running on
a side stream (model/head_gradient_overlap.py), the slot holds that work, and taking it joins the stream: the lookup's
backward, the trunk backward's last op, is where the overlap ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import TRITON_AVAILABLE


class HeadGradientSlot:
    """Where the fused loss's backward leaves the head's weight gradient for the tied lookup's backward; ``overlap``:
    whether the loss may leave the gradient's GEMMs running on a side stream (``head_gradient_overlap.applies``)."""

    def __init__(self, overlap: bool) -> None:
        self._grad: torch.Tensor | None = None
        self.overlap = overlap

    def put(self, grad) -> None:
        """``grad``: the gradient, or the work computing it on a side stream (a ``HeadGradientWork``)."""
        self._grad = grad

    def take(self) -> torch.Tensor | None:
        # Handed over, not kept: a second reference would stop autograd from taking the tensor as ``.grad`` without a
        # copy.
        grad, self._grad = self._grad, None
        return grad if grad is None or isinstance(grad, torch.Tensor) else grad.result()


def kernel_applies(weight: torch.Tensor) -> bool:
    """Whether the lookup's gradient goes into the head's through the Triton kernel: on CUDA with Triton, outside
    ``torch.compile`` (which traces the plain lookup and loss), for a plain tensor (not a DTensor shard), and not in
    float64, which the kernel would sum in fp32."""
    from torch.distributed.tensor import DTensor

    return (weight.is_cuda and weight.dtype != torch.float64 and TRITON_AVAILABLE
            and not torch.compiler.is_compiling() and not isinstance(weight, DTensor))


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, slot):
        ctx.save_for_backward(ids)
        ctx.slot, ctx.num_weights = slot, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        flat_ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        head = ctx.slot.take()
        if head is None:
            return None, torch.ops.aten.embedding_dense_backward(rows, flat_ids, ctx.num_weights, -1, False), None
        from ..kernels.sorted_index_add import sorted_index_add_  # imports Triton: only where the kernel runs

        return None, sorted_index_add_(head, flat_ids, rows.contiguous()), None


def tied_lookup(ids: torch.Tensor, weight: torch.Tensor, slot: HeadGradientSlot) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose backward adds into the head gradient that ``slot`` (one per forward, shared
    with that forward's loss) holds then."""
    return _TiedLookup.apply(ids, weight, slot)
