"""How much of the causal rule's disagreement with top-k is the row's future: on a trained checkpoint's
validation batches, each expert-choice router's logits (top-k forward, as the eval measures agreement)
are compared with three choices: the row's top-k (what training takes and the eval reports), the
batch's top-k pooled over its rows (the same number of tokens, picked by one boundary for the whole
batch), and each other; and, since a packed row may hold several documents while the causal rule looks
inside a document only, each document's own top-k (its share of the row's k by candidate count) and the
rule's agreement with the row's top-k on rows with and without a document boundary (printed last).

A row's top-k boundary moves with the row's content; no causal rule can see it. If the causal rules
agree much better with the pooled choice than with the row's, the rows' spread of boundaries is what
costs agreement; if not, the threshold itself is off (e.g. validation text unlike the training batches).
Also printed per router: the calibrated threshold, the batch's pooled boundary, the spread of the
rows' boundaries against the logits' own spread, and the most a choice of the rule's count of tokens per
row could agree with the row's top-k (1 - mean |admitted - k| / candidates): where the rule's agreement
reaches it, the rule takes each row's highest logits and every disagreement is how many, not which.

    PYTHONPATH=src python benchmarks/agreement_by_pooling.py --run RUN_DIR --data DATA_DIR --batches 8
"""

from __future__ import annotations

import argparse

import torch

from hydra_lm.infer.runs import load_run
from hydra_lm.model import routing
from hydra_lm.train.data_io import ValSet, open_data

PAIRS = ("causal rule ~ row top-k", "threshold ~ row top-k", "threshold ~ pooled top-k", "causal rule ~ pooled top-k",
         "pooled ~ row top-k")
DOC_PAIRS = ("causal rule ~ row top-k, rows without a boundary", "causal rule ~ row top-k, rows with one",
             "causal rule ~ per-document top-k", "per-document ~ row top-k")


def per_document_topk(r: torch.Tensor, k: int, doc: torch.Tensor) -> torch.Tensor:
    """Each document of a row takes its share of the row's ``k`` (by candidate count, largest remainders
    rounded up so the row still takes ``k``) of its own highest logits."""
    chosen = torch.zeros_like(r, dtype=torch.bool)
    for i in range(r.shape[0]):
        _, counts = torch.unique_consecutive(doc[i], return_counts=True)
        quota = counts.double() * k / r.shape[1]
        take = quota.floor().long()
        take[torch.argsort(quota - take, descending=True)[: k - int(take.sum())]] += 1
        for start, n, q in zip((torch.cumsum(counts, 0) - counts).tolist(), counts.tolist(), take.tolist()):
            chosen[i, start + torch.topk(r[i, start:start + n], q).indices] = True
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a training run directory")
    parser.add_argument("--data", required=True, help="its prepared data directory (the val split is read)")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    args = parser.parse_args()

    model = load_run(args.run, device="cpu").model.eval()
    seen: list[tuple[routing.ExpertChoiceRouter, torch.Tensor, int, torch.Tensor | None]] = []
    select = routing.ExpertChoiceRouter.select

    def capture(self, x, valid, k, mode, row_len, depth=0, decision=None, state=None, capacity=None, doc=None,
                pos=None):
        if mode == "topk":
            seen.append((self, self.logits(x).detach(), k, doc))
        return select(self, x, valid, k, mode, row_len, depth, decision, state, capacity, doc, pos)

    routing.ExpertChoiceRouter.select = capture  # a probe of this script only
    names = {id(r): name for name, r in model.named_modules() if isinstance(r, routing.ExpertChoiceRouter)}
    agree: dict[str, dict[str, float]] = {}
    spread: dict[str, list[tuple[float, float, float, float]]] = {}
    by_doc = {pair: [0.0, 0.0] for pair in DOC_PAIRS}  # agreeing decisions, decisions
    with torch.no_grad():
        for i, batch in enumerate(ValSet(open_data(args.data), args.batch_size, args.seq_len)):
            if i >= args.batches:
                break
            seen.clear()
            model(batch["input_ids"], targets=batch["targets"], routing="topk", doc_ids=batch["doc_ids"])
            for router, r, k, doc in seen:
                b, n = r.shape
                row = torch.zeros_like(r, dtype=torch.bool).scatter_(1, torch.topk(r, k, dim=1).indices, True)
                pooled = torch.zeros(b * n, dtype=torch.bool)
                pooled[torch.topk(r.reshape(-1), b * k).indices] = True
                pooled = pooled.reshape(b, n)
                threshold = router.threshold()
                rule = routing.rank_admits(r, None, k / n, threshold, doc)
                decisions = (rule == row, (r > threshold) == row, (r > threshold) == pooled, rule == pooled,
                             pooled == row)
                a = agree.setdefault(names[id(router)], {"n": 0.0, "counts": 0.0, **dict.fromkeys(PAIRS, 0.0)})
                a["n"] += r.numel()
                a["counts"] += r.numel() - (rule.sum(1) - k).abs().sum().item()
                for pair, same in zip(PAIRS, decisions):
                    a[pair] += same.float().sum().item()
                doc = torch.zeros_like(r, dtype=torch.long) if doc is None else doc
                split = (doc != doc[:, :1]).any(1, keepdim=True).expand(-1, n)  # rows with a boundary
                per_doc = per_document_topk(r, k, doc)
                for pair, same in zip(DOC_PAIRS, ((rule == row)[~split], (rule == row)[split], rule == per_doc,
                                                  per_doc == row)):
                    by_doc[pair][0] += same.float().sum().item()
                    by_doc[pair][1] += same.numel()
                boundaries = torch.topk(r, k, dim=1).values[:, -1]
                spread.setdefault(names[id(router)], []).append(
                    (threshold.item(), routing.topk_boundary(r, k).item(), boundaries.std().item(), r.std().item()))
    routing.ExpertChoiceRouter.select = select

    print(f"{'router':<22} {'candidates':>10}  " + "  ".join(f"{p:>26}" for p in PAIRS)
          + "  rows' counts allow  threshold  pooled boundary  rows' boundary std / logit std")
    total = dict.fromkeys((*PAIRS, "counts"), 0.0)
    count = 0.0
    for name, a in agree.items():
        s = torch.tensor(spread[name]).mean(0).tolist()
        print(f"{name:<22} {int(a['n']):>10}  " + "  ".join(f"{a[p] / a['n']:>26.4f}" for p in PAIRS)
              + f"  {a['counts'] / a['n']:>18.4f}  {s[0]:+9.3f}  {s[1]:+15.3f}  {s[2]:.3f} / {s[3]:.3f}")
        for p in total:
            total[p] += a[p]
        count += a["n"]
    print(f"{'all decisions':<22} {int(count):>10}  " + "  ".join(f"{total[p] / count:>26.4f}" for p in PAIRS)
          + f"  {total['counts'] / count:>18.4f}")
    for pair, (same, n) in by_doc.items():
        print(f"{pair:<50} {same / max(n, 1.0):.4f} of {int(n)} decisions")


if __name__ == "__main__":
    main()
