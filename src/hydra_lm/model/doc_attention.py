"""Causal attention that stays inside a document (rows packing several documents).

Two ways to compute the same function, chosen per model by ``HydraConfig.doc_mask_backend``
(``--model.doc_mask_backend`` on the command line):

* ``"sdpa"``: a dense [B, 1, N, N] boolean mask for SDPA. Runs anywhere, but a mask rules out
  SDPA's flash kernel and costs O(N^2) memory per row;
* ``"flex"``: FlexAttention with a block-sparse mask derived from the document ids: blocks above
  the diagonal or between different documents are skipped, blocks inside one document run without
  a mask. Fused only when compiled (traced with the model); eager code runs flex unfused, which
  materialises the scores.
* ``"auto"`` (default): the dense mask. On CUDA the flex path is refused: with torch 2.11 on an
  H100 the compiled flex kernel whose mask reads the document ids gave wrong outputs (errors of
  order 1, also with torch's own ``create_block_mask``) or crashed ("operation not supported on
  global/shared address space"), like upstream issue pytorch/pytorch#175545 (captured tensors in a
  mask_mod). The GPU test that shows it is an expected failure; flex runs on CPU, where it is exact.

A routed unit (MoD/MoR) attends over a compacted subset of the row; its ``doc`` is the documents of
the entries present, in their order, so "causal" is over the compacted index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DOC_MASK_BACKENDS

FLEX_BLOCK = 128  # FlexAttention's default tile; the block mask is built at this granularity


def resolve_doc_mask_backend(backend: str, device: torch.device | str) -> str:
    """The path a document-masked attention call on ``device`` takes for ``HydraConfig.doc_mask_backend``:
    "flex" or "sdpa"."""
    if backend not in DOC_MASK_BACKENDS:
        raise ValueError(f"document-mask backend {backend!r}: choose one of {list(DOC_MASK_BACKENDS)}")
    if backend == "flex" and torch.device(device).type == "cuda":
        raise ValueError("FlexAttention document masks are disabled on CUDA: with torch 2.11 the compiled flex "
                         "kernel reading document ids gave wrong results on an H100 (see model/doc_attention.py); "
                         "use the dense mask: HydraConfig.doc_mask_backend='sdpa' (--model.doc_mask_backend sdpa)")
    return "sdpa" if backend == "auto" else backend


def dense_doc_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, 1, N, N] bool: entry i may attend to entry j <= i of the same document."""
    n = doc.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


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


def _flex_doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=doc_block_mask(doc), enable_gqa=q.shape[1] != k.shape[1])


def doc_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor,
                         backend: str = "auto") -> torch.Tensor:
    """Causal attention within documents. q [B, h_q, N, d]; k, v [B, h_k, N, d]; doc [B, N];
    ``backend``: ``HydraConfig.doc_mask_backend``."""
    if resolve_doc_mask_backend(backend, q.device) == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_doc_mask(doc),
                                              enable_gqa=q.shape[1] != k.shape[1])
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # SDPA casts to the autocast dtype itself; flex does not, and q/k leave the fp32 norms in fp32.
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _flex_doc_attention(q, k, v, doc)
