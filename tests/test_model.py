"""Behaviour of the model: causality, decode == forward, routing, gradients, sharing."""

import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hydra_lm
from hydra_lm.model.block import TransformerLayer
from hydra_lm.model.decode_step import DecodeStep
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


# ---------------------------------------------------------------------------- decoding
def test_incremental_decode_matches_full_forward(variant):
    name, overrides = variant
    model = tiny_model(**overrides).double().eval()
    ids = _ids(3, 30)
    full = model(ids)["logits"]
    caches = model.init_cache(3, 30)
    prefill = 12
    logits = model.forward_cached(ids[:, :prefill], 0, caches)
    torch.testing.assert_close(logits, full[:, prefill - 1], rtol=0, atol=1e-9)
    for t in range(prefill, 30):
        logits = model.forward_cached(ids[:, t:t + 1], t, caches)
        torch.testing.assert_close(logits, full[:, t], rtol=0, atol=1e-9)


def test_incremental_decode_matches_full_forward_where_deep_routers_rank(monkeypatch):
    """Rows long enough that every depth's router has more earlier candidates than the rank rule's
    pseudo-candidates (fewer of them than the default here, to keep the rows short), so ranks decide at
    every depth, from the decode cache's history."""
    from hydra_lm.model import routing

    monkeypatch.setattr(routing, "RANK_PRIOR", 16.0)
    model = tiny_model(mod_capacity=0.75, mor_capacity=0.75).double().eval()
    ids = _ids(2, 90)
    full = model(ids)
    assert float(full["routing_stats"][:, 0].min()) * 90 > routing.RANK_PRIOR
    caches = model.init_cache(2, 90)
    logits = model.forward_cached(ids[:, :50], 0, caches)
    torch.testing.assert_close(logits, full["logits"][:, 49], rtol=0, atol=1e-9)
    for t in range(50, 90):
        logits = model.forward_cached(ids[:, t:t + 1], t, caches)
        torch.testing.assert_close(logits, full["logits"][:, t], rtol=0, atol=1e-9)


@pytest.mark.parametrize("overrides", [{}, {"mor_routing": "token"}, {"mod_every": 2, "mod_capacity": 0.25},
                                       {"moe": True, "moe_num_layers": 1}, {"static_routing_mode": True}],
                         ids=["expert_choice", "token_choice", "mod_every_2", "moe", "static"])
def test_decode_step_skips_the_units_no_token_enters(overrides):
    """The one-token step (``DecodeStep``) runs only the routed units that some row's token enters (a
    forward of the same token runs them all, masked); skipping changes nothing else: the same logits
    to the bit, step after step, and the same cache contents wherever a slot holds a unit's token."""
    model = tiny_model(**overrides).double().eval()
    calls = []
    for block in model.blocks:
        block.layers[0].register_forward_hook(lambda *_: calls.append(1))
    ids = _ids(1, 40)
    runs = {}
    for stepper in ("forward", "step"):
        caches = model.init_cache(1, 40)
        model.forward_cached(ids[:, :5], 0, caches)
        step = DecodeStep(model, caches, 1, ids.device, graphed=False, compiled=False)
        calls.clear()
        logits = [(model.forward_cached(ids[:, t:t + 1], t, caches) if stepper == "forward"
                   else step(ids[:, t:t + 1], t)).clone() for t in range(5, 40)]
        runs[stepper] = (logits, caches, len(calls), step.unit_calls)
    units = sum(block.recursions for block in model.blocks)
    assert runs["forward"][2] == units * 35
    assert runs["step"][2] == runs["step"][3]  # the step counts what it runs
    if overrides.get("static_routing_mode"):  # every unit, weighted by its gate
        assert runs["step"][2] == units * 35
    else:
        assert 35 <= runs["step"][2] < units * 35 * 0.6  # 22-49% of them run here
    for got, want in zip(runs["step"][0], runs["forward"][0]):
        assert torch.equal(got, want)
    for skipped, full in zip(sum(sum(runs["step"][1], []), []), sum(sum(runs["forward"][1], []), [])):
        valid = full.slot_valid
        assert torch.equal(skipped.slot_valid, valid)
        assert torch.equal(skipped.k * valid[:, None, :, None], full.k * valid[:, None, :, None])
        assert torch.equal(skipped.conv, full.conv) and torch.equal(skipped.shift, full.shift)
        if full.route is not None:  # the router's decode state: the same candidates, logits where one
            candidate = full.route[:, 1:] > 0
            assert torch.equal(skipped.route[:, 1:], full.route[:, 1:])
            assert torch.equal(skipped.route * candidate, full.route * candidate)


