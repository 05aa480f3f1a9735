"""Alternatives for two pieces of the training step, each compiled alone and timed from a CUDA graph of 20 calls
(us a call; needs CUDA):

- the fused loss's chunk (``model/loss._chunk_loss_and_grad``, 4,096 rows x vocabulary 50,257, bf16) against the
  same chunk written as inductor's softmax pattern (max, exp of the difference, sum), which inductor can lower to an
  online softmax, and against the GEMM and the Triton row kernel that CUDA runs (kernels/cross_entropy_rows.py);
- the routers' top-k boundary (``model/routing.topk_boundary``, the batch's (b*k)-th and (b*k+1)-th logits) as a
  sorted top-k of b*k+1 (the form before the forty-first session), an unsorted top-k, a full sort (the form
  since), two ``kthvalue`` calls, and the per-row selection's order (a top-k, then a sort of the indices) against
  one from the chosen mask's running count or from its nonzeros (``torch.nonzero_static``), or from a sort of the
  whole row, also at the few long rows of ``topk_groups`` (4 x 4,096 for 16 rows in groups of 4).

Each variant's result is checked against the first one's: a ``(!)`` marks a mismatch.

    python benchmarks/selection_variants.py
"""

from __future__ import annotations

import torch

from graph_timing import us_per_call  # this folder's helper (the script's folder is on sys.path)

from hydra_lm.kernels.cross_entropy_rows import cross_entropy_rows
from hydra_lm.model.loss import _chunk_loss_and_grad


def chunk_softmax_pattern(h, w, t, valid, row_scale, vocab: int, need_grad: bool):
    """``_chunk_loss_and_grad`` (compiled branch) with the log-sum-exp spelled as max, exp, sum."""
    acc_dtype = row_scale.dtype
    safe_t = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
    logits = (h @ w.t()).to(acc_dtype)
    logits[:, vocab:] = float("-inf")
    top = logits.amax(1, keepdim=True)
    e = (logits - top).exp()
    total = e.sum(1, keepdim=True)
    lse = (top + total.log()).squeeze(1)
    part = torch.where(valid, lse - logits.gather(1, safe_t).squeeze(1), torch.zeros_like(lse)).sum()
    hit = torch.arange(logits.shape[1], device=logits.device) == safe_t
    return part, ((e / total - hit.to(acc_dtype)) * row_scale).to(h.dtype)


def chunk_row_kernel(h, w, t, valid, row_scale, vocab: int, need_grad: bool):
    """The chunk as ``loss._chunked_pass`` runs it on CUDA: the GEMM, then the row kernel."""
    scale = row_scale.max()  # every valid row's scale (1 / rows here)
    rows, g = cross_entropy_rows(h @ w.t(), torch.where(valid, t, -100), scale, vocab, -100, need_grad)
    return rows.sum(), g


def boundary_sorted_topk(r, k):
    top = torch.topk(r.reshape(-1), r.shape[0] * k + 1, sorted=True).values
    return 0.5 * (top[-2] + top[-1])


def boundary_unsorted_topk(r, k):
    top = torch.topk(r.reshape(-1), r.shape[0] * k + 1, sorted=False).values
    two = torch.topk(top, 2, largest=False, sorted=True).values
    return 0.5 * (two[0] + two[1])


def boundary_sort(r, k):
    top = torch.sort(r.reshape(-1), descending=True).values
    return 0.5 * (top[r.shape[0] * k - 1] + top[r.shape[0] * k])


def boundary_kthvalue(r, k):
    flat = r.reshape(-1)
    below = flat.shape[0] - r.shape[0] * k  # logits outside the b*k highest
    return 0.5 * (torch.kthvalue(flat, below).values + torch.kthvalue(flat, below + 1).values)


def order_by_sort(r, k):
    return torch.sort(torch.topk(r, k, dim=1, sorted=False).indices, dim=1).values


