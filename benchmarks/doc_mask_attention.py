"""Document-masked attention alone, forward + backward at the 100M models' attention shapes (bf16, CUDA):
what the dense SDPA mask costs built inside the compiled call, passed in (boolean or additive), against
causal attention without documents, FlexAttention's block mask (built in the call, or once beforehand), torch's
varlen flash attention (sequences read on the host, or a fixed count of slots), and the fused kernels that take
the causal flag and the mask as a bias together (the efficient kernel's; cuDNN's is the model's own path), and
cuDNN's ragged attention (documents as sequences, a fixed count of slots, no mask read; 100-150x slower than the
model's path as called here, benchmarks/BENCHMARKS.md, sixty-ninth session).

    python benchmarks/doc_mask_attention.py [--batch_size 64 --seq_len 1024] [--only "model's" ragged]

Documents: 0-4 boundaries at random places in each row (packed documents, as the loader gives them).
Each SDPA variant is compiled alone at static shapes; the others run as called.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hydra_lm.model.doc_attention import Documents, _flex_doc_attention, dense_doc_mask, doc_causal_attention, documents
from muon_step_time import timed  # benchmarks/: the script's own directory is on the path


def packed_documents(batch: int, n: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    starts = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):
        cuts = torch.randint(1, n, (int(torch.randint(0, 5, (), generator=g)),), generator=g)
        starts[b, cuts] = 1
        starts[b, 0] = int(b > 0)  # ids differ between rows; only equality within a row matters
    return starts.flatten().cumsum(0).view(batch, n).to(device)


def varlen(q, k, v, doc):
    """torch.nn.attention.varlen.varlen_attn over the batch's documents as sequences (their count is read
    on the host, so this path has no fixed shape for CUDA graphs). Its kernels take as many key/value heads
    as query heads in torch 2.11 (no GQA argument): the grouped heads are repeated first, and timed."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, n, d = q.shape
    flat = doc.flatten()
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = (flat[1:] != flat[:-1]) | (torch.arange(1, b * n, device=doc.device) % n == 0)
    cu = torch.cat([start.nonzero().flatten(), torch.tensor([b * n], device=doc.device)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    k, v = repeated(q, k, v)
    rows = [t.transpose(1, 2).reshape(b * n, h, d) for t in (q, k, v)]
    out = varlen_attn(*rows, cu, cu, longest, longest, window_size=(-1, 0))
    return out.view(b, n, h, d).transpose(1, 2)


def varlen_slots(q, k, v, doc, slots: int):
    """varlen_attn with a fixed number of sequences (``slots``, empty ones padding; extra documents would merge
    into the last), built on the GPU: the static shapes a captured step needs."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, n, d = q.shape
    cu = slot_offsets(doc, slots)
    rows = [t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (q, k, v)]
    return varlen_attn(*rows, cu, cu, n, n, window_size=(-1, 0)).view(b, n, h, d).transpose(1, 2)


def slot_offsets(doc: torch.Tensor, slots: int) -> torch.Tensor:
    """Cumulative offsets [slots + 1] of the batch's documents (rows end to end, each row's first entry starting a
    document), built on the GPU: a fixed count of sequences, empty ones padding; extra documents merge into the last."""
    start = torch.ones_like(doc, dtype=torch.int32)
    start[:, 1:] = (doc[:, 1:] != doc[:, :-1]).to(torch.int32)
    seq = (start.reshape(-1).cumsum(0) - 1).clamp(max=slots - 1)
    counts = torch.zeros(slots, dtype=torch.int32, device=doc.device)
    counts.index_add_(0, seq, torch.ones_like(start).view(-1))
    return F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))


def cudnn_ragged(q, k, v, doc, slots: int, grouped: bool):
    """cuDNN's ragged attention (the op under SDPA's nested-tensor path): each document one causal sequence of the
    [B * N, h, d] entries, at ``slots`` sequences; no mask is read. ``grouped``: key/value heads passed as they are."""
    b, h, n, d = q.shape
    if not grouped:
        k, v = repeated(q, k, v)
    cu = slot_offsets(doc, slots)
    rows = [t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (q, k, v)]
    out = torch.ops.aten._cudnn_attention_forward(*rows, None, cu, cu, n, n, True, 0.0, True, False)[0]
    return out.view(b, n, h, d).transpose(1, 2)


def repeated(q, k, v):
    """k and v with their grouped heads repeated to q's count (kernels without grouped-query attention)."""
    return [t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v)]


