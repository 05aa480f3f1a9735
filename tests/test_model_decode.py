"""Decoding of the model: incremental decode == full forward, the decode step's unit skipping and read-backs,
autocast, generate and sampling, and the checks of their inputs."""

import random

import numpy as np
import pytest
import torch

from hydra_lm.model.decode_step import DecodeStep

from support import TINY, tiny_model


def _ids(b=2, t=40, seed=1, vocab=TINY["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


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


def _random_routing(rng: random.Random) -> dict:
    """A routing configuration drawn over what the config accepts (some draws it refuses)."""
    cfg = dict(sharing=rng.choice(["sequence", "middle_cycle"]), recursions=rng.choice([1, 2, 3, 4]),
               mod_enabled=rng.random() < 0.85, mor_enabled=rng.random() < 0.85,
               mod_capacity=rng.choice([0.125, 0.25, 0.5, 0.75, 1.0]), mor_capacity=rng.choice([0.125, 0.25, 0.5]),
               mor_routing=rng.choice(["expert", "token"]),
               mor_capacity_schedule=rng.choice(["geometric", "paper", "layer_aware"]),
               mod_first_block=rng.random() < 0.3, topk_over=rng.choice(["row", "batch", "causal"]),
               static_routing_mode=rng.random() < 0.1, qk_mean=rng.random() < 0.8, value_shift=rng.random() < 0.8)
    cfg["n_blocks"] = rng.choice([3, 4]) if cfg["sharing"] == "middle_cycle" else rng.choice([1, 2, 3])
    cfg["mod_every"] = 1 if cfg["sharing"] == "middle_cycle" else rng.choice([1, 2, 3])
    if cfg["topk_over"] != "row":
        cfg["topk_groups"] = rng.choice([1, 2])
    if rng.random() < 0.3:
        cfg.update(moe=True, moe_num_layers=rng.choice([1, 2]), moe_num_experts=3, moe_top_k=rng.choice([1, 2]))
    return cfg


@pytest.mark.parametrize("seed", range(3))
def test_the_decode_step_gives_the_full_forwards_logits_over_random_routing_configs(seed):
    """Beyond the named variants: eight random routing configurations the config accepts (sharing, depths, MoD
    placement and capacity, expert- or token-choice MoR and its schedule, training's top-k over rows, the batch or
    the causal rule's admissions, static routing, MoE), each after training-mode forwards have moved its routers'
    calibration: a prompt's prefill and then generate's one-token step give the full forward's logits (fp64)."""
    rng, checked = random.Random(seed), 0
    while checked < 8:
        overrides = _random_routing(rng)
        try:
            model = tiny_model(seed=checked, **overrides).double()
        except ValueError:  # a combination the config refuses (test_config.py)
            continue
        with torch.no_grad():
            for _ in range(3):
                model(_ids(4, 64, seed=checked))
            model.eval()
            ids = _ids(4, 40, seed=seed)
            full = model(ids)["logits"]
            caches = model.init_cache(4, 40)
            err = (model.forward_cached(ids[:, :11], 0, caches) - full[:, 10]).abs().max()
            assert err < 1e-9, f"{overrides}: the prefill's logits differ by {err:.3g}"
            step = DecodeStep(model, caches, 4, torch.device("cpu"), graphed=False, compiled=False)
            for t in range(11, 40):
                err = (step(ids[:, t:t + 1], t) - full[:, t]).abs().max()
                assert err < 1e-9, f"{overrides}: the step's logits at position {t} differ by {err:.3g}"
        checked += 1


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


def _greedy_alone(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    tokens = prompt[None]
    with torch.no_grad():
        for _ in range(n):
            tokens = torch.cat((tokens, model(tokens)["logits"][:, -1].argmax(-1)[:, None]), dim=1)
    return tokens[0]


def test_prompts_of_several_lengths_decode_each_as_it_would_alone(variant):
    """A list of prompts of different lengths decodes as one batch, each row from the end of its own prompt: each
    result is its prompt and the tokens repeated full forwards of that prompt alone pick. The padding after a shorter
    prompt must reach no cache: no K/V slot, no conv or value-shift state, no router's earlier candidates (the
    routers' logits drifted and calibrated, so causal routing ranks and thresholds decide as after training)."""
    from test_causal_routing import _calibrate, _drift

    name, overrides = variant
    model = tiny_model(**overrides)
    _drift(model)
    _calibrate(model, batches=3)
    model = model.double().eval()
    prompts = [_ids(1, n, seed=n)[0] for n in (13, 3, 8)]
    out = model.generate(prompts, max_new_tokens=9)
    assert isinstance(out, list) and len(out) == 3
    for prompt, got in zip(prompts, out):
        assert torch.equal(got, _greedy_alone(model, prompt, 9))
    # Token id lists decode alike; prompts of one length take the tensor path's positions.
    assert all(torch.equal(a, b) for a, b in zip(model.generate([p.tolist() for p in prompts], 9), out))
    same = model.generate([prompts[0][:5], prompts[2][:5]], 4)
    assert torch.equal(torch.stack(same), model.generate(torch.stack([prompts[0][:5], prompts[2][:5]]), 4))


def test_each_prompt_of_a_batch_stops_after_its_own_eos():
    model = tiny_model().double().eval()
    prompts = [_ids(1, 7, seed=2)[0], _ids(1, 4, seed=3)[0]]
    free = model.generate(prompts, 6)
    eos = int(free[1][4 + 2])  # the shorter prompt's third new token
    out = model.generate(prompts, 6, eos_token_id=eos)
    for prompt, row, got in zip(prompts, free, out):
        first = (row[len(prompt):] == eos).nonzero()
        stop = len(prompt) + (int(first[0]) + 1 if len(first) else 6)
        assert torch.equal(got, row[:stop])
    assert out[1][-1] == eos and len(out[1]) <= 4 + 3
    # The shorter prompt, eos included, is what it gets alone.
    alone = model.generate([prompts[1]], 6, eos_token_id=eos)[0]
    assert torch.equal(alone, out[1])


def test_sampled_prompts_of_a_batch_draw_as_each_alone_with_a_generator_per_row():
    model = tiny_model().double().eval()
    prompts = [_ids(1, 7, seed=2)[0], _ids(1, 4, seed=3)[0]]

    def generators(*seeds):
        return [torch.Generator().manual_seed(seed) for seed in seeds]

    batch = model.generate(prompts, 8, temperature=1.0, top_k=20, generator=generators(5, 6))
    for prompt, seed, got in zip(prompts, (5, 6), batch):
        assert torch.equal(got, model.generate([prompt], 8, temperature=1.0, top_k=20, generator=generators(seed))[0])
    with pytest.raises(ValueError, match="a sequence of 2 generators for 3 rows: pass one per row"):
        model.generate([*prompts, prompts[0]], 2, temperature=1.0, generator=generators(5, 6))


def test_prompts_of_several_lengths_are_checked():
    model = tiny_model().eval()
    for prompts, message in (([], "non-empty list"), ("abc", "not text"),
                             ([[1, 2], []], r"prompt 1 has shape \(0,\)"),
                             ([[1, 2], [[3]]], r"prompt 1 has shape \(1, 1\)"),
                             ([5, 17, 3], r"prompt 0 has shape \(\).*pass \[\[ids...\]\]"),
                             ([[1, 2], [0.5]], "prompt 1 holds torch.float32 values"),
                             ([[1, 2], [True]], "prompt 1 holds torch.bool values"),
                             ([[1, 2], [TINY["vocab_size"]]], r"token ids must lie in \[0, "),
                             ([[1] * 120, [2]], r"the longest prompt \(120\) \+ max_new_tokens \(20\) exceeds")):
        with pytest.raises(ValueError, match=message):
            model.generate(prompts, 20)
    # Any integer dtype and any iterable of prompts.
    prompts = [torch.tensor([3, 1, 4], dtype=torch.uint8), torch.tensor([1, 5], dtype=torch.int16)]
    out = model.generate(iter(prompts), 2)
    assert [o[:len(p)].tolist() for o, p in zip(out, prompts)] == [[3, 1, 4], [1, 5]]
    assert [len(o) for o in out] == [5, 4]


def test_the_decode_step_checks_each_rows_position():
    """Rows behind the longest prompt's (``set_prompt_lengths``) must not step before position 0; every position
    must fit the caches; the lengths must be one per row."""
    model = tiny_model().eval()
    caches = model.init_cache(2, 16)
    step = DecodeStep(model, caches, 2, torch.device("cpu"), graphed=False, compiled=False)
    ids = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="outside the caches' 16 positions; allocate"):
        step(ids, 16)
    step.set_prompt_lengths(torch.tensor([9, 3]))
    with pytest.raises(ValueError, match=r"position 5 is outside the caches' 16 positions \(or a row 6 behind it\)"):
        step(ids, 5)
    step(ids, 6)
    assert step.pos[:, 0].tolist() == [6, 0]
    step.set_prompt_lengths(None)
    step(ids, 6)
    assert step.pos[:, 0].tolist() == [6, 6]
    with pytest.raises(ValueError, match="one per row"):
        step.set_prompt_lengths(torch.tensor([9, 3, 4]))


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
                            (dict(top_k=True), "top_k=True"), (dict(temperature=True), "temperature=True"),
                            (dict(top_p=5), "top_p=5 must lie in"),
                            (dict(eos_token_id=TINY["vocab_size"]), "eos_token_id="),
                            (dict(eos_token_id=2.5), "eos_token_id=2.5 must be an integer")):
        for n in (0, 2):
            with pytest.raises(ValueError, match=message):
                model.generate(_ids(1, 5), n, **kwargs)


def test_a_tiny_temperature_samples_the_argmax():
    from hydra_lm.model.sampling import sample_next

    logits = torch.tensor([[0.5, 3.0, -1.0], [2.0, -4.0, 1.9]])
    for temperature in (1e-40, 1e-30):  # logits / temperature would overflow float32 to inf, and softmax to NaN
        assert sample_next(logits, temperature).tolist() == [1, 0]


def test_float64_logits_are_sampled_in_float64():
    from hydra_lm.model.sampling import sample_next

    logits = torch.tensor([[1.0, 1.0 + 1e-9]], dtype=torch.float64)  # one value in float32: a coin toss there
    gen = torch.Generator().manual_seed(0)
    assert [sample_next(logits, 1e-30, generator=gen).item() for _ in range(50)] == [1] * 50
    # a temperature that rounds to 0 in fp32: still the top token, not 0 / 0
    assert sample_next(torch.tensor([[0.0, 5.0, 4.0]]), 1e-46, generator=gen).tolist() == [1]


def test_top_k_and_top_p_keep_every_token_tied_with_the_last_one_they_keep():
    from hydra_lm.model.sampling import sample_next

    gen = torch.Generator().manual_seed(0)

    def drawn(logits, **cut):
        return {sample_next(torch.tensor([logits]), 1.0, generator=gen, **cut).item() for _ in range(400)}

    assert drawn([0.0, 0.0, 0.0, 0.0], top_p=0.5) == {0, 1, 2, 3}  # not the first half by index
    assert drawn([1.5, 1.0, 1.0, 0.0], top_p=0.5) == {0, 1, 2}
    assert drawn([3.0, 1.0, 1.0, 0.0], top_p=0.5) == {0}  # the top alone holds more than half
    assert drawn([1.0, 3.0, 0.0, 2.9], top_p=0.5) == {1, 3}  # the nucleus by probability, not by index
    assert drawn([1.0, 1.0, 1.0, 0.0], top_k=1) == {0, 1, 2}
    assert drawn([1.0, 1.0, 0.5, 0.0], top_k=3) == {0, 1, 2}


def test_sampling_takes_numpy_numbers_and_names_what_it_cannot_use():
    from hydra_lm.model.sampling import sample_next

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    for cut in (dict(temperature=np.float32(0.5)), dict(top_k=np.int64(2)), dict(top_p=np.float32(0.9))):
        assert sample_next(logits, **{"temperature": 1.0, **cut}).item() in range(4)
    for cut, message in ((dict(top_k=np.float32(2.0)), r"top_k=np.float32\(2.0\) must be an integer >= 1"),
                         (dict(temperature=np.bool_(True)), "temperature=np.True_ must be a finite number"),
                         (dict(top_p=np.float64(1.5)), r"top_p=np.float64\(1.5\) must lie in")):
        with pytest.raises(ValueError, match=message):
            sample_next(logits, **{"temperature": 1.0, **cut})


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
    # Targets: the fused loss scored one just past the vocabulary (inside its padded width) as inf
    ids = torch.tensor([[1, 2, 3]])
    for targets in (torch.tensor([[2, 3, TINY["vocab_size"]]]), torch.tensor([[2, -1, 4]])):
        with pytest.raises(ValueError, match=r"targets must lie in \[0, 97\) \(or -100: ignored\)"):
            model(ids, targets=targets)
    assert torch.isfinite(model(ids, targets=torch.tensor([[2, -100, 4]]))["loss"])
    with pytest.raises(ValueError, match=r"targets must have input_ids' shape \[1, 3\], got \[1, 2\]"):
        model(ids, targets=torch.tensor([[2, 3]]))
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


def test_a_cache_longer_than_the_rotary_table_is_refused():
    model = tiny_model().eval()
    with pytest.raises(ValueError, match="cache of 129 positions is longer than the model's max_seq_len"):
        model.init_cache(1, model.config.max_seq_len + 1)


def _flags(model) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def test_generate_gives_every_submodule_its_own_train_eval_flag_back():
    """generate runs in eval mode, then restores each module's flag as it found it, not the top-level one for all:
    routers frozen with ``.eval()`` (no threshold calibration) in a model that trains must stay frozen."""
    model = tiny_model(moe=True, moe_num_layers=1).train()
    for router in (r for block in model.blocks for r in block.all_routers()):
        router.eval()
    model.norm.eval()
    for setup in (lambda: None, lambda: (model.eval(), model.blocks[1].train())):
        setup()
        before = _flags(model)
        assert len(set(before.values())) == 2  # a mix of both
        model.generate(_ids(2, 5), max_new_tokens=3)
        assert _flags(model) == before


def test_generate_takes_numpy_and_0_dim_tensor_integers():
    """max_new_tokens, eos_token_id and top_k take any integer, as top_k always took a NumPy one; not a bool, a float
    or a tensor of more than one value."""
    model = tiny_model().eval()
    prompt = _ids(2, 5)
    eos = int(model.generate(prompt, 1)[0, -1])  # row 0's first new token: it stops there
    want = model.generate([*prompt], 4, eos_token_id=eos)
    for steps, stop in ((np.int64(4), np.int64(eos)), (torch.tensor(4), torch.tensor(eos, dtype=torch.int32))):
        got = model.generate([*prompt], steps, eos_token_id=stop)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got[0]) == 6
    sample = dict(temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.generate(prompt, 3, top_k=torch.tensor(2), **sample),
                       model.generate(prompt, 3, top_k=2, **{**sample, "generator": torch.Generator().manual_seed(0)}))
    for kwargs, message in ((dict(max_new_tokens=np.bool_(True)), "max_new_tokens=np.True_ must be an integer"),
                            (dict(max_new_tokens=torch.tensor(2.0)), r"max_new_tokens=tensor\(2.\) must be"),
                            (dict(max_new_tokens=torch.tensor([2])), r"max_new_tokens=tensor\(\[2\]\) must be"),
                            (dict(max_new_tokens=np.int64(-1)), r"max_new_tokens=np.int64\(-1\) must be"),
                            (dict(max_new_tokens=2, eos_token_id=torch.tensor(True)), "eos_token_id=tensor"),
                            (dict(max_new_tokens=2, eos_token_id=np.int64(TINY["vocab_size"])), "eos_token_id=np"),
                            (dict(max_new_tokens=2, top_k=torch.tensor(0)), r"top_k=tensor\(0\) must be")):
        with pytest.raises(ValueError, match=message):
            model.generate(prompt, **kwargs)


