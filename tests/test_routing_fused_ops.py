"""The training step's routing runs fewer ops (benchmarks/op_counts.py) for the same numbers: each shortcut
against the plain computation it replaces, bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hydra_lm.model.routing import THRESHOLD_DECAY, ExpertChoiceRouter, topk_boundary

from support import tiny_model


def _reference_calibrate(router: ExpertChoiceRouter, r: torch.Tensor, k: int) -> None:
    """The update from its definition: an exponential moving average of the pooled top-k boundary."""
    top = torch.topk(r.reshape(-1), r.shape[0] * k + 1, sorted=True).values
    router.threshold_sum.mul_(THRESHOLD_DECAY).add_(0.5 * (top[-2] + top[-1]), alpha=1 - THRESHOLD_DECAY)
    router.threshold_weight.mul_(THRESHOLD_DECAY).add_(1 - THRESHOLD_DECAY)


@pytest.mark.parametrize("fresh", [True, False])
def test_calibrate_returns_the_topk_boundary_and_the_updated_threshold(fresh):
    torch.manual_seed(0)
    router = ExpertChoiceRouter(16, 1)
    if not fresh:  # calibrated before, with a drifted logit level
        for _ in range(3):
            router.calibrate(torch.randn(3, 40) + 2.0, 10)
    reference = copy.deepcopy(router)
    r = torch.randn(3, 40) * 3
    boundary, threshold = router.calibrate(r, 10)
    _reference_calibrate(reference, r, 10)
    for name, buf in router.named_buffers():
        assert torch.equal(buf, dict(reference.named_buffers())[name]), name
    assert torch.equal(threshold, reference.threshold())
    assert torch.equal(boundary, topk_boundary(r, 10))


def test_the_topk_boundary_admits_exactly_the_batchs_topk():
    r = torch.randn(4, 25)
    for k in (1, 7):
        assert int((r > topk_boundary(r, k)).sum()) == 4 * k
    assert torch.equal(topk_boundary(r, 25), r.min() - 1.0)  # every logit is chosen


def test_aux_logits_reuse_the_logits_with_the_gradients_of_a_second_linear():
    torch.manual_seed(0)
    router = ExpertChoiceRouter(8, 1)
    x = torch.randn(2, 5, 8, requires_grad=True)
    r = router.logits(x)
    g = torch.randn(2, 5)
    fused = router.logits_of_parameters(x, r)
    assert torch.equal(fused, r)
    w_fused, b_fused = torch.autograd.grad((fused * g).sum(), [router.proj.weight, router.proj.bias])
    plain = F.linear(x.detach(), router.proj.weight, router.proj.bias).squeeze(-1)
    w_plain, b_plain = torch.autograd.grad((plain * g).sum(), [router.proj.weight, router.proj.bias])
    assert torch.equal(w_fused, w_plain) and torch.equal(b_fused, b_plain)
    (router.logits_of_parameters(x, router.logits(x)) * g).sum().backward()
    assert x.grad is None  # the aux loss trains the router only


def test_recursion_embedding_gradient_is_the_sum_over_depths_of_indexing_each():
    torch.manual_seed(0)
    model = tiny_model(recursions=3)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(ids, targets=ids)["loss"].backward()
    block = model.blocks[0]
    got = block.rec_emb.grad.clone()

    class Indexed(torch.nn.Module):  # rec_emb[j] per depth, as first written
        def __init__(self, rec):
            super().__init__()
            self.rec = rec

        def unbind(self, dim):
            return [self.rec[j] for j in range(self.rec.shape[0])]

    model.zero_grad()
    for b in model.blocks:
        b.rec_emb = Indexed(b._parameters.pop("rec_emb"))
    model(ids, targets=ids)["loss"].backward()
    assert torch.equal(got, block.rec_emb.rec.grad)


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, targets=ids)
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("overrides", [{}, {"mod_every": 1, "recursions": 3}], ids=["preset", "every_block_r3"])
def test_gating_the_gathered_entries_equals_gathering_the_gates_of_all_logits(monkeypatch, overrides):
    """Top-k routers leave the gate to the block, which takes it of the chosen entries (``entry_gate``):
    the same loss and gradients as the gate of every candidate's logit gathered, whose backward reaches
    the residual stream through all N rows."""
    model = tiny_model(**overrides).double().train()
    ids = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    routers = [r for b in model.blocks for r in b.all_routers()]
    assert routers and all(r.gates_entries for r in routers)

    loss, grads = _loss_and_grads(model, ids)
    select = ExpertChoiceRouter.select

    def gathered_gates(self, x, valid, k, mode, *args, **kwargs):  # the gate of all N logits, gathered
        sel = select(self, x, valid, k, mode, *args, **kwargs)
        if mode == "topk":
            sel.weight = self.gate(self.logits(x).gather(1, sel.order))
        return sel

    monkeypatch.setattr(ExpertChoiceRouter, "select", gathered_gates)
    monkeypatch.setattr(ExpertChoiceRouter, "gates_entries", False)
    ref_loss, ref_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    assert any(n.endswith("proj.weight") and g.abs().sum() > 0 for n, g in grads.items())  # the routers learn


@pytest.mark.parametrize("overrides", [{}, {"mod_every": 1, "recursions": 3}], ids=["preset", "every_block_r3"])
def test_routed_rows_give_the_gradients_of_plain_gather_and_scatter(monkeypatch, overrides):
    """``block._TakeRows`` / ``_PutRows`` (the stream's gradient written once per routed depth) against
    gather and an out-of-place scatter: the same loss and gradients, bit for bit."""
    from hydra_lm.model import block as block_module

    model = tiny_model(**overrides).double().train()
    ids = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(2))

    loss, grads = _loss_and_grads(model, ids)

    class Take:
        @staticmethod
        def apply(stream, order):
            return block_module._gather_rows(stream, order), stream

    class Put:
        @staticmethod
        def apply(stream, order, rows):
            return stream.scatter(1, order[..., None].expand(-1, -1, stream.shape[-1]), rows)

    monkeypatch.setattr(block_module, "_TakeRows", Take)
    monkeypatch.setattr(block_module, "_PutRows", Put)
    ref_loss, ref_grads = _loss_and_grads(model, ids)
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_rows_that_reach_no_loss_get_a_zero_gradient():
    from hydra_lm.model.block import _PutRows, _TakeRows

    stream = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    order = torch.tensor([[1, 4], [0, 5]])
    rows, alias = _TakeRows.apply(stream, order)
    out = _PutRows.apply(alias, order, rows.detach() * 2)  # the taken rows' own path is cut
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    expected = weights.clone()
    expected.scatter_(1, order[..., None].expand(-1, -1, 3), 0.0)
    assert torch.equal(stream.grad, expected)