@pytest.mark.parametrize("min_skip", [0.0, 1e9, None], ids=["read_every_decision", "read_none", "default"])
def test_decode_step_reads_back_only_decisions_that_skip_often_and_stays_exact(monkeypatch, min_skip):
    """A decision that is not read back runs its units masked: the logits stay the forward's to the bit.
    By default only decisions whose skips save enough units are read: at batch 4 the tiny model's first
    depth (no row enters it with probability 0.5^4, saving 3 units then) runs without a read-back, its
    deeper ones read."""
    from hydra_lm.model import decode_step

    if min_skip is not None:
        monkeypatch.setattr(decode_step, "MIN_UNITS_SAVED", min_skip)
    model = tiny_model().double().eval()
    ids = _ids(4, 30, seed=5)
    full = model(ids)["logits"]
    caches = model.init_cache(4, 30)
    model.forward_cached(ids[:, :5], 0, caches)
    step = DecodeStep(model, caches, 4, ids.device, graphed=False, compiled=False)
    for t in range(5, 30):
        torch.testing.assert_close(step(ids[:, t:t + 1], t), full[:, t], rtol=0, atol=1e-9)
    steps, blocks = 25, len(model.blocks)
    if min_skip == 1e9:  # nothing read back: every unit runs, masked
        assert step.readbacks == 0 and step.unit_calls == blocks * model.config.recursions * steps
    elif min_skip == 0.0:  # every decision reached is read: each block's first and most of the later ones
        assert step.readbacks > 2 * blocks * steps
    else:  # the first depth's decision never, the second's always (it is always reached)
        assert blocks * steps <= step.readbacks <= 2 * blocks * steps
        assert step.unit_calls >= blocks * steps


@pytest.mark.parametrize("batch,reads", [(1, 2), (4, 2), (8, 0), (32, 0)])
def test_a_mod_decision_that_skips_one_unit_is_read_back_only_where_it_saves_half_a_unit(batch, reads):
    """MoD only (one recursion): a skip saves one unit, so a router of capacity 0.125 is read back while
    no row enters it at least half the time (0.875^B >= 0.5: batch <= 5), not at batch 8 or 32."""
    model = tiny_model(n_blocks=4, recursions=1, mod_every=2, mod_capacity=0.125).eval()
    step = DecodeStep(model, model.init_cache(batch, 16), batch, "cpu", graphed=False, compiled=False)
    assert sum(op.decides for op in step._ops) == reads


def test_decisions_on_the_device_need_a_graphed_cuda_step_and_say_why_not():
    """Decisions as CUDA graph IF nodes (graph_conditionals) are built only for a graphed CUDA step; asked
    for elsewhere, the step refuses with the reason, and by default it reads decisions back."""
    from hydra_lm.model import graph_conditionals

    assert "not a CUDA device" in graph_conditionals.unavailable_reason(torch.device("cpu"))
    model = tiny_model().eval()
    step = DecodeStep(model, model.init_cache(2, 16), 2, "cpu", graphed=False, compiled=False)
    assert not step.device_decisions
    with pytest.raises(ValueError, match="IF nodes, unavailable here: the step is not graphed"):
        DecodeStep(model, model.init_cache(2, 16), 2, "cpu", graphed=False, compiled=False, device_decisions=True)


@pytest.mark.parametrize("overrides", [{}, {"mor_routing": "token"}, {"n_blocks": 4, "recursions": 1, "mod_every": 1},
                                       {"moe": True, "moe_num_layers": 1}])
