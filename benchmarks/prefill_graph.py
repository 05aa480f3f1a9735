"""generate's compiled prefill launched against the same call replayed as one CUDA graph (CUDA only).

    python benchmarks/prefill_graph.py

For HYDRA and the dense baseline (100M, vocabulary 50,257, bf16 autocast without its weight cache) at 1 x 128
and 8 x 1,024: a random prompt prefilled into one persistent cache of 1,024 positions
(``forward_cached(..., compiled=True)``, the cache zeroed in place first), then that call captured with
``torch.cuda.graph`` and replayed; median of 10 calls each, and whether the replay's logits equal the launched
call's. A graph holds one (batch, prompt length, cache): this priced what a pool of cached prefill graphs could
gain (benchmarks/BENCHMARKS.md, forty-fifth session); ``generate`` now replays one per prompt-length bucket
(``hydra_lm.model.decode_session``).
"""

from __future__ import annotations

import statistics
import time

import torch

import hydra_lm
from hydra_lm.model.decode_session import cache_tensors


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _median_ms(fn, n: int = 10) -> float:
    return statistics.median(_seconds(fn) for _ in range(n)) * 1e3


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for arch in ("hydra", "dense"):
        model = hydra_lm.create_model("100M", vocab_size=50257, max_seq_len=1024, arch=arch).to(dev).eval()
        for b, t in ((1, 128), (8, 1024)):
            ids = torch.randint(0, 50257, (b, t), device=dev)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                caches = model.init_cache(b, 1024)
                tensors = cache_tensors(caches)

                def run(model=model, ids=ids, caches=caches, tensors=tensors):
                    for x in tensors:
                        x.zero_()
                    return model.forward_cached(ids, 0, caches, compiled=True)

                first = _seconds(run)
                for _ in range(3):
                    run()
                launched = _median_ms(run)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up on a side stream, as capture wants
                    for _ in range(2):
                        run()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                t0 = time.perf_counter()
                with torch.cuda.graph(graph):
                    out = run()
                capture = time.perf_counter() - t0
                replayed = _median_ms(graph.replay)
                graph.replay()
                torch.cuda.synchronize()
                same = torch.equal(out, run())
            print(f"{arch} {b} x {t}: first call {first:.1f} s, launched {launched:.2f} ms, "
                  f"capture {capture * 1e3:.0f} ms, replayed {replayed:.2f} ms "
                  f"({b * t / replayed * 1e3:,.0f} tokens/s), replay == launched: {same}", flush=True)


if __name__ == "__main__":
    main()
