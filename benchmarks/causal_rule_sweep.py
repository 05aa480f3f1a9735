"""Re-evaluate one checkpoint under variations of the causal routing rule: causal and top-k validation
loss, their gap, the routers' mean top-k/causal agreement and the executed share of the unit tokens,
causal against top-k. Evaluation only: the trained weights and calibrated thresholds are the checkpoint's.

- ``--rank_prior``: the rank rule's threshold weight (``routing.RANK_PRIOR``, in pseudo-candidates). A
  larger weight lets the calibrated threshold decide for longer into each document (the executed share
  follows the capacity more closely); a smaller one lets each token's rank among earlier ones decide sooner.
- ``--capacity_prior K``: the threshold weighs ``K (1 - c) / c`` pseudo-candidates at a router's capacity c
  instead of one weight for all (K = 36.6 gives 256 at capacity 0.125, 37 at 0.5, 12 at 0.75): the
  rank of a candidate among N earlier ones estimates the capacity quantile with a relative error of
  about sqrt((1 - c) / (c N)), so equal trust in the ranks at every capacity needs N in proportion to
  (1 - c) / c. On the 100M grid a light weight raised agreement at capacity 0.5-0.75 and broke
  capacity 0.125 (benchmarks/BENCHMARKS.md, twenty-second session); this tries both at once.
- ``--decode_batch B``: also decode with each ``--rank_prior`` (prompts of ``--decode_len`` validation tokens,
  as many greedy one-token steps, ``diagnostics.bench.decode_tokens_per_s``): tokens/s and routed units run
  per step, what the rule costs in generation.
- ``--oracle``: then three non-causal choices in the causal pass, which split the gap into its parts:
  each row's own top-k (gap 0 means the causal path is exact and the whole gap is the decisions); the
  rule's count of tokens per row, but the row's highest logits (what the rule's allocation over rows
  alone costs); and the row's top-k with a share of its choice swapped for the next-best tokens, at the
  rule's measured disagreement (what as many errors at the boundary would cost). The rule's per-row count
  over top-k's is printed as quantiles. A deeper router's candidates are those the causal pass left it,
  so its "top-k" here is the capacity share of them.
- ``--match_share N``: then, at the last ``--rank_prior``, N rounds that scale each router's causal capacity
  by its target over the share it executed in the previous round, measured on the same validation batches
  (an oracle: it shows how much of the gap an executed share at the target would close; the rest is which
  tokens are chosen). The capacity moves the rank part of the rule only: a row's first candidates follow
  the threshold. The agreement column is measured in the top-k pass with the same scaled capacities.
  ``--match_on train`` measures the shares on ``--eval_batches`` batches of the training split instead (a
  fixed sample), as a calibration in the trainer could: no longer an oracle; the losses are still validation's.

    PYTHONPATH=src python benchmarks/causal_rule_sweep.py --run RUN_DIR [RUN_DIR ...] [--rank_prior 16 64 512] \\
        [--capacity_prior 36.6] [--oracle] [--match_share 2 [--match_on train]] [--eval_batches 16]
        [--decode_batch 8 --decode_len 64]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import torch

from hydra_lm.diagnostics.bench import decode_tokens_per_s
from hydra_lm.infer import eval_run
from hydra_lm.infer.runs import load_run
from hydra_lm.model import routing
from hydra_lm.model.block import RecursiveBlock
from hydra_lm.train.data_io import ValSet, open_data, train_loader
from hydra_lm.train.evaluate import evaluate as evaluate_batches

NAN = float("nan")


def row(label: str, r: dict) -> str:
    return (f"{label:>22}  {r['val_loss_causal']:.4f}  {r['val_loss_topk']:.4f}  "
            f"{r['val_loss_causal'] - r['val_loss_topk']:+.4f}  {r.get('val_agreement', NAN):9.1%}  "
            f"{r.get('val_agreement_decisions', NAN):12.1%}  "
            f"{r.get('val_exec_frac_causal', NAN):.4f} / {r.get('val_exec_frac_topk', NAN):.4f}")


def row_topk(s: torch.Tensor, valid: torch.Tensor | None, capacity: float, counts: torch.Tensor | None = None,
             swap: float = 0.0) -> torch.Tensor:
    """Each row's ``counts`` (default: the capacity share of its valid candidates) highest logits of ``s``
    [B, N]; with ``swap``, that share of each row's choice traded for the next-best candidates."""
    v = torch.ones_like(s, dtype=torch.bool) if valid is None else valid
    n = v.sum(1)
    counts = (capacity * n).round().long() if counts is None else counts
    ranked = torch.argsort(s.masked_fill(~v, float("-inf")), dim=1, descending=True)
    rank = torch.empty_like(ranked).scatter_(1, ranked, torch.arange(s.shape[1], device=s.device).expand_as(ranked))
    chosen = rank < counts[:, None]
    if swap:
        m = (swap * counts).round().long().clamp(max=n - counts)[:, None]
        chosen = (rank < counts[:, None] - m) | ((rank >= counts[:, None]) & (rank < counts[:, None] + m))
    return chosen & v


