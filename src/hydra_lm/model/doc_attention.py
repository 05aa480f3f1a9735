"""Causal attention that stays inside a document (rows packing several documents).

Two ways to compute the same function, chosen per model by ``HydraConfig.doc_mask_backend``
(``--model.doc_mask_backend`` on the command line):

* ``"sdpa"``: a dense [B, 1, N, N] additive mask, built once per set of entries (``Documents``) and shared
  by the layers and units that attend over them. Runs anywhere at O(N^2) memory per row. SDPA takes a mask
  or its causal flag, not both, and with a mask it computes every tile of the scores (2.2x the causal
  kernel's time on an H100); on Hopper cuDNN's op is called directly with both, so the tiles above the
  diagonal are skipped: 0.69x the time of SDPA's masked call, +1.3-1.5% for the HYDRA bench step and
  +5.3-5.8% for dense (benchmarks/BENCHMARKS.md, sixty-eighth session);
* ``"flex"``: FlexAttention with a block-sparse mask derived from the document ids: blocks above
  the diagonal or between different documents are skipped, blocks inside one document run without
  a mask. The batch's rows are laid end to end as one sequence (batch 1) with document ids that
  differ between rows, so the mask reads a one-dimensional tensor: with [B, N] ids indexed by the
  batch, torch 2.11's compiled flex kernel on an H100 gave wrong outputs (errors of order 1) or
  crashed ("operation not supported on global/shared address space"), like upstream issues
  pytorch/pytorch#175545 and #172225. Fused when compiled (traced with the model, or compiled on its
  own on CUDA); eager CPU code runs flex unfused, which materialises the scores.
* ``"auto"`` (default): the dense mask. Flex is exact and faster: 3-6% for a whole training step of the
  100M models on an H100 (benchmarks/BENCHMARKS.md, seventeenth session), 4.1-4.5% of the bench's and the
  trainer's tokens/s at 100M on an H200 and an H100 (sixty-first to sixty-third), all against SDPA's masked call:
  the cuDNN call with the causal flag has since won 1.3-1.5% of it back for HYDRA (sixty-eighth; flex not
  re-measured against it). torch 2.11 failed to lower flex inside units compiled with dynamic token counts
  (evaluation's, a MoR ramp's, and in compiled training every block without routing: a dense model's layers,
  middle-cycle's first and last), so those take the dense mask (``block._run_compiled_unit``), built per unit
  call; with that the trainer's flex GPU test passes (sixty-second). For the dense baseline flex thus buys
  nothing in compiled training. Flex stays opt-in for its cold compile: 200 s and more against
  115-120 s for the preset on an H100 (sixty-third), also when only rows of 512 entries or more took flex, so the
  extra time is not the routed rows' kernels.

A routed unit (MoD/MoR) attends over a compacted subset of the row; its ``doc`` is the documents of
the entries present, in their order, so "causal" is over the compacted index.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import DOC_MASK_BACKENDS

FLEX_BLOCK = 128  # FlexAttention's default tile; the block mask is built at this granularity


# torch 2.11's compiled flex kernel rejects smaller heads ("embedding dimension ... must be at least 16").
FLEX_MIN_HEAD_DIM = 16


def resolve_doc_mask_backend(backend: str, device: torch.device | str, head_dim: int) -> str:
    """The path a document-masked attention call on ``device`` with heads of ``head_dim`` takes for
    ``HydraConfig.doc_mask_backend``: "flex" or "sdpa"."""
    if backend not in DOC_MASK_BACKENDS:
        raise ValueError(f"document-mask backend {backend!r}: choose one of {list(DOC_MASK_BACKENDS)}")
    cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        return "sdpa"
    if backend == "flex" and cuda and head_dim < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"doc_mask_backend 'flex' on CUDA needs heads of at least {FLEX_MIN_HEAD_DIM} "
                         f"dimensions, this model's have {head_dim}: use 'auto' or 'sdpa', or a larger head_dim")
    return backend


def dense_doc_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, 1, N, N] bool: entry i may attend to entry j <= i of the same document."""
    n = doc.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