def order_by_full_sort(r, k):
    """The k highest of each row from a sort of the whole row (segmented, several blocks a row), not a top-k (one
    block a row on CUDA): the pooled rows of ``topk_groups`` are few and long ([4, 4,096] at the 100M preset)."""
    return torch.sort(torch.sort(r, dim=1, descending=True).indices[:, :k], dim=1).values


def order_by_count(r, k):
    chosen = torch.zeros_like(r, dtype=torch.bool).scatter_(1, torch.topk(r, k, dim=1, sorted=False).indices, True)
    c = chosen.long()
    before = c.cumsum(1) - c  # chosen entries before each one
    i = torch.arange(r.shape[1], device=r.device)
    slot = torch.where(chosen, before, c.sum(1, keepdim=True) + i - before)  # a permutation: chosen ones first
    return torch.empty_like(c).scatter_(1, slot, i.expand_as(c))[:, :k]


def order_by_nonzero(r, k):
    chosen = torch.zeros_like(r).scatter_(1, torch.topk(r, k, dim=1, sorted=False).indices, 1.0)
    # Every row holds k chosen columns, so the mask's nonzeros, row by row, are each row's order.
    return torch.nonzero_static(chosen, size=r.shape[0] * k)[:, 1].view(r.shape[0], k)


def main() -> None:
    torch._dynamo.config.recompile_limit = 1000
    compile_ = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)  # noqa: E731
    dev, rows, width, vocab, padded = "cuda", 4096, 768, 50257, 50304
    h = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
    w = torch.randn(padded, width, device=dev, dtype=torch.bfloat16) * 0.05
    w[vocab:] = 0
    t = torch.randint(0, vocab, (rows,), device=dev)
    valid = torch.rand(rows, device=dev) > 0.01
    row_scale = (valid.float() / rows).unsqueeze(1)
    args = (h, w, t, valid, row_scale, vocab, True)
    base, pattern = compile_(_chunk_loss_and_grad), compile_(chunk_softmax_pattern)
    diff = (base(*args)[1].float() - pattern(*args)[1].float()).abs().max().item()
    loss_diff = (base(*args)[0] - chunk_row_kernel(*args)[0]).abs().item()
    kernel_diff = (base(*args)[1].float() - chunk_row_kernel(*args)[1].float()).abs().max().item()
    print(f"loss chunk: GEMM alone {us_per_call(lambda: h @ w.t()):.1f} us, logsumexp form "
          f"{us_per_call(lambda: base(*args)):.1f} us, softmax pattern {us_per_call(lambda: pattern(*args)):.1f} us "
          f"(largest gradient difference {diff:.1e}), row kernel {us_per_call(lambda: chunk_row_kernel(*args)):.1f} "
          f"us (loss difference {loss_diff:.1e}, largest gradient difference {kernel_diff:.1e})")
    boundaries = {"sorted top-k": boundary_sorted_topk, "unsorted top-k": boundary_unsorted_topk,
                  "sort": boundary_sort, "kthvalue": boundary_kthvalue}
    orders = {"order: sort": order_by_sort, "order: full sort": order_by_full_sort, "order: count": order_by_count,
              "order: nonzero": order_by_nonzero}
    # The last two: a batch of 16 rows pooled in 4 groups (topk_groups 4), at the full rows' and the 128-entry units'.
    for b, n in ((16, 1024), (16, 512), (16, 256), (16, 128), (64, 1024), (4, 4096), (4, 512)):
        r = torch.randn(b, n, device=dev)
        for k in (n // 8, n // 2):
            cells = []
            for group in (boundaries, orders):
                first = None
                for name, fn in group.items():
                    fn = compile_(fn)
                    value = fn(r, k)
                    first = value if first is None else first
                    try:  # a form that syncs with the host cannot be captured in the timing graph
                        us = f"{us_per_call(lambda fn=fn, r=r, k=k: fn(r, k)):6.1f}"
                    except RuntimeError as err:
                        us = f"not capturable ({str(err).splitlines()[0][:60]})"
                    cells.append(f"{name} {us}{'' if torch.equal(value, first) else '(!)'}")
            print(f"batch {b} x {n}, k {k}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
