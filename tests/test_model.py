"""Behaviour of the model: causality, routing, gradients, sharing, MoE, outputs (decoding: test_model_decode.py)."""

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hydra_lm
from hydra_lm.model.block import TransformerLayer
from hydra_lm.model.routing import RANK_PRIOR, rank_admits

from support import TINY, tiny_model, tokens_per_unit


def _ids(b=2, t=40, seed=1, vocab=TINY["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


# ---------------------------------------------------------------------------- causality
def test_changing_a_token_never_changes_earlier_outputs(variant):
    name, overrides = variant
    _check_causal(tiny_model(**overrides).double().eval(), routing=None)


def test_soft_routing_requested_per_call_is_causal():
    _check_causal(tiny_model().double().eval(), routing="static")


def _check_causal(model, routing):
    ids = _ids()
    base = model(ids, routing=routing)["logits"]
    for t in (0, 7, 23, 39):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1 + t) % TINY["vocab_size"]
        out = model(changed, routing=routing)["logits"]
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-10)
        assert not torch.allclose(out[:, t:], base[:, t:]), "the change must matter from position t on"


def test_document_masked_forward_is_causal(variant):
    name, overrides = variant
    model = tiny_model(**overrides).double().eval()
    ids = _ids()
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    base = model(ids, doc_ids=doc)["logits"]
    for t in (3, 20, 33):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 5) % TINY["vocab_size"]
        out = model(changed, doc_ids=doc)["logits"]
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-10)


def test_topk_routing_is_not_causal_which_is_why_eval_defaults_to_causal():
    model = tiny_model().double().eval()
    ids = _ids()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % TINY["vocab_size"]
    # A row's top-k depends on its later tokens: the last token changes which earlier ones run a unit.
    base, out = (model(x, routing="topk")["logits"][:, :-1] for x in (ids, changed))
    assert not torch.allclose(out, base, rtol=0, atol=1e-10)
    torch.testing.assert_close(model(changed)["logits"][:, :-1], model(ids)["logits"][:, :-1], rtol=0, atol=1e-10)
    assert model.routing_mode() == "causal"
    model.eval_routing = "topk"
    assert model.routing_mode() == "topk"
    model.train()
    assert model.routing_mode() == "topk"


def test_document_mask_makes_packed_rows_equal_separate_sequences(variant):
    name, overrides = variant
    model = tiny_model(**overrides).double().eval()
    a, b = _ids(1, 17, seed=2), _ids(1, 12, seed=3)
    packed = torch.cat((a, b), dim=1)
    doc = torch.tensor([[0] * 17 + [1] * 12])
    out = model(packed, doc_ids=doc)["logits"]
    # RoPE tables are float32, so relative-position invariance holds to ~1e-7, not 1e-15.
    torch.testing.assert_close(out[:, :17], model(a)["logits"], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 17:], model(b)["logits"], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- routing
def _record_unit_sizes(model):
    sizes = []
    hooks = [m.register_forward_hook(lambda mod, args, out: sizes.append((id(mod), args[0].shape[1])))
             for m in model.modules() if isinstance(m, TransformerLayer)]
    return sizes, hooks


# MoD at 0.75 in the 2 blocks after the first (which runs every token), then MoR: (R-j)/R of that (paper),
# or half of the previous depth (geometric at 0.5: 40 * 0.75 * 0.25 = 7.5 rounds to 8)
@pytest.mark.parametrize("schedule, first, per_block", [
    (dict(mor_capacity_schedule="paper"), [40, 27, 13], [30, 20, 10]),
    (dict(mor_capacity=0.5), [40, 20, 10], [30, 15, 8])], ids=["paper", "geometric"])
def test_topk_runs_exactly_the_configured_tokens_per_unit(schedule, first, per_block):
    model = tiny_model(mod_capacity=0.75, **schedule).train()
    t = 40
    sizes, hooks = _record_unit_sizes(model)
    model(_ids(2, t))
    for h in hooks:
        h.remove()
    expected = list(tokens_per_unit(model, t).values())
    assert [n for _, n in sizes] == expected
    assert expected == first + per_block * 2


def test_static_mode_runs_every_token_through_every_unit():
    model = tiny_model(static_routing_mode=True).train()
    sizes, hooks = _record_unit_sizes(model)
    out = model(_ids(2, 40))
    for h in hooks:
        h.remove()
    assert all(n == 40 for _, n in sizes) and len(sizes) == 9
    assert out["routing_stats"].shape == (len(model.router_names()), 3)


