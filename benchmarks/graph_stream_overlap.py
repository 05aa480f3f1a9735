"""Whether large GEMMs on a second stream overlap a chain of small kernels inside one CUDA graph.

The routed units of a few tokens leave most of an H100 idle while their kernels run one after another, so one
idea for the training step is to move independent large work (the LM head's weight-gradient GEMMs, about 1.7 ms
of the 100M preset's step) onto a side stream beside the trunk's backward. This measures the mechanism alone: a
chain of ``--chain`` small GEMM + tanh kernels (32 tokens of width 768, like a deep unit) on the main stream, four
head-gradient GEMMs ([50,304 x 4,096] x [4,096 x 768], bf16 in, fp32 accumulated into the output, as the fused
loss runs them) on a side stream, each alone and both at once, eagerly and replayed from a CUDA graph, with the
main stream at the default priority and at a higher one (the side stream stays at the default), and with the
side stream in a green context of ``--green_sms`` SMs (``torch.cuda.green_contexts``: the GEMMs kept off the other
SMs). If the two overlapped, "both" would take about the longer of the two alone; without overlap, their sum.
``--side_work adamw`` puts memory-bound work on the side stream instead: a fused, capturable AdamW step over the
100M preset's parameter count (98.6M fp32 values), the update a step could overlap with the next one's forward.

    python benchmarks/graph_stream_overlap.py --green_sms 66 100 116 [--side_work adamw]
"""

from __future__ import annotations

import argparse
import time

import torch


def ms_per_call(fn, stream: torch.cuda.Stream, graphed: bool, repeats: int) -> float:
    """``fn`` on ``stream``: two warm-up calls, then (``graphed``) captured once and replayed; ms a call."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        run = fn
        if graphed:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                fn()
            run = graph.replay
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain", type=int, default=300, help="small kernels on the main stream")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--green_sms", type=int, nargs="*", default=[],
                        help="side streams in green contexts of so many SMs each")
    parser.add_argument("--side_work", choices=["gemms", "adamw"], default="gemms")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_stream_overlap.py times CUDA streams and graphs: it needs a CUDA GPU")
    torch.manual_seed(0)
    dev = "cuda"
    logit_grads = torch.randn(4096, 50304, device=dev, dtype=torch.bfloat16)
    hidden = torch.randn(4096, 768, device=dev, dtype=torch.bfloat16)
    head_grad = torch.empty(50304, 768, device=dev, dtype=torch.float32)
    x0 = torch.randn(32, 768, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(768, 768, device=dev, dtype=torch.bfloat16) * 0.03
    sides, contexts = {"plain": torch.cuda.Stream(priority=0)}, []
    for sms in args.green_sms:
        from torch.cuda.green_contexts import GreenContext

        contexts.append(GreenContext.create(num_sms=sms))  # kept: its streams die with it
        sides[f"green {sms}"] = contexts[-1].Stream()

    def chain():
        x = x0
        for _ in range(args.chain):
            x = torch.tanh(x @ weight)
        return x

    def gemms():
        for _ in range(4):
            torch.addmm(head_grad, logit_grads.t(), hidden, out_dtype=torch.float32, out=head_grad)

    side_work = gemms
    if args.side_work == "adamw":  # the preset's parameters as its tensors are sized: a [50,304 x 768] head, the rest
        sizes = [50304 * 768] + [768 * 768] * 102  # about 98.6M values in all
        params = [torch.zeros(n, device=dev, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=dev), fused=True, capturable=True)
        optimizer.step()  # its state, before any capture
        side_work = optimizer.step

    def both(side):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                side_work()
            y = chain()
            torch.cuda.current_stream().wait_stream(side)
            return y
        return run

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, stream priorities "
          f"{torch.cuda.Stream.priority_range()}")
    print(f"{'form':<9}{'side stream':>12}{'main priority':>14}{'chain ms':>10}{args.side_work + ' ms':>10}"
          f"{'both ms':>9}{'overlap':>9}")
    for graphed in (True, False):
        for name, side in sides.items():
            for priority in (0, -1) if name == "plain" else (0,):
                main_stream = torch.cuda.Stream(priority=priority)
                chain_ms = ms_per_call(chain, main_stream, graphed, args.repeats)
                side_ms = ms_per_call(side_work, side, graphed, args.repeats)
                together = ms_per_call(both(side), main_stream, graphed, args.repeats)
                # 1: both took the longer of the two alone (full overlap); 0: their sum (none)
                overlap = (chain_ms + side_ms - together) / min(chain_ms, side_ms)
                print(f"{'graphed' if graphed else 'eager':<9}{name:>12}{priority:>14}{chain_ms:>10.3f}"
                      f"{side_ms:>10.3f}{together:>9.3f}{overlap:>9.2f}")


if __name__ == "__main__":
    main()