def test_the_composed_step_runs_the_ops_the_read_back_loop_runs(overrides):
    """The IF-node layout (DecodeStep.composition), walked with any decisions' outcomes, runs exactly the
    ops, in the order, that the read-back loop runs with those outcomes; every op sits in one segment."""
    model = tiny_model(**overrides).eval()
    step = DecodeStep(model, model.init_cache(1, 16), 1, "cpu", graphed=False, compiled=False)
    ops, layout = step._ops, step.composition()
    decisions = [i for i, op in enumerate(ops) if op.decides]
    assert decisions

    def walk(plan, entered, out):
        for start, end, guarded in plan:
            out += range(start, end + 1)
            if guarded is not None and entered[end]:
                walk(guarded, entered, out)
        return out

    every = walk(layout, dict.fromkeys(decisions, True), [])
    assert every == list(range(len(ops)))  # all entered: each op once, in order
    rng = random.Random(0)
    for _ in range(50):
        entered = {i: rng.random() < 0.5 for i in decisions}
        loop, i = [], 0
        while i < len(ops):  # DecodeStep.__call__'s read-back control flow
            end = step._ends[i]
            loop += range(i, end + 1)
            i = end + 1 if not ops[end].decides or entered[end] else ops[end].skip_to
        assert walk(layout, entered, []) == loop


@pytest.mark.parametrize("overrides", [{}, {"arch": "dense", "n_layers": 2}, {"tie_embeddings": False}])
def test_under_autocast_the_decode_step_casts_linear_weights_once_and_gives_the_same_logits(monkeypatch, overrides):
    """Under bf16 autocast DecodeStep runs its units and head on copies whose Linear weights are bf16 once
    (decode_step.decode_weights), sharing every other parameter: the logits are, to the bit, those of the step
    that lets autocast cast the fp32 weights at every call; the model itself is untouched. Where the CCGQA decode
    kernel runs, the copies also hold each grouped conv's weight laid out by tap."""
    from hydra_lm.model import decode_step

    model = tiny_model(**overrides).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = model.blocks[0].layers
    cast = decode_step.decode_weights(layers, torch.bfloat16, conv_taps=False)
    linear = [m for m in cast.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(m.weight.dtype == torch.bfloat16 and not m.weight.requires_grad for m in linear)
    assert cast[0].attn_norm.weight is layers[0].attn_norm.weight  # shared, not copied
    assert decode_step.decode_weights(cast, torch.bfloat16, conv_taps=False) is cast  # nothing left to cast
    assert decode_step.decode_weights(layers, None, conv_taps=False) is layers
    if overrides.get("arch") != "dense":
        taps = decode_step.decode_weights(layers, None, conv_taps=True)
        conv = layers[0].attn.conv_ch.weight  # [C, D, KC]
        assert taps[0].attn.qkv.weight is layers[0].attn.qkv.weight
        laid_out = taps[0].attn.conv_ch_taps
        assert torch.equal(laid_out, conv.permute(2, 0, 1)) and laid_out.is_contiguous()
        assert "conv_ch_taps" not in taps.state_dict() and not hasattr(layers[0].attn, "conv_ch_taps")
    ids = _ids(2, 16, seed=4)
    runs = []
    for precast in (True, False):
        if not precast:
            monkeypatch.setattr(decode_step, "decode_weights", lambda m, dtype, conv_taps: m)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            caches = model.init_cache(2, 16)
            model.forward_cached(ids[:, :4], 0, caches)
            step = DecodeStep(model, caches, 2, "cpu", graphed=False, compiled=False)
            runs.append(torch.stack([step(ids[:, t:t + 1], t).clone() for t in range(4, 16)]))
    assert torch.equal(runs[0], runs[1])
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())


@pytest.mark.parametrize("arch", ["hydra", "dense"])
def test_under_autocast_the_cache_is_stored_in_its_dtype_and_decoding_loses_nothing(arch):
    """init_cache under bf16 autocast: every cached value in bf16 (half an fp32 cache), and the prefill and
    one-token steps give, to the bit, the logits of an fp32 cache (and the full forward's within bf16
    rounding: its attention runs over other shapes)."""
    overrides = {"arch": "dense", "n_layers": 2} if arch == "dense" else {}
    model = tiny_model(**overrides).eval()
    ids = _ids(2, 20, seed=3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(ids)["logits"]
        runs = []
        for dtype in (None, torch.float32):
            caches = model.init_cache(2, 32, dtype=dtype)
            kv = [t for block in caches for depth in block for cache in depth
                  for t in (cache.k, cache.v, cache.conv, cache.shift) if t is not None]
            assert {t.dtype for t in kv} == {torch.bfloat16 if dtype is None else torch.float32}
            logits = [model.forward_cached(ids[:, :5], 0, caches)]
            logits += [model.forward_cached(ids[:, t:t + 1], t, caches) for t in range(5, 20)]
            runs.append(torch.stack(logits, 1))
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0], full[:, 4:], rtol=0.02, atol=0.02)
    assert model.init_cache(1, 8)[0][0][0].k.dtype == torch.float32  # outside autocast: the weights' dtype


