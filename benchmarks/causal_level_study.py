"""Which level should the causal rule measure router logits against? Re-calibrate checkpoints' routers on
training batches under several level estimators and compare causal and top-k validation losses.

The causal rule admits a token by its logit relative to a level (``routing.ExpertChoiceRouter.relative``:
the mean of the document's earlier candidate logits, shrunk towards the router's running mean logit).
A mean is not robust: where a router gives the tokens an earlier unit already ran a logit tens of units
below the rest (every block MoD at capacity 0.125, seventeenth session), the prefix mean jumps with
each of them and the relative logits rank by noise. Levels compared here, each with the threshold and
its center re-calibrated the way training calibrates them (running means over ``--batches`` training
batches in top-k mode, decay ``routing.THRESHOLD_DECAY``):

- ``checkpoint``: the rule as shipped, with the checkpoint's own calibration (no re-calibration);
- ``mean``: the rule as shipped, re-calibrated here (the harness's own baseline);
- ``raw``: no level, the raw logit against a raw threshold (the fifth session's rule, plus the ranks);
- ``robustK``: center = running median of the batch logits, prefix mean of the logits winsorised at
  center +- K x the running median absolute deviation;
- ``median``: the median of the document's earlier candidate logits and the running median (a
  [B, N, N] statistic: fine for a study, costly in a training step).

Evaluation only; the study behind it is in benchmarks/BENCHMARKS.md (seventeenth session).

    PYTHONPATH=src python benchmarks/causal_level_study.py --runs RUN [RUN ...] \\
        [--levels checkpoint mean raw robust3] [--rank_prior 256] [--eval_batches 8] [--batches 60] [--device cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hydra_lm import data as data_pkg
from hydra_lm.infer.runs import load_run
from hydra_lm.model import routing as R
from hydra_lm.train.data_io import ValSet, open_data

SHIPPED = (R.ExpertChoiceRouter.relative, R.ExpertChoiceRouter.calibrate)


def use_level(level: str) -> dict:
    """Patch the router's level and calibration for ``level``; returns the per-router spread state."""
    spread: dict[int, list[torch.Tensor]] = {}
    R.ExpertChoiceRouter.relative, R.ExpertChoiceRouter.calibrate = SHIPPED
    if level in ("checkpoint", "mean"):
        return spread
    k_mad = float(level.removeprefix("robust")) if level.startswith("robust") else 0.0

    def clamp(self, r):
        if not k_mad or id(self) not in spread:
            return r
        c = self.center().to(r.dtype)
        d = k_mad * spread[id(self)][0] / spread[id(self)][1]
        return torch.minimum(torch.maximum(r, c - d), c + d)

    def relative(self, r, valid, doc=None):
        if level == "raw":
            return r
        if level == "median":  # the median of the document's earlier candidates and the running center
            v = torch.ones_like(r, dtype=torch.bool) if valid is None else valid
            n = r.shape[1]
            past = torch.ones(n, n, dtype=torch.bool, device=r.device).tril(-1)[None] & v[:, None, :]
            if doc is not None:
                past = past & (doc[:, :, None] == doc[:, None, :])
            values = torch.where(past, r[:, None, :], float("nan"))
            center = self.center().to(r.dtype).expand(*r.shape, 1)
            return r - torch.cat((values, center), -1).nanmedian(-1).values
        v = torch.ones_like(r) if valid is None else valid.to(r.dtype)
        return self._relative(r, R._prefix_sum(clamp(self, r) * v, doc), R._prefix_sum(v, doc))

    @torch.no_grad()
    def calibrate(self, r, k, boundary_of=None):
        d = R.THRESHOLD_DECAY
        keep = torch.where(self.threshold_weight > 0, d, 0.0)
        med = r.median()
        self.center_sum.mul_(d).add_(med if level != "raw" else r.mean(), alpha=1 - d)
        self.center_weight.mul_(d).add_(1 - d)
        s = spread.setdefault(id(self), [torch.zeros((), device=r.device), torch.zeros((), device=r.device)])
        s[0].mul_(d).add_((r - med).abs().median(), alpha=1 - d)
        s[1].mul_(d).add_(1 - d)
        self.threshold_sum.mul_(keep)
        self.threshold_weight.mul_(keep).add_(1 - d)
        relative = self.relative(r, None, None)
        self.threshold_sum.add_(R.topk_boundary(relative, k), alpha=1 - d)
        other = None if boundary_of is None else R.topk_boundary(boundary_of, k)
        return relative, self.threshold_sum / self.threshold_weight, other

    R.ExpertChoiceRouter.relative, R.ExpertChoiceRouter.calibrate = relative, calibrate
    return spread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True, help="run directories with checkpoints")
    ap.add_argument("--levels", nargs="+", default=["checkpoint", "mean", "raw", "robust3"])
    ap.add_argument("--rank_prior", type=float, default=R.RANK_PRIOR)
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--batches", type=int, default=60, help="training batches of re-calibration")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    R.RANK_PRIOR = args.rank_prior
    print(f"{'run':>24} {'level':>10}  causal    top-k     gap      executed share per router (causal)")
    try:
        for run_dir in args.runs:
            for level in args.levels:
                run = load_run(run_dir, None, args.device)  # fresh weights and buffers per level
                model, dev, cfg = run.model, run.device, run.config["train"]
                info = open_data(run.config.get("data", {}).get("path") or cfg["data"])
                bs, sl = cfg["batch_size"], cfg["seq_len"]
                use_level(level)
                if level != "checkpoint":
                    for mod in model.modules():
                        if isinstance(mod, R.ExpertChoiceRouter):
                            for name in R.THRESHOLD_BUFFERS:
                                getattr(mod, name).zero_()
                    loader = data_pkg.PackedLoader(info.path, "train", bs, sl, seed=1, loop=True, shuffle=True)
                    model.train()
                    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
                        for _, b in zip(range(args.batches), loader):
                            model(b["input_ids"].to(dev), routing="topk", doc_ids=b["doc_ids"].to(dev))
                model.eval()
                losses, shares = {}, None
                with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
                    for mode in ("causal", "topk"):
                        total, stats = 0.0, 0.0
                        batches = [b for _, b in zip(range(args.eval_batches), ValSet(info, bs, sl))]
                        for b in batches:
                            out = model(b["input_ids"].to(dev), targets=b["targets"].to(dev), routing=mode,
                                        doc_ids=b["doc_ids"].to(dev))
                            total += out["ce_loss"].item()
                            stats = stats + out["routing_stats"].float()
                        losses[mode] = total / len(batches)
                        if mode == "causal":
                            shares = " ".join(f"{v:.3f}" for v in (stats[:, 0] / len(batches)).tolist())
                gap = losses["causal"] - losses["topk"]
                print(f"{Path(run_dir).name[-24:]:>24} {level:>10}  {losses['causal']:.4f}  {losses['topk']:.4f}  "
                      f"{gap:+.4f}  {shares}", flush=True)
    finally:
        R.ExpertChoiceRouter.relative, R.ExpertChoiceRouter.calibrate = SHIPPED


if __name__ == "__main__":
    main()
