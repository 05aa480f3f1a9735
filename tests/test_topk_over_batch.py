"""Top-k over the batch (``HydraConfig.topk_over="batch"``): each expert-choice router takes the batch's
rows * k highest logits, and the block runs the chosen entries of all rows as one row, rows kept apart
as documents. (The compiled block graphs: tests/test_compile.py.)"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from hydra_lm.model import routing
from hydra_lm.model.routing import ExpertChoiceRouter

from support import TINY, tiny_model

ROW_SELECT = ExpertChoiceRouter.select


def masked_batch_select(self, x, valid, k, mode, row_len, depth=0, decision=None, state=None, capacity=None,
                        doc=None, pos=None, groups=1):
    """The reference: the rows * k highest logits of each of ``groups`` equal groups of the batch's rows among
    the valid candidates, every row keeping all of its entries with the unchosen ones masked behind the chosen
    (as causal evaluation runs its units), so no entry of one row ever meets another row's."""
    if mode != "topk":
        return ROW_SELECT(self, x, valid, k, mode, row_len, depth, decision, state, capacity, doc, pos)
    r = self.logits(x.detach())
    v = torch.ones_like(r, dtype=torch.bool) if valid is None else valid
    masked = r.detach().masked_fill(~v, float("-inf"))
    flat = torch.zeros(groups, masked.numel() // groups, dtype=torch.bool)
    flat.scatter_(1, torch.topk(masked.reshape(groups, -1), k * r.shape[0] // groups).indices, True)
    chosen = flat.view_as(masked)
    boundary = self.calibrate(masked, k)[0] if self.training else routing.topk_boundary(masked, k)
    w = v.to(r.dtype)
    aux = (F.binary_cross_entropy_with_logits(self.logits_of_parameters(x, r) - boundary, chosen.to(r.dtype),
                                              reduction="none") * w).sum() / w.sum()
    sel = routing.masked_selection(chosen, self.gate(r), valid, row_len, aux_loss=aux)
    return dataclasses.replace(sel, weight=None)  # the block gates the chosen entries, as in top-k


def _batch(seed, b=4, t=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (b, t), generator=g)
    return ids, torch.roll(ids, -1, 1)


LAYOUTS = [{}, {"mod_every": 2, "mod_capacity": 0.25}, {"mor_routing": "token"}, {"recursions": 1}]


@pytest.mark.parametrize("groups", [1, 2], ids=["whole_batch", "two_groups"])
@pytest.mark.parametrize("overrides", LAYOUTS, ids=["every_block", "every_2nd", "token_choice_mor", "mod_only"])
@pytest.mark.parametrize("with_docs", [False, True], ids=["rows", "documents"])
def test_batch_topk_trains_like_the_masked_reference(overrides, with_docs, groups):
    """Losses, every gradient and every calibrated threshold equal the masked reference's over two training
    steps' forwards (float64), with and without documents packed in the rows, the batch's four rows pooled as
    one group or as two (``topk_groups``)."""
    model = tiny_model(topk_over="batch", topk_groups=groups, **overrides).double().train()
    reference = tiny_model(topk_over="row", **overrides).double().train()
    doc = torch.tensor([[0] * 20 + [1] * 12, [0] * 32, [0] * 5 + [1] * 27, [0] * 32]) if with_docs else None
    ids, targets = _batch(1)
    with torch.no_grad():  # the batch's choice is not the rows' (else this test would prove nothing)
        rows = tiny_model(topk_over="row", **overrides).double().train()(ids, targets=targets, doc_ids=doc)
        batch = tiny_model(topk_over="batch", topk_groups=groups, **overrides).double().train()(
            ids, targets=targets, doc_ids=doc)
    assert abs(float(rows["ce_loss"] - batch["ce_loss"])) > 1e-6
    for seed in (1, 2):
        ids, targets = _batch(seed)
        out = model(ids, targets=targets, doc_ids=doc)
        out["loss"].backward()
        ExpertChoiceRouter.select = functools.partialmethod(masked_batch_select, groups=groups)
        try:
            ref = reference(ids, targets=targets, doc_ids=doc)
        finally:
            ExpertChoiceRouter.select = ROW_SELECT
        ref["loss"].backward()
        for key in ("ce_loss", "aux_loss", "ponder_loss"):
            torch.testing.assert_close(out[key], ref[key], msg=key)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    routers = [m for m in model.modules() if isinstance(m, ExpertChoiceRouter)]
    assert routers and all(r.proj.weight.grad.abs().sum() > 0 for r in routers), "the routers must learn"
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, msg=name)


def test_the_batch_choice_lets_rows_counts_vary():
    """The rows * k highest logits of the batch, whichever rows hold them: a row of high logits takes more
    than k, and the order indexes the rows laid end to end."""
    torch.manual_seed(0)
    router = ExpertChoiceRouter(dim=3, depth=0, over_batch=True).eval()
    x = torch.randn(3, 8, 3)
    x[0] += 2.0 * torch.sign(router.proj.weight[0])  # row 0's logits run high
    sel = router.select(x, None, 2, "topk", 8)
    r = router.logits(x).reshape(-1)
    assert sel.order.shape == (1, 6)
    assert set(sel.order[0].tolist()) == set(torch.topk(r, 6).indices.tolist())
    counts = torch.bincount(sel.order[0] // 8, minlength=3)
    assert counts.sum() == 6 and counts[0] > 2
    row = ExpertChoiceRouter(dim=3, depth=0).eval()
    row.load_state_dict(router.state_dict())
    assert row.select(x, None, 2, "topk", 8).order.shape == (3, 2)  # each row's top-k


def test_groups_pool_their_own_rows_and_a_batch_they_do_not_divide_is_refused():
    """``topk_groups``: each group's rows * k highest logits, laid end to end as one row per group; a batch
    of fewer rows than groups keeps its rows; one the groups do not divide gets an error naming the fix; the
    rows' own top-k takes no groups."""
    torch.manual_seed(0)
    router = ExpertChoiceRouter(dim=3, depth=0, over_batch=True, groups=2).eval()
    x = torch.randn(4, 8, 3)
    x[0] += 2.0 * torch.sign(router.proj.weight[0])  # row 0's logits run high: group 0 gives it more than k
    sel = router.select(x, None, 2, "topk", 8)
    r = router.logits(x).reshape(2, -1)
    assert sel.order.shape == (2, 4)
    for g in range(2):
        assert set(sel.order[g].tolist()) == set(torch.topk(r[g], 4).indices.tolist())
    assert int((sel.order[0] < 8).sum()) > 2
    assert router.select(x[:1], None, 2, "topk", 8).order.shape == (1, 2)
    with pytest.raises(ValueError, match="topk_groups=2 .* 3 rows"):
        router.select(x[:3], None, 2, "topk", 8)
    with pytest.raises(ValueError, match="topk_groups"):
        tiny_model(topk_groups=2)


@pytest.mark.parametrize("groups", [1, 2])
def test_inactive_routers_report_their_share_of_the_rows_after_a_top_k_over_the_batch(groups):
    """MoR off: its routers pass every entry through, and their executed share is that of the block's entries
    per row (the MoD capacity), as with each row's top-k, not multiplied by the rows laid end to end."""
    shares = {}
    for over in ("row", "batch"):
        model = tiny_model(topk_over=over, topk_groups=groups if over == "batch" else 1).train()
        model.set_curriculum(mor_active=False)
        stats = model(_batch(1)[0])["routing_stats"][:, 0]
        shares[over] = dict(zip(model.router_names(), stats.tolist()))
    assert shares["batch"] == pytest.approx(shares["row"])
    assert any(".mor" in name and share == pytest.approx(0.5) for name, share in shares["batch"].items())


def test_causal_routing_and_one_row_batches_are_the_rows_own():
    """Evaluation's causal routing is unchanged (it ranks within rows), and a batch of one row is its top-k."""
    model = tiny_model(topk_over="batch").eval()
    reference = tiny_model(topk_over="row").eval()
    ids, _ = _batch(3)
    with torch.no_grad():
        for rows, mode in ((ids, "causal"), (ids[:1], "topk")):
            torch.testing.assert_close(model(rows, routing=mode)["logits"], reference(rows, routing=mode)["logits"])


def test_an_unknown_topk_over_is_refused():
    with pytest.raises(ValueError, match="topk_over"):
        tiny_model(topk_over="rows")


def _router_of_logits(logits, threshold, causal_choice=True):
    """A router whose logits are ``logits`` [B, N] (its input's one feature) and whose threshold is ``threshold``."""
    router = ExpertChoiceRouter(dim=1, depth=0, over_batch=True, causal_choice=causal_choice).eval()
    with torch.no_grad():
        router.proj.weight.fill_(1.0)
        router.proj.bias.zero_()
    router.threshold_sum.fill_(threshold)
    router.threshold_weight.fill_(1.0)
    return router, logits[..., None]


def test_the_causal_choice_is_the_rules_admissions_held_to_the_budget():
    """``topk_over="causal"``: the batch's rows * k entries with the causal rule's admissions first. Row 0's logits
    fall along it, all above the threshold: its rank stops the rule after its first few. Row 1's rise, lower than
    row 0's but above the threshold: each is its row's highest so far, so the rule admits all of them. The choice keeps
    row 0's admitted few and trims row 1's lowest to the budget, where the batch's top-k would take row 0's highest
    only; with the threshold over every logit the rule admits nothing and the budget is the batch's top-k."""
    n, k = 512, 64
    logits = torch.stack((torch.linspace(5.0, 1.0, n), torch.linspace(0.1, 0.9, n)))
    router, x = _router_of_logits(logits, 0.0)
    admitted = routing.rank_admits(logits, None, k / n, router.threshold())
    first = int(admitted[0].sum())
    assert 0 < first < 2 * k and bool(admitted[0, :first].all()) and bool(admitted[1].all())
    sel = router.select(x, None, k, "topk", n)
    chosen = torch.zeros(2 * n, dtype=torch.bool)
    chosen[sel.order[0]] = True
    chosen = chosen.view(2, n)
    assert sel.order.shape == (1, 2 * k)
    assert bool(chosen[0, :first].all()) and not bool(chosen[0, first:].any())
    assert bool(chosen[1, n - (2 * k - first):].all()) and int(chosen[1].sum()) == 2 * k - first
    batch, _ = _router_of_logits(logits, 0.0, causal_choice=False)
    assert int(batch.select(x, None, k, "topk", n).order.max()) < n  # the batch's top-k: row 0 only

    above_all, x = _router_of_logits(logits, 9.0)
    assert not bool(routing.rank_admits(logits, None, k / n, above_all.threshold()).any())
    torch.testing.assert_close(above_all.select(x, None, k, "topk", n).order, batch.select(x, None, k, "topk", n).order)