def test_deeper_recursions_take_a_subset_of_the_shallower_ones():
    model = tiny_model().train()
    block = model.blocks[1]  # the first MoD-routed block (the first block runs every token)
    chosen = []
    original = block.routers["1"].select

    def spy(x, valid, k, mode, row_len, _orig=original, **kw):
        sel = _orig(x, valid, k, mode, row_len, **kw)
        chosen.append((x.shape[1], sel.order))
        return sel
    block.routers["1"].select = spy
    model(_ids(2, 40))
    n_candidates, order = chosen[0]
    assert n_candidates == 20  # depth 1 picks among the 20 tokens MoD let into depth 0
    assert order.shape == (2, 10) and bool((order.diff(dim=1) > 0).all())  # sorted: causal order kept


def test_routers_learn_from_the_language_model_loss_and_all_parameters_get_gradients(variant):
    name, overrides = variant
    model = tiny_model(**overrides).train()
    ids = _ids()
    out = model(ids, targets=torch.roll(ids, -1, 1))
    out["ce_loss"].backward()  # the LM loss alone, without the router aux losses
    for pname, p in model.named_parameters():
        if "router" in pname or "depth_router" in pname or "rec_emb" in pname or "temperature" in pname:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{pname} gets no gradient from the LM loss"
    model.zero_grad()
    out = model(ids, targets=torch.roll(ids, -1, 1))
    out["loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"parameters without gradient: {missing}"


def test_weights_are_shared_across_recursions():
    model = tiny_model(recursions=4).train()
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == TINY["n_blocks"]  # one unique layer per block, whatever the recursion count
    calls = {id(m): 0 for m in layers}
    hooks = [m.register_forward_hook(lambda mod, a, o: calls.__setitem__(id(mod), calls[id(mod)] + 1)) for m in layers]
    model(_ids())
    for h in hooks:
        h.remove()
    assert set(calls.values()) == {4}
    def layer_params(m):
        return sum(p.numel() for lyr in m.modules() if isinstance(lyr, TransformerLayer) for p in lyr.parameters())
    assert layer_params(tiny_model(recursions=6)) == layer_params(model)


def test_curriculum_switches_routing_off_and_on():
    model = tiny_model().train()
    model.set_curriculum(mod_active=False, mor_active=False)
    sizes, hooks = _record_unit_sizes(model)
    out = model(_ids(2, 40))
    assert all(n == 40 for _, n in sizes) and float(out["aux_loss"]) == 0.0
    sizes.clear()
    model.set_curriculum(mod_active=True, mor_active=True)
    out = model(_ids(2, 40))
    for h in hooks:
        h.remove()
    assert [n for _, n in sizes] == [40, 20, 10] + [20, 10, 5] * 2 and float(out["aux_loss"]) > 0


def test_with_mod_off_each_depth_keeps_its_share_of_the_whole_row_in_training_and_in_causal_routing():
    """MoD switched off by the curriculum: the row enters the routed blocks whole and each MoR depth keeps
    mor_capacity of the previous depth's tokens in top-k training, as the causal capacities and the trainer's
    FLOP count (a config without MoD) have it; with MoR off every depth runs the block's entries."""
    from hydra_lm.model.accounting import unit_token_counts

    model = tiny_model(mod_capacity=0.5, mor_capacity=0.5).train()
    model.set_curriculum(mod_active=False)
    sizes, hooks = _record_unit_sizes(model)
    model(_ids(2, 40))
    for h in hooks:
        h.remove()
    assert [n for _, n in sizes] == [40, 20, 10] * 3
    without_mod = [k for _, _, k in unit_token_counts(dataclasses.replace(model.config, mod_enabled=False), 40)]
    assert without_mod == [40, 20, 10] * 3
    block = model.blocks[1]
    assert block.depth_capacities()[1:] == [0.5, 0.5] and block.fractions() == [1.0, 0.5, 0.25]
    model.set_curriculum(mod_active=True, mor_active=False)
    assert block.tokens_per_depth(40) == [20, 20, 20]


def test_causal_mode_routes_the_first_candidates_of_a_row_by_threshold():
    model = tiny_model(n_blocks=1, recursions=1, mod_capacity=0.5, mod_first_block=True).double().eval()
    router = model.blocks[0].routers["0"]
    with torch.no_grad():
        router.proj.bias.fill_(-50.0)  # every logit negative: nothing enters the block
    # Capacity 0.5: the threshold's RANK_PRIOR pseudo-candidates put 3/4 of them above each token under
    # it, more than half of (earlier + RANK_PRIOR) for a row's first RANK_PRIOR / 2 tokens however they rank.
    ids = _ids(2, int(RANK_PRIOR) // 2)
    out = model(ids)
    assert float(out["routing_stats"][0, 0]) == 0.0
    x = model.embed(ids)
    expected = model.lm_head(model.norm(x))  # the block was skipped entirely
    torch.testing.assert_close(out["logits"], expected)


def test_causal_rank_rule_admits_a_candidate_iff_little_of_what_came_before_ranks_above_it(monkeypatch):
    from hydra_lm.model import routing

    monkeypatch.setattr(routing, "RANK_PRIOR", 8.0)  # lighter than the default, so ranks decide within 60 tokens
    RANK_PRIOR = routing.RANK_PRIOR
    torch.manual_seed(0)
    s, valid = torch.randn(3, 60, dtype=torch.float64), torch.rand(3, 60) > 0.3
    threshold, capacity = torch.tensor(0.5, dtype=torch.float64), 0.25
    got = rank_admits(s, valid, capacity, threshold)
    for b in range(3):
        for i in range(60):
            earlier = [float(s[b, j]) for j in range(i) if valid[b, j]]
            pseudo = RANK_PRIOR * ((1 + capacity) / 2 if float(s[b, i]) <= 0.5 else capacity / 2)
            above = sum(e > float(s[b, i]) for e in earlier) + pseudo
            assert bool(got[b, i]) == (above < capacity * (len(earlier) + RANK_PRIOR)), (b, i)
    assert not got[:, 0].any() or bool((s[:, 0][got[:, 0]] > 0.5).all())  # a row's first: the threshold


def test_causal_rank_rule_pulls_a_drifted_threshold_back_to_the_capacity():
    """Logits of text unlike the training batches: shifted and spread out. A threshold fitted before
    admits a share unrelated to the capacity; the ranks among the row's earlier candidates bring most of
    it back, and all of it as far as the threshold's weight allows."""
    from hydra_lm.model import routing

    torch.manual_seed(0)
    fitted = torch.randn(8, 1024)
    threshold = torch.quantile(fitted, 0.875)  # admits 1/8 of the fitted logits
    shifted = 3.0 * torch.randn(8, 1024) + 1.0
    drifted = float((shifted > threshold).float().mean())
    assert drifted > 0.4
    share = float(rank_admits(shifted, None, 0.125, threshold).float().mean())
    assert abs(share - 0.125) < 0.25 * (drifted - 0.125)  # the default weight: 0.19 against 0.48
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routing, "RANK_PRIOR", 16.0)  # a light threshold: the ranks decide nearly everywhere
        share = float(rank_admits(shifted, None, 0.125, threshold).float().mean())
    assert abs(share - 0.125) < 0.02


# ---------------------------------------------------------------------------- MoE
def test_moe_dispatches_only_routed_tokens_and_top1_gate_learns():
    model = tiny_model(moe=True, moe_num_layers=1, moe_num_experts=4, moe_top_k=1).train()
    moe = next(iter(model.moe_blocks.values()))
    rows = []
    import hydra_lm.model.moe as moe_mod
    original = moe_mod.expert_matmul
    moe_mod.expert_matmul = lambda x, w, o: (rows.append(x.shape[0]), original(x, w, o))[1]
    try:
        ids = _ids(2, 40)
        out = model(ids, targets=torch.roll(ids, -1, 1))
    finally:
        moe_mod.expert_matmul = original
    assert rows == [80, 80]  # each of the 80 tokens goes to exactly one expert (up and down matmuls)
    out["ce_loss"].backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert float(out["moe_loss"]) > 0


def test_moe_matches_a_per_token_reference():
    torch.manual_seed(0)
    from hydra_lm.model.moe import MoEFeedForward
    moe = MoEFeedForward(16, 24, n_experts=3, top_k=2).double().eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y, _, _ = moe(x)
    h = moe.norm(x)
    probs = torch.softmax(moe.router(h), -1)
    ref = x.clone()
    for b in range(2):
        for t in range(5):
            g, e = torch.topk(probs[b, t], 2)
            g = g / g.sum()
            for gate, ex in zip(g, e):
                up = h[b, t] @ moe.w_gate_up[ex]
                a, u = up.chunk(2)
                ref[b, t] += gate * ((torch.nn.functional.silu(a) * u) @ moe.w_down[ex])
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    # float64 throughout, the router's softmax too: the analytic gradient is the numerical one
    small = torch.randn(1, 3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: moe(v)[0], small)


# ---------------------------------------------------------------------------- outputs and API
def test_forward_outputs_and_seed_constructor():
    model = hydra_lm.create_ccgqa_mod_mor_model(vocab_size=101, dim=64, n_mor_blocks=2, recursions=2, n_heads=2,
                                               n_kv_heads=1, compression_factor=4, capacity_ratio=0.75)
    ids = torch.randint(0, 101, (2, 24))
    out = model(ids)
    assert out["logits"].shape == (2, 24, 101)
    for key in ("aux_loss", "ponder_loss"):
        assert out[key].dim() == 0
    assert out["routing_stats"].shape == (len(model.router_names()), 3)
    cfg = model.config  # the seed's argument names land on the fields they stand for
    assert (cfg.n_blocks, cfg.recursions, cfg.mod_capacity, cfg.compression_factor) == (2, 2, 0.75, 4)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2, 1, 8)