class Documents(NamedTuple):
    """The documents of a row's entries, or of a routed unit's compacted entries: ``ids`` [B, N] and, for
    the dense-mask backend, ``mask``: SDPA's additive mask [B, 1, N, N] (0 where ``dense_doc_mask`` allows,
    -inf elsewhere) in the attention's dtype, built once from ``ids`` outside the compiled units, so that
    every layer and unit attending over the same entries shares it. Built inside each compiled unit it
    took ~0.7 ms per unit and step at batch 64 x 1024 on an H100 (the same kernel compiled alone at static
    shapes: 0.08 ms; benchmarks/BENCHMARKS.md, twenty-sixth session). ``mask`` is None for flex."""
    ids: torch.Tensor
    mask: torch.Tensor | None

    def gather(self, order: torch.Tensor) -> Documents:
        """The documents of the entries ``order`` [B, k] picks, their mask rebuilt for them."""
        return documents(self.ids.gather(1, order), None if self.mask is None else self.mask.dtype)


def documents(ids: torch.Tensor, mask_dtype: torch.dtype | None) -> Documents:
    """``Documents`` of ``ids`` [B, N], with the additive mask in ``mask_dtype`` (None: no mask, flex)."""
    if mask_dtype is None:
        return Documents(ids, None)
    zero = torch.zeros((), dtype=mask_dtype, device=ids.device)
    return Documents(ids, torch.where(dense_doc_mask(ids), zero, zero - float("inf")))