def efficient_causal_bias(q, k, v, bias):
    """The efficient kernel with its causal mask type (it skips the tiles above the diagonal) and the mask as a bias."""
    k, v = repeated(q, k, v)
    out = torch.ops.aten._efficient_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      bias.expand(-1, q.shape[1], -1, -1), None, None, None, None,
                                                      0.0, 1, True)[0]
    return out.transpose(1, 2)


def flex_prebuilt(doc):
    """Compiled flex over the rows laid end to end, its block mask built once before the calls."""
    from torch.nn.attention.flex_attention import flex_attention

    from hydra_lm.model.doc_attention import _end_to_end, doc_block_mask, documents_end_to_end

    kernel, block_mask = torch.compile(flex_attention, dynamic=False), doc_block_mask(documents_end_to_end(doc))

    def call(q, k, v):
        b, h, n, d = q.shape
        out = kernel(_end_to_end(q), _end_to_end(k), _end_to_end(v), block_mask=block_mask, enable_gqa=True)
        return out[0].reshape(h, b, n, d).transpose(0, 1)
    return call


def time_variant(fn, q, k, v, grad) -> float:
    """Mean milliseconds of forward + backward after three warm-up calls."""
    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward(grad)
    return timed(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--only", nargs="*", default=[], help="run the variants whose label holds one of these words")
    args = p.parse_args()
    dev = torch.device("cuda")
    doc = packed_documents(args.batch_size, args.seq_len, dev)
    bool_mask, additive = dense_doc_mask(doc), documents(doc, torch.bfloat16).mask
    def sdpa(**kw):
        return torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw))

    variants = {
        "mask built inside": torch.compile(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense_doc_mask(doc), enable_gqa=True)),
        "bool mask passed in": sdpa(attn_mask=bool_mask),
        "bf16 additive mask passed in": sdpa(attn_mask=additive),
        "causal, no documents": sdpa(is_causal=True),
        "flex block mask": lambda q, k, v: _flex_doc_attention(q, k, v, doc),
        "flex, block mask built once": flex_prebuilt(doc),
        "varlen flash (eager)": lambda q, k, v: varlen(q, k, v, doc),
        "varlen flash, 4 slots a row": lambda q, k, v: varlen_slots(q, k, v, doc, 4 * args.batch_size),
        "efficient, causal + bias": lambda q, k, v: efficient_causal_bias(q, k, v, additive),
        "the model's path (cuDNN)": lambda q, k, v: doc_causal_attention(q, k, v, Documents(doc, additive)),
        "cuDNN ragged, 4 slots a row": lambda q, k, v: cudnn_ragged(q, k, v, doc, 4 * args.batch_size, False),
        "cuDNN ragged, grouped heads": lambda q, k, v: cudnn_ragged(q, k, v, doc, 4 * args.batch_size, True),
    }
    variants = {label: fn for label, fn in variants.items() if not args.only or any(w in label for w in args.only)}
    shapes = (("CCGQA latent (6 / 2 heads, 32 dims)", 6, 2, 32), ("dense (12 / 3 heads, 64 dims)", 12, 3, 64))
    for name, h, hk, d in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(args.batch_size, n_h, args.seq_len, d, device=dev, dtype=torch.bfloat16, generator=g)
                   for n_h in (h, hk, hk))
        grad = torch.randn_like(q)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True).float()
        print(f"{name}: forward + backward ms, and the output's largest error against SDPA with the boolean mask")
        for label, fn in variants.items():
            try:
                err = (fn(q, k, v).float() - ref).abs().max().item()
                print(f"  {label:<30} {time_variant(fn, q, k, v, grad):7.3f} ms  {err:.1e}", flush=True)
            except Exception as e:  # e.g. a torch without varlen_attn
                print(f"  {label:<30} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