def oracle_rows(evaluate) -> None:
    admits, select = routing.rank_admits, routing.ExpertChoiceRouter.select
    ratios, disagree, mode = [], [], [""]

    def select_noting_mode(self, x, valid, k, mode_, *args, **kwargs):
        mode[0] = mode_
        return select(self, x, valid, k, mode_, *args, **kwargs)

    def measured(s, valid, capacity, threshold, doc=None):
        chosen = admits(s, valid, capacity, threshold, doc)
        if mode[0] == "causal":  # the top-k pass also asks the rule, for the agreement it reports
            top = row_topk(s, valid, capacity)
            ratios.append(chosen.sum(1) / top.sum(1).clamp(min=1))
            disagree.append(((chosen != top).sum() / top.sum().clamp(min=1)).item())
        return chosen

    try:
        routing.ExpertChoiceRouter.select, routing.rank_admits = select_noting_mode, measured
        print(row("rule (measured)", evaluate()), flush=True)
        share = sum(disagree) / len(disagree) / 2  # each swap makes two disagreements
        q = torch.quantile(torch.cat(ratios).float(), torch.tensor([0.1, 0.5, 0.9]))
        routing.rank_admits = lambda s, valid, capacity, threshold, doc=None: row_topk(s, valid, capacity)
        print(row("row top-k", evaluate()), flush=True)
        routing.rank_admits = lambda s, valid, capacity, threshold, doc=None: row_topk(
            s, valid, capacity, counts=admits(s, valid, capacity, threshold, doc).sum(1))
        print(row("rule's count per row", evaluate()), flush=True)
        routing.rank_admits = lambda s, valid, capacity, threshold, doc=None: row_topk(s, valid, capacity, swap=share)
        print(row(f"top-k, {share:.0%} swapped", evaluate()), flush=True)
        print(f"{'':>22}  the rule's count per row over top-k's: p10 {q[0]:.2f}, median {q[1]:.2f}, p90 {q[2]:.2f}")
    finally:
        routing.rank_admits, routing.ExpertChoiceRouter.select = admits, select


