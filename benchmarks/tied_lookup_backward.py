"""Ways to add a tied embedding lookup's gradient into the LM head's [V, E] gradient, timed on one GPU
(model/tied_lookup.py; benchmarks/BENCHMARKS.md, fifty-second session).

    python benchmarks/tied_lookup_backward.py [--rows 16384] [--vocab 50257] [--width 768]

Token ids uniform, Zipf-distributed (s = 1.1) and with one id taking 10% of the rows; for each way: microseconds
a call, the largest error against a float64 sum, whether two calls give the same bits, and whether a CUDA graph
can hold it. "dense" is what autograd does without the kernel (nn.Embedding's dense gradient, then the add)."""

import argparse

import torch

from hydra_lm.kernels.sorted_index_add import sorted_index_add_


def dense(out, ids, rows):
    out[: VOCAB].add_(torch.ops.aten.embedding_dense_backward(rows, ids, VOCAB, -1, False))
    return out


def index_put(out, ids, rows):  # sorted, then each id's rows summed one after another
    return out.index_put_((ids,), rows, accumulate=True)


def atomics(out, ids, rows):  # float atomics: fast, but the bits vary from call to call
    return out.index_add_(0, ids, rows)


def fixed_point(out, ids, rows):
    """Deterministic through int64 atomics: rows scaled to fixed point, summed per id at its first occurrence."""
    n = ids.numel()
    pos = torch.arange(n, device=ids.device)
    first = torch.full((out.shape[0],), n, dtype=torch.int64, device=ids.device).scatter_reduce_(0, ids, pos, "amin")
    rep = first[ids]
    amax = rows.abs().amax()
    _, exponent = torch.frexp((amax * n).clamp(min=2.0 ** -60))
    scale = torch.ldexp(torch.ones((), device=rows.device), 62 - exponent)
    acc = torch.zeros(rows.shape, dtype=torch.int64, device=rows.device).index_add_(
        0, rep, (rows * scale).round_().to(torch.int64))
    total = torch.where((rep == pos)[:, None], acc.to(rows.dtype) / scale, 0.0) + amax * 0
    return out.index_add_(0, ids, total)


def sorted_kernel(out, ids, rows):
    return sorted_index_add_(out, ids, rows)


WAYS = dict(dense=dense, index_put=index_put, atomics=atomics, fixed_point=fixed_point, sorted_kernel=sorted_kernel)


def token_ids(kind, rows, vocab, device):
    if kind == "uniform":
        return torch.randint(0, vocab, (rows,), device=device)
    if kind == "zipf":
        p = 1.0 / torch.arange(1, vocab + 1, device=device, dtype=torch.float64) ** 1.1
        return torch.multinomial(p / p.sum(), rows, replacement=True)
    ids = torch.randint(0, vocab, (rows,), device=device)
    ids[torch.rand(rows, device=device) < 0.1] = 220
    return ids


def microseconds(fn, out, ids, rows, reps=50):
    for _ in range(3):
        fn(out, ids, rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn(out, ids, rows)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def graph_holds(fn, out, ids, rows):
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(out, ids, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(out, ids, rows)
        graph.replay()
        torch.cuda.synchronize()
        return "yes"
    except RuntimeError as e:
        return f"no ({str(e).splitlines()[0][:40]})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16 * 1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()
    VOCAB = args.vocab
    torch.manual_seed(0)
    device = torch.device("cuda")
    print(f"{'ids':<14}{'way':<15}{'us':>9}{'max err':>11}{'same bits':>11}  graph")
    for kind in ("uniform", "zipf", "one_id_10pct"):
        ids = token_ids(kind, args.rows, args.vocab, device)
        rows = torch.randn(args.rows, args.width, device=device)
        exact = torch.zeros(args.vocab + 1, args.width, device=device, dtype=torch.float64).index_add_(
            0, ids, rows.double())
        for name, fn in WAYS.items():
            fresh = lambda: torch.zeros(args.vocab + 1, args.width, device=device)  # noqa: E731
            us = microseconds(fn, fresh(), ids, rows)
            a, b = fn(fresh(), ids, rows), fn(fresh(), ids, rows)
            err = (a.double() - exact).abs().max().item()
            print(f"{kind:<14}{name:<15}{us:>9.1f}{err:>11.2e}{str(torch.equal(a, b)):>11}  "
                  f"{graph_holds(fn, fresh(), ids, rows)}  (most frequent id: {torch.bincount(ids).max().item()} rows)")
