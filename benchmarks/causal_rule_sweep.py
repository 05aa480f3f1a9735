"""Re-evaluate one checkpoint with the causal rank rule's threshold weight (``routing.RANK_PRIOR``, in
pseudo-candidates) at several values: causal and top-k validation loss, their gap, the routers' mean
top-k/causal agreement and the executed share of the unit tokens, causal against top-k. Evaluation only:
the rule is a decision at inference, the trained weights and calibrated thresholds are the checkpoint's.
A larger weight lets the calibrated threshold decide for longer into each document (the executed share
follows the capacity more closely); a smaller one lets each token's rank among earlier ones decide sooner.

    PYTHONPATH=src python benchmarks/causal_rule_sweep.py --run RUN_DIR [--rank_prior 16 64 512] [--eval_batches 16]
"""

from __future__ import annotations

import argparse

from hydra_lm.infer import eval_run
from hydra_lm.model import routing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a run directory with checkpoints")
    ap.add_argument("--rank_prior", type=float, nargs="+", default=[16.0, 64.0, 512.0])
    ap.add_argument("--eval_batches", type=int, default=16)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    default = routing.RANK_PRIOR
    print("rank_prior  causal    top-k     gap      agreement  executed causal / top-k")
    try:
        for prior in args.rank_prior:
            routing.RANK_PRIOR = prior
            r = eval_run(args.run, max_batches=args.eval_batches, device=args.device)
            nan = float("nan")
            print(f"{prior:>10g}  {r['val_loss_causal']:.4f}  {r['val_loss_topk']:.4f}  "
                  f"{r['val_loss_causal'] - r['val_loss_topk']:+.4f}  {r.get('val_agreement', nan):9.1%}  "
                  f"{r.get('val_exec_frac_causal', nan):.4f} / {r.get('val_exec_frac_topk', nan):.4f}", flush=True)
    finally:
        routing.RANK_PRIOR = default


if __name__ == "__main__":
    main()