def test_greedy_generate_equals_repeated_full_forwards(variant):
    name, overrides = variant
    model = tiny_model(**overrides).double().eval()
    prompt = _ids(2, 9, seed=5)
    generated = model.generate(prompt, max_new_tokens=14)
    tokens = prompt
    for _ in range(14):
        nxt = model(tokens)["logits"][:, -1].argmax(-1)
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)
    assert torch.equal(generated, tokens)


def test_generate_restores_training_mode_and_checks_inputs():
    model = tiny_model().train()
    out = model.generate(_ids(1, 5), max_new_tokens=3, temperature=0.8, top_k=5, top_p=0.9,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and model.training
    with pytest.raises(ValueError, match="token ids"):
        model.generate(torch.tensor([[0, TINY["vocab_size"]]]), 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(_ids(1, 100), 50)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model and the prompt on a CUDA device"):
        model.generate(_ids(1, 5), 2, cuda_graph=True)
    # Sampling arguments are checked before the prefill, also when no token is to be sampled.
    for kwargs, message in ((dict(temperature=float("nan")), "temperature=nan must be a finite number"),
                            (dict(temperature=-1.0), "temperature=-1.0 must be"), (dict(top_k=2.5), "top_k=2.5"),
                            (dict(top_k=True), "top_k=True"), (dict(top_p=5), "top_p=5 must lie in"),
                            (dict(eos_token_id=TINY["vocab_size"]), "eos_token_id=")):
        for n in (0, 2):
            with pytest.raises(ValueError, match=message):
                model.generate(_ids(1, 5), n, **kwargs)


def test_a_tiny_temperature_samples_the_argmax():
    from hydra_lm.model.sampling import sample_next

    logits = torch.tensor([[0.5, 3.0, -1.0], [2.0, -4.0, 1.9]])
    for temperature in (1e-40, 1e-30):  # logits / temperature would overflow float32 to inf, and softmax to NaN
        assert sample_next(logits, temperature).tolist() == [1, 0]


def test_forward_names_token_ids_the_embedding_cannot_look_up():
    model = tiny_model()
    for ids in (torch.tensor([[0, TINY["vocab_size"]]]), torch.tensor([[3, -1]])):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
            model(ids)
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
            model.forward_cached(ids, 0, model.init_cache(1, 16))
    for dtype in (torch.float32, torch.uint8):
        with pytest.raises(ValueError, match=f"integer tensor \\(int64 or int32\\), got {dtype}"):
            model(torch.zeros(1, 4, dtype=dtype))
    with pytest.raises(ValueError, match="batch>0, length>0"):
        model.generate(torch.zeros(0, 4, dtype=torch.long), 2)
    for ids in (torch.arange(8), torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\] with both > 0"):
            model(ids)
    with pytest.raises(ValueError, match="doc_ids must have input_ids' shape"):
        model(torch.zeros(2, 4, dtype=torch.long), doc_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens=2.5 must be an integer >= 0"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 2.5)


def test_generate_stops_at_eos():
    model = tiny_model().double().eval()
    prompt = _ids(1, 6)
    first = model.generate(prompt, 1)[0, -1].item()
    out = model.generate(prompt, 10, eos_token_id=first)
    assert out.shape[1] == 7 and out[0, -1].item() == first


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
    torch.testing.assert_close(y, ref)


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


def test_inactive_token_choice_router_keeps_one_stats_row_per_router_name():
    model = tiny_model(mor_routing="token").train()
    model.set_curriculum(mor_active=False)  # the curriculum's MoR-off phase: every depth passes through
    out = model(_ids(2, 40))
    assert out["routing_stats"].shape == (len(model.router_names()), 3)
    assert float(out["ponder_loss"]) == 0.0