def test_gradient_checkpointing_gives_the_same_gradients_and_calibrates_the_thresholds_once(monkeypatch):
    import hydra_lm.model.hydra as hydra_module

    calls = []
    monkeypatch.setattr(hydra_module, "checkpoint", lambda *a, **kw: calls.append(1) or checkpoint(*a, **kw))
    ids = _ids()
    grads, buffers = [], []
    for ckpt in (False, True):
        model = tiny_model().double().train()
        model.gradient_checkpointing = ckpt
        for _ in range(2):  # the second step's thresholds start from the first's
            model(ids, targets=torch.roll(ids, -1, 1))["loss"].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        # Backward recomputes each block's forward: its routers must not fold the batch's boundary in twice.
        buffers.append(dict(model.named_buffers()))
    assert calls, "the blocks were not checkpointed"
    torch.testing.assert_close(grads[0], grads[1])
    assert any("threshold" in name for name in buffers[0])
    torch.testing.assert_close(buffers[0], buffers[1], rtol=0, atol=0)


def test_gradient_checkpointing_recomputes_the_causal_choice_with_the_threshold_the_forward_read():
    """``topk_over="causal"`` chooses by the routers' thresholds, which the forward then folds the batch's boundary
    into: the recomputation in backward must read them as the forward did, or it runs other entries and the
    gradients are wrong (thresholds of little weight, early in training, move most)."""
    import copy

    for seed in (1, 4):
        model = tiny_model(seed, topk_over="causal", mod_capacity=0.125, mor_capacity=0.25,
                           max_seq_len=256).double().train()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for block in model.blocks:
                for router in block.routers.values():
                    router.proj.weight.mul_(30)
                    router.threshold_weight.fill_(0.05)
                    router.threshold_sum.fill_(0.05 * float(torch.randn((), generator=g)))
            w = model.blocks[0].routers["1"].proj.weight[0]  # row 0's tokens run hot for the first block's router
            model.embed.weight[:12] += 3.0 * w / w.norm()
        ids = torch.randint(0, 12, (4, 256), generator=g) + 24 * torch.arange(4)[:, None]  # each row its own ids
        grads = []
        for ckpt in (False, True):
            run = copy.deepcopy(model)
            run.gradient_checkpointing = ckpt
            run(ids, targets=ids)["loss"].backward()
            grads.append(torch.cat([p.grad.flatten() for p in run.parameters() if p.grad is not None]))
        torch.testing.assert_close(grads[1], grads[0], msg=f"seed {seed}")


