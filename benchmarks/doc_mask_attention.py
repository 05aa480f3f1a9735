"""Document-masked attention alone, forward + backward at the 100M models' attention shapes (bf16, CUDA):
what the dense SDPA mask costs built inside the compiled call, passed in (boolean or additive), against
causal attention without documents, FlexAttention's block mask and torch's varlen flash attention.

    python benchmarks/doc_mask_attention.py [--batch_size 64 --seq_len 1024]

Documents: 0-4 boundaries at random places in each row (packed documents, as the loader gives them).
Each SDPA variant is compiled alone at static shapes; flex and varlen run as called.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hydra_lm.model.doc_attention import _flex_doc_attention, dense_doc_mask, documents
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
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    rows = [t.transpose(1, 2).reshape(b * n, h, d) for t in (q, k, v)]
    out = varlen_attn(*rows, cu, cu, longest, longest, window_size=(-1, 0))
    return out.view(b, n, h, d).transpose(1, 2)


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
        "varlen flash (eager)": lambda q, k, v: varlen(q, k, v, doc),
    }
    shapes = (("CCGQA latent (6 / 2 heads, 32 dims)", 6, 2, 32), ("dense (12 / 3 heads, 64 dims)", 12, 3, 64))
    for name, h, hk, d in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(args.batch_size, n_h, args.seq_len, d, device=dev, dtype=torch.bfloat16, generator=g)
                   for n_h in (h, hk, hk))
        grad = torch.randn_like(q)
        print(name)
        for label, fn in variants.items():
            try:
                print(f"  {label:<30} {time_variant(fn, q, k, v, grad):7.3f} ms", flush=True)
            except Exception as e:  # e.g. a torch without varlen_attn
                print(f"  {label:<30} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
