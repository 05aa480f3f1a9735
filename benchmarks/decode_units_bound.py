"""How fast a routed model can decode against its dense baseline, from its routing alone (no GPU).

At decode batch sizes a routed unit and a dense layer are both latency-bound: on an H200 the fifty-second session
put a 100M unit at about 43-55 us and a dense layer at about the same. So a step's cost is, in layer units, the
units it runs plus the head, and the ratio of tokens/s follows from the routing's fractions. Two schedules:

- lockstep (what ``generate`` runs): every row decodes one token a step; a unit runs when any row's token enters
  it. Units per step = the expected number of (block, depth) units that at least one of B tokens enters.
- depth-wise batching across steps (the MoR paper's serving loop): rows advance independently; in each tick every
  block runs at most once, on all rows that stand at it (any depth: its weights are shared), in block order, so a
  row moves through as many blocks a tick as it can, and waits a tick for each extra depth of one block. A row whose
  token finished samples at the tick's end (the head runs once a tick) and starts its next token the tick after.

Tokens' routes are drawn independently with each depth's fraction of the row (the model's own ``fractions()``).

    python benchmarks/decode_units_bound.py --model_size 100M --batches 1,8,32,128
"""

from __future__ import annotations

import argparse
import random

import torch

import hydra_lm


def unit_fractions(model_size: str) -> list[list[float]]:
    """Each block's fraction of the row per depth (expert-choice top-k's, which causal routing targets)."""
    with torch.device("meta"):
        model = hydra_lm.create_model(model_size, vocab_size=8192)
    return [block.fractions() for block in model.blocks]


def route(blocks: list[list[float]], rng: random.Random) -> list[tuple[int, int]]:
    """One token's units, in order: (block, depth)."""
    units = []
    for b, fractions in enumerate(blocks):
        previous = 1.0
        for d, frac in enumerate(fractions):
            if rng.random() >= frac / previous:
                break
            units.append((b, d))
            previous = frac
    return units


def lockstep_units_per_step(blocks: list[list[float]], batch: int) -> float:
    """Expected units a step runs: each unit that at least one of ``batch`` tokens enters (exact)."""
    return sum(1 - (1 - frac) ** batch for fractions in blocks for frac in fractions)


def depthwise_tokens_per_cost(blocks: list[list[float]], batch: int, head: float, tokens: int, seed: int) -> float:
    """Tokens per layer-unit of cost with depth-wise batching across steps (simulated)."""
    rng = random.Random(seed)
    rows = [route(blocks, rng) for _ in range(batch)]
    at = [0] * batch
    done, cost = 0, 0.0
    while done < tokens:
        ran = set()  # (row, block) run this tick: a row's next depth of the same block waits for the next tick
        for b in range(len(blocks)):
            hit = False
            for r in range(batch):
                if at[r] < len(rows[r]) and rows[r][at[r]][0] == b and (r, b) not in ran:
                    ran.add((r, b))
                    at[r] += 1
                    hit = True
            cost += hit
        cost += head
        for r in range(batch):
            if at[r] >= len(rows[r]):
                done += 1
                rows[r], at[r] = route(blocks, rng), 0
    return done / cost


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_size", default="100M")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--dense_layers", type=int, default=None, help="default: the preset's n_blocks (the bench's dense)")
    p.add_argument("--head", type=float, default=1.0, help="the head's cost in layer units")
    p.add_argument("--tokens", type=int, default=20000, help="tokens simulated per batch size")
    args = p.parse_args(argv)
    blocks = unit_fractions(args.model_size)
    dense = args.dense_layers or len(blocks)
    print(f"{args.model_size}: {len(blocks)} blocks, {sum(len(f) for f in blocks)} units; units per token "
          f"{sum(sum(f) for f in blocks):.2f}; dense baseline {dense} layers; head = {args.head:g} layer")
    print("batch | units per step (lockstep) | HYDRA / dense, lockstep | HYDRA / dense, depth-wise batching")
    for batch in (int(b) for b in args.batches.split(",")):
        units = lockstep_units_per_step(blocks, batch)
        dense_rate = batch / (dense + args.head)
        lockstep = batch / (units + args.head) / dense_rate
        depthwise = depthwise_tokens_per_cost(blocks, batch, args.head, args.tokens, seed=batch) / dense_rate
        print(f"{batch:5d} | {units:25.2f} | {lockstep:23.2f}x | {depthwise:34.2f}x")


if __name__ == "__main__":
    main()
