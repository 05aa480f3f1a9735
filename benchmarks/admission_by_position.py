"""Where causal routing admits fewer (or more) tokens than top-k: each MoD router's admitted share by a
token's position in its document and in its row, causal rule against the row's top-k, on validation rows.

The MoD routers (depth 0) see every token of the row as a candidate, so their shares read directly: a
router whose logits drift along a document makes the causal rank rule (which compares a token with the
same document's earlier ones) disagree with top-k (which compares it with the whole row) by position.

    PYTHONPATH=src python benchmarks/admission_by_position.py --run RUN_DIR --data DATA_DIR [--rows 48 --seq_len 512]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from hydra_lm.data.shards import open_split
from hydra_lm.infer.runs import load_run
from hydra_lm.model import routing


def position_in_document(doc: torch.Tensor) -> torch.Tensor:
    """[B, T] index of each token within its document's run in the row (0 at the row's start)."""
    index = torch.arange(doc.shape[1]).expand_as(doc)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return index - torch.where(starts, index, 0).cummax(1).values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a training run directory")
    parser.add_argument("--data", required=True, help="its prepared data directory (the val split is read)")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--seq_len", type=int, default=512)
    args = parser.parse_args()

    model = load_run(args.run, device="cpu").model.eval()
    tokens, starts = open_split(args.data, "val")
    n = min(len(tokens) // args.seq_len, args.rows) * args.seq_len
    ids = torch.from_numpy(np.asarray(tokens[:n], dtype=np.int64)).view(-1, args.seq_len)
    first = np.zeros(len(tokens), dtype=np.int64)
    first[starts[starts < len(tokens)]] = 1
    doc = torch.from_numpy(np.cumsum(first)[:n]).view(-1, args.seq_len)

    seen = []  # (router, raw logits [B, T], causal admission [B, T]) of each MoD router
    select = routing.ExpertChoiceRouter.select

    def recording(self, x, valid, k, mode, row_len, depth=0, decision=None, state=None, capacity=None, doc=None,
                  pos=None):
        sel = select(self, x, valid, k, mode, row_len, depth, decision, state, capacity, doc, pos)
        if depth == 0:  # back from causal order (admitted first) to the row's order
            seen.append((self, self.logits(x).detach(), sel.valid.gather(1, torch.argsort(sel.order, 1))))
        return sel

    routing.ExpertChoiceRouter.select = recording
    try:
        with torch.no_grad():
            model(ids, doc_ids=doc, routing="causal")
    finally:
        routing.ExpertChoiceRouter.select = select

    in_doc = position_in_document(doc)
    in_row = torch.arange(args.seq_len).expand_as(doc)
    mod = {id(block.routers["0"]): block for block in model.blocks if "0" in block.routers}
    for router, r, causal in seen:
        block = mod[id(router)]
        k = max(1, round(block.depth_capacities()[0] * args.seq_len))  # top-k's tokens per row
        top = torch.zeros_like(causal).scatter_(1, torch.topk(r, k, 1).indices, True)
        print(f"{block.name}.mod0: causal {causal.float().mean():.3f}, top-k {top.float().mean():.3f}")
        for label, where, bounds in (("document", in_doc, (0, 16, 64, 256, None)),
                                     ("row", in_row, (0, 64, 256, None))):
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                m = (where >= lo) & (where < (hi if hi is not None else args.seq_len))
                print(f"  position in {label} [{lo}, {hi or 'end'}): {int(m.sum()):>6} tokens, causal "
                      f"{causal[m].float().mean():.3f}, top-k {top[m].float().mean():.3f}, "
                      f"mean logit {r[m].mean():.2f}")


if __name__ == "__main__":
    main()