def test_inactive_token_choice_router_keeps_one_stats_row_per_router_name():
    model = tiny_model(mor_routing="token").train()
    model.set_curriculum(mor_active=False)  # the curriculum's MoR-off phase: every depth passes through
    out = model(_ids(2, 40))
    assert out["routing_stats"].shape == (len(model.router_names()), 3)
    assert float(out["ponder_loss"]) == 0.0


def test_token_choice_router_computes_in_the_models_precision():
    # A float64 model's depth choice and gates in float64: in float32 its gradients missed finite differences.
    from hydra_lm.model.routing import TokenChoiceRouter

    router = TokenChoiceRouter(8, 3).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    decision, loss = router.enter(x, None, "hard")
    assert decision.dtype == loss.dtype == torch.float64
    torch.autograd.gradcheck(lambda t: router.enter(t, None, "hard")[0][..., 1:], (x,))


def test_int32_targets_train_on_either_loss_path_and_a_bad_routing_name_is_refused_on_a_static_model():
    model = tiny_model().train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for impl in ("naive", "chunked"):  # the model's check takes int32 targets: both paths must too
        model.ce_impl = impl
        torch.manual_seed(0)
        losses.append(model(ids.int(), targets=torch.roll(ids, -1, 1).int())["ce_loss"])
    torch.testing.assert_close(losses[0], losses[1])
    static = tiny_model(static_routing_mode=True)
    with pytest.raises(ValueError, match="routing='bogus': must be one of"):
        static(ids, routing="bogus")