def test_a_prompt_of_a_list_out_of_the_vocabulary_is_named_before_padding():
    """Each prompt's ids are checked before the padding: the error names the prompt and its own range, not the
    padded batch's (whose 0s hid a negative id's row and showed a 0 no prompt held)."""
    model = tiny_model().eval()
    vocab = TINY["vocab_size"]
    for prompts, message in (([[1, 2], [999]], rf"prompt 1: token ids must lie in \[0, {vocab}\), got \[999, 999\]"),
                             ([[5, 6, 7], [3, -1]], rf"prompt 1: token ids must lie in \[0, {vocab}\), got \[-1, 3\]"),
                             ([torch.tensor([vocab]), [1]], r"prompt 0: .* got \[97, 97\]")):
        with pytest.raises(ValueError, match=message):
            model.generate(prompts, 3)


def test_forward_cached_refuses_a_batch_other_than_the_caches():
    model = tiny_model().eval()
    for rows, cache_rows in ((2, 1), (1, 3)):
        with pytest.raises(ValueError, match=rf"a batch of {rows} rows for caches of {cache_rows}; allocate caches "
                                             rf"for this batch \(init_cache\({rows}, length\)\)"):
            model.forward_cached(_ids(rows, 4), 0, model.init_cache(cache_rows, 16))
    for ids, valid in ((_ids(2, 0), None), (_ids(2, 4)[0], None), (_ids(2, 4), torch.ones(2, 3, dtype=torch.bool)),
                       (_ids(2, 4), torch.ones(2, 4))):
        with pytest.raises(ValueError, match="forward_cached: (input_ids must be|valid must be)"):
            model.forward_cached(ids, 0, model.init_cache(2, 16), valid=valid)
    caches = model.init_cache(2, 16)  # autograd on (the default): the caches are written, not recorded for it
    model.forward_cached(_ids(2, 4), 0, caches)
    assert not caches[0][0][0].k.requires_grad


def test_forward_cached_in_training_mode_gives_the_eval_forwards_logits():
    """Cached decoding routes causally whatever the mode; an MoE block's router jitter (training only) would make
    it drift from the eval forward that generate's tokens are defined by, so the cached path never jitters."""
    model = tiny_model(moe=True, moe_num_layers=2, moe_router_jitter=0.5).double().eval()
    ids = _ids(2, 12)
    with torch.no_grad():
        full = model(ids)["logits"]
        model.train()
        caches = model.init_cache(2, 12)
        logits = [model.forward_cached(ids[:, :8], 0, caches)]
        logits += [model.forward_cached(ids[:, t:t + 1], t, caches) for t in range(8, 12)]
    for t, got in zip(range(7, 12), logits):
        torch.testing.assert_close(got, full[:, t], rtol=0, atol=1e-9)
    assert model.training