def capacity_weighted(decision, k: float):
    """``routing.rank_decision`` with the threshold's weight set from each call's capacity (evaluation and
    decoding here run eagerly, so the module constant can change between calls)."""
    def decide(s, above, count, capacity, threshold):
        routing.RANK_PRIOR = k * (1 - capacity) / capacity
        return decision(s, above, count, capacity, threshold)
    return decide


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, nargs="+", help="run directories with checkpoints (each in turn)")
    ap.add_argument("--rank_prior", type=float, nargs="+", default=[routing.RANK_PRIOR])
    ap.add_argument("--capacity_prior", type=float, nargs="*", default=[],
                    help="also the threshold weighed as K (1 - c) / c pseudo-candidates at capacity c, per K")
    ap.add_argument("--oracle", action="store_true", help="also split the gap with non-causal choices (above)")
    ap.add_argument("--match_share", type=int, default=0, help="rounds of per-router share matching (oracle)")
    ap.add_argument("--match_on", choices=("val", "train"), default="val",
                    help="the batches whose executed shares the matching follows")
    ap.add_argument("--eval_batches", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--decode_batch", type=int, default=0, help="also decode this many rows with each --rank_prior")
    ap.add_argument("--decode_len", type=int, default=64, help="prompt tokens, and new tokens, of that decoding")
    args = ap.parse_args()
    for run in args.run:
        print(f"== {run}", flush=True)
        sweep(run, args)


def sweep(run: str, args: argparse.Namespace) -> None:
    prior, capacities, decision = routing.RANK_PRIOR, RecursiveBlock.depth_capacities, routing.rank_decision
    route_and_run, select = RecursiveBlock.route_and_run, routing.ExpertChoiceRouter.select
    scale: dict[str, float] = {}
    running = [""]  # the block whose routers decide now (evaluation runs eagerly, one block at a time)

    def scaled_capacities(block: RecursiveBlock) -> list[float]:
        base = capacities(block)
        return [c * scale.get(f"{block.name}.{j}", 1.0) for j, c in enumerate(base)]

    def noting_block(block, *args, **kwargs):
        running[0] = block.name
        return route_and_run(block, *args, **kwargs)

    def select_scaled(self, x, valid, k, mode, row_len, depth=0, *args, **kwargs):
        """The top-k pass's agreement asks the rule at the scaled capacity too (causal mode takes it from
        ``depth_capacities``; top-k mode asks at ``k`` over its candidates)."""
        factor = scale.get(f"{running[0]}.{depth}", 1.0)
        if mode != "topk" or factor == 1.0:
            return select(self, x, valid, k, mode, row_len, depth, *args, **kwargs)
        admits = routing.rank_admits
        routing.rank_admits = lambda s, v, c, t, doc=None: admits(s, v, c * factor, t, doc)
        try:
            return select(self, x, valid, k, mode, row_len, depth, *args, **kwargs)
        finally:
            routing.rank_admits = admits

    def evaluate() -> dict:
        return eval_run(run, max_batches=args.eval_batches, device=args.device)

    def shares_on_train() -> dict:
        """Causal and top-k routing of a fixed sample of training batches (as the run trained: its batch shape,
        its document masks): the executed shares a calibration on training data would see."""
        loaded = load_run(run, None, args.device)
        cfg = loaded.config["train"]
        loader = train_loader(open_data(cfg["data"]), cfg["batch_size"], cfg["seq_len"], seed=cfg.get("seed", 0) + 1)
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if loaded.device.type == "cuda" \
            else contextlib.nullcontext
        batches = list(itertools.islice(iter(loader), args.eval_batches))
        return evaluate_batches(loaded.model, batches, loaded.device, 0, autocast, cfg.get("document_masking", True))

    decoder = None
    if args.decode_batch:
        decoder = load_run(run, None, args.device)
        info = open_data(decoder.config["train"]["data"])
        prompt = next(iter(ValSet(info, args.decode_batch, args.decode_len)))["input_ids"].to(decoder.device)

    def decode() -> str:
        if decoder is None:
            return ""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=decoder.device.type == "cuda"):
            rate, units, _, _ = decode_tokens_per_s(decoder.model.eval(), args.decode_batch, args.decode_len,
                                                    decoder.device, compiled=False, repeats=2, prompt=prompt)
        return f"  decode batch {args.decode_batch}: {rate:,.0f} tokens/s, {units:.2f} units per step"

    print(f"{'rule':>22}  causal    top-k     gap      agreement  of decisions  executed causal / top-k")
    try:
        for value in args.rank_prior:
            routing.RANK_PRIOR = value
            result = evaluate()
            print(row(f"rank_prior {value:g}", result) + decode(), flush=True)
        for k in args.capacity_prior:
            routing.rank_decision = capacity_weighted(decision, k)
            print(row(f"capacity_prior {k:g}", evaluate()) + decode(), flush=True)
            routing.rank_decision, routing.RANK_PRIOR = decision, args.rank_prior[-1]  # what follows runs at the last
        if args.oracle:
            oracle_rows(evaluate)
        RecursiveBlock.depth_capacities = scaled_capacities
        RecursiveBlock.route_and_run, routing.ExpertChoiceRouter.select = noting_block, select_scaled
        for round_ in range(1, args.match_share + 1):
            measured = shares_on_train() if args.match_on == "train" else result
            for name, r in measured.get("routing", {}).items():  # e.g. "block3.mod0": block3, depth 0
                block, _, kind_depth = name.partition(".")
                key = f"{block}.{int(kind_depth.lstrip('modr'))}"
                if r["exec_causal"] > 0:
                    scale[key] = min(scale.get(key, 1.0) * r["target"] / r["exec_causal"], 1e3)
            result = evaluate()
            print(row(f"matched on {args.match_on}, {round_}", result), flush=True)
    finally:
        routing.RANK_PRIOR, RecursiveBlock.depth_capacities, routing.rank_decision = prior, capacities, decision
        RecursiveBlock.route_and_run, routing.ExpertChoiceRouter.select = route_and_run, select


if __name__ == "__main__":
    main()