def documents_for(ids: torch.Tensor, backend: str, head_dim: int, dtype: torch.dtype) -> Documents:
    """``Documents`` of a forward's ``ids`` [B, N] for ``HydraConfig.doc_mask_backend`` ``backend``:
    the mask in the dtype SDPA will run in (autocast's when it is on, else ``dtype``, the activations')."""
    if resolve_doc_mask_backend(backend, ids.device, head_dim) != "sdpa":
        return documents(ids, None)
    device = ids.device.type
    return documents(ids, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nq, nk] bool -> (count per query block, kv block indices with the selected ones first)."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def doc_block_mask(doc: torch.Tensor, block: int = FLEX_BLOCK):
    """FlexAttention BlockMask for "causal and same document" over the entries of ``doc`` [B, N].

    Tiles are classified from each tile's smallest and largest document id (O((N/block)^2), not
    O(N^2)): disjoint ranges -> skipped; one and the same document in both tiles, strictly below
    the diagonal -> full (no mask evaluated); anything else -> the mask is evaluated per entry.
    The classification is conservative, so it is correct for any ids; with the loader's
    non-decreasing ids it is also tight.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, n = doc.shape
    nb = -(-n // block)
    # Pad by repeating the last id: padded entries never make a tile look mixed, and the mask
    # function may index past N (padded query/key rows are discarded by the kernel).
    padded = torch.cat((doc, doc[:, -1:].expand(b, nb * block - n)), dim=1)
    tiles = padded.view(b, nb, block)
    lo, hi = tiles.amin(-1), tiles.amax(-1)
    q_tile = torch.arange(nb, device=doc.device)[:, None]
    k_tile = torch.arange(nb, device=doc.device)[None, :]
    overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    single = lo == hi
    full = (k_tile < q_tile) & single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    partial = overlap & (k_tile <= q_tile) & ~full

    def same_doc_causal(b_idx, h_idx, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (padded[b_idx, q_idx] == padded[b_idx, kv_idx])

    count, index = _ordered(partial)
    full_count, full_index = _ordered(full)
    return BlockMask.from_kv_blocks(count, index, full_count, full_index, BLOCK_SIZE=block,
                                    mask_mod=same_doc_causal, seq_lengths=(n, n))


def _end_to_end(t: torch.Tensor) -> torch.Tensor:
    """[B, h, N, d] -> [1, h, B * N, d], the rows laid end to end (a view when ``t`` is a transposed
    [B, N, h, d], as the attention modules make them)."""
    b, h, n, d = t.shape
    return t.transpose(0, 1).reshape(1, h, b * n, d)


def documents_end_to_end(ids: torch.Tensor) -> torch.Tensor:
    """Document ids [B, N] -> [1, B * N]: the rows laid end to end, each row's ids moved past the previous row's so
    that no two rows share a document (non-decreasing where each row's are). In int64: the offsets grow with the
    rows times the ids' range, which a caller's int32 ids of large values would overflow."""
    ids = ids.long()
    row = torch.arange(ids.shape[0], device=ids.device)[:, None]
    return ((ids - ids.amin()) + row * (ids.amax() - ids.amin() + 1)).reshape(1, -1)


def _flex_doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Flex over the batch's rows laid end to end as one sequence, with each row's document ids moved past
    the previous row's, so "causal and the same document" also keeps rows apart. The mask then reads a
    one-dimensional tensor: with the [B, N] ids indexed by the batch, the compiled CUDA kernel gave wrong
    results on torch 2.11 (module docstring). Tiles across rows fall in no document and are skipped."""
    b, h, n, _ = q.shape
    out = _flex(q)(_end_to_end(q), _end_to_end(k), _end_to_end(v), block_mask=doc_block_mask(documents_end_to_end(doc)),
                   enable_gqa=h != k.shape[1])
    return out[0].reshape(h, b, n, v.shape[-1]).transpose(0, 1)


def _flex(q: torch.Tensor):
    """flex_attention, compiled on CUDA outside a compiled region: unfused it would materialise the scores
    of the whole end-to-end batch ([h, B*N, B*N])."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if not q.is_cuda or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        # A graph per batch x entries shape: a run's curriculum phases and evaluation give flex a few dozen (24 at
        # the 100M preset), past Dynamo's default limit of 8, after which it would run unfused, silently.
        _compiled_flex = torch._dynamo.config.patch(recompile_limit=64)(torch.compile(flex_attention, dynamic=False))
    return _compiled_flex


_compiled_flex = None

# Off while ``attention_backend.sdpa_kernel_only`` forces an SDPA kernel other than cuDNN (``bench --sdpa_kernel``),
# so that the direct cuDNN call below obeys it too. A module global, not SDPA's own switch: Dynamo cannot trace
# that query, and a compiled graph guards on this value.
cudnn_causal_bias_allowed = True


def _cudnn_skips_the_future(q: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether cuDNN's attention op can take the causal flag and ``mask`` together: SDPA accepts one or the
    other, and with the mask alone cuDNN computes every tile of the N x N scores. Hopper or later (where SDPA
    itself prefers cuDNN), a half-precision mask (cuDNN runs no fp32; given fp32 it returned NaN, so fp32
    stays with SDPA), heads of 8 to 128 dimensions in steps of 8, rows of 16 entries or more in steps of 8
    (the bias's row stride), with gradients on and ``cudnn_causal_bias_allowed``. Evaluation keeps SDPA: its
    units are compiled once for every token count (2 to the row length), and the test of the count would
    split that graph in two."""
    n, d = q.shape[2], q.shape[3]
    return (q.is_cuda and torch.is_grad_enabled() and mask.dtype in (torch.float16, torch.bfloat16)
            and d % 8 == 0 and d <= 128 and n >= 16 and n % 8 == 0
            and torch.cuda.get_device_capability(q.device)[0] >= 9 and cudnn_causal_bias_allowed)


def _cudnn_causal_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cuDNN's attention with its causal mask (tiles above the diagonal skipped) and the documents' additive
    ``mask`` as a bias, keeping the log-sum-exp for backward (the call is made with gradients on). The op sits below
    SDPA's autocast, so q, k, v are cast to the mask's dtype here."""
    q, k, v = (t.to(mask.dtype) for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, True, 0.0, True, False)[0]


def doc_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: Documents) -> torch.Tensor:
    """Causal attention within documents. q [B, h_q, N, d]; k, v [B, h_k, N, d]; ``doc``: the entries'
    documents, with the dense mask (SDPA) or without (flex; ``documents_for`` chose)."""
    if doc.mask is not None:
        if _cudnn_skips_the_future(q, doc.mask):
            return _cudnn_causal_with_bias(q, k, v, doc.mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=doc.mask, enable_gqa=q.shape[1] != k.shape[1])
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # SDPA casts to the autocast dtype itself; flex does not, and q/k leave the fp32 norms in fp32.
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _flex_doc_attention(q, k, v, doc.ids)
