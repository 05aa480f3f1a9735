"""The compiled one-token decode step (``generate``'s default on CUDA, ``compile_step=True`` elsewhere):
every routed unit runs one compiled ``run_cached_unit`` and every router one compiled
``decide_entries``. Against the eager step: the same greedy tokens, one unit graph for all units and
blocks, one decision graph per router signature, no recompilation per unit or per position. The prompt's
prefill then runs one compiled ``run_prefill_block`` per block (dynamic shapes): the eager prefill's logits
and decode state exactly, and no recompilation per prompt length. On a CPU they compile with "aot_eager"
(``decode_step._compile_for_decode``)."""

import pytest
import torch

import hydra_lm
from hydra_lm.model import decode_step as decode_module
from hydra_lm.model.block import run_cached_unit, run_prefill_block
from hydra_lm.model.decode_step import decide_entries

from support import TINY, compiled_graphs, tiny_model
from test_causal_routing import _calibrate, _drift


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _compiled_unit_calls(monkeypatch) -> list:
    calls = []
    compiled = decode_module.compiled_decode_unit

    def counting(device):
        unit = compiled(device)
        return lambda *args: calls.append(1) or unit(*args)

    monkeypatch.setattr(decode_module, "compiled_decode_unit", counting)
    return calls


def _full_forward_tokens(model, prompt, n: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat((tokens, model(tokens)["logits"][:, -1].argmax(-1)[:, None]), dim=1)
    return tokens


@pytest.mark.parametrize("overrides", [{}, dict(mor_routing="token"), dict(static_routing_mode=True)],
                         ids=["hydra", "token_choice", "static"])
def test_compiled_decode_step_gives_the_eager_steps_greedy_tokens(fresh_dynamo, monkeypatch, overrides):
    model = tiny_model(**overrides)
    _drift(model)
    _calibrate(model, batches=5)  # causal routing with calibrated thresholds, as after training
    model = model.double().eval()
    prompt = torch.randint(0, TINY["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(0))
    eager = model.generate(prompt, max_new_tokens=20, compile_step=False)
    calls = _compiled_unit_calls(monkeypatch)
    compiled = model.generate(prompt, max_new_tokens=20, compile_step=True)
    # Every unit of every block, at every position, hits the first unit's graph: a recompilation per
    # unit (a guard on its layers or caches) would show here; per position or per call, below.
    assert compiled_graphs(run_cached_unit) == 1
    # One decision graph per router signature: whether an earlier depth masked the candidates (expert
    # choice), or per depth (token choice reads its decision's column of that depth).
    decisions = compiled_graphs(decide_entries)
    assert 1 <= decisions <= TINY["recursions"] + 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        longer = model.generate(prompt, max_new_tokens=25, compile_step=True)  # same cache bucket: reused
    assert torch.equal(compiled, eager) and torch.equal(longer[:, :27], eager)
    units = TINY["n_blocks"] * TINY["recursions"]
    # The steps after the first token run compiled units, except the units that no row's token enters:
    # skipped (test_model_decode.py). Static routing runs every unit.
    if overrides.get("static_routing_mode"):
        assert len(calls) == units * (19 + 24)
    else:
        assert 0 < len(calls) < units * (19 + 24)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])  # a break would hint at a host sync
    assert counters["stats"]["unique_graphs"] == 1 + decisions + compiled_graphs(run_prefill_block)
    assert torch.equal(compiled, _full_forward_tokens(model, prompt, 20))  # and what full forwards pick


def _same(got, want, atol: float) -> None:
    if atol:
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    else:
        assert torch.equal(got, want)


def assert_same_decode_state(caches, want, atol: float = 0.0) -> None:
    """The decode state a prefill leaves, as the next steps read it: which slots entered each unit, their K/V
    and every conv and value-shift state exactly; each expert-choice router's candidates and their logits. A
    compiled prefill runs every unit on all its candidates, the ones not admitted masked, so it also writes
    K/V slots marked invalid and the logits of positions that were no candidate, which nothing reads."""
    for block, want_block in zip(caches, want, strict=True):
        for depth, want_depth in zip(block, want_block, strict=True):
            for got, ref in zip(depth, want_depth, strict=True):
                valid = ref.slot_valid
                assert torch.equal(got.slot_valid, valid)
                for name in ("k", "v"):  # [B, heads, L, d]
                    mask = valid[:, None, :, None]
                    _same(torch.where(mask, getattr(got, name), 0), torch.where(mask, getattr(ref, name), 0), atol)
                for name in ("conv", "shift"):
                    assert (getattr(got, name) is None) == (getattr(ref, name) is None)
                    if getattr(ref, name) is not None:
                        _same(getattr(got, name), getattr(ref, name), atol)
                if ref.route is not None:  # [B, 2, L]: logit, 1 if a candidate
                    candidate = ref.route[:, 1] > 0
                    assert torch.equal(got.route[:, 1], ref.route[:, 1])
                    _same(torch.where(candidate, got.route[:, 0], 0), torch.where(candidate, ref.route[:, 0], 0), atol)


@pytest.mark.parametrize("overrides", [{}, dict(mor_routing="token"), dict(static_routing_mode=True)],
                         ids=["hydra", "token_choice", "static"])
def test_compiled_prefill_writes_the_eager_prefills_decode_state_and_logits(fresh_dynamo, overrides):
    """The compiled prefill (one graph per block layout, every unit on all its candidates) against the eager
    one (each unit cut after its last admitted entry): the same last logits and the same decode state, for
    prompts whose admitted prefixes differ by unit; a second prompt length reuses the graphs (the lengths are
    symbols, not constants)."""
    model = tiny_model(**overrides)
    _drift(model)
    _calibrate(model, batches=5)
    model = model.double().eval()
    with torch.no_grad():
        for i, t in enumerate((23, 40)):
            prompt = torch.randint(0, TINY["vocab_size"], (2, t), generator=torch.Generator().manual_seed(i))
            eager_caches, caches = model.init_cache(2, 64), model.init_cache(2, 64)
            eager = model.forward_cached(prompt, 0, eager_caches)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                logits = model.forward_cached(prompt, 0, caches, compiled=True)
            assert torch.equal(logits, eager)
            assert_same_decode_state(caches, eager_caches)
    # One graph per block layout: TINY's first block has no MoD router, the others have one.
    assert compiled_graphs(run_prefill_block) == 2
    assert not torch._dynamo.utils.counters["graph_break"]


# Compiled (aot_eager on a CPU) traces the same code as eager, so one routing layout is compiled (each ~35 s here).
@pytest.mark.parametrize("overrides,compiled", [({}, False), ({}, True), (dict(mor_routing="token"), False),
                                                (dict(moe=True, moe_num_layers=2), False),
                                                (dict(static_routing_mode=True), False),
                                                (dict(static_routing_mode=True, mor_routing="token"), False)],
                         ids=["hydra-eager", "hydra-compiled", "token_choice-eager", "moe-eager", "static-eager",
                              "static_token_choice-eager"])
def test_a_padded_prompt_prefills_as_the_prompt_alone(fresh_dynamo, overrides, compiled):
    """A prompt padded to a longer length with its tokens marked ``valid`` (what a prefill of one graph per bucket
    of lengths would run) takes the routing decisions of the prompt alone, leaves its decode state and gives its
    logits, and the tokens after it then decode alike: values to rounding (float64; the matmuls see more rows),
    decisions exactly."""
    model = tiny_model(**overrides)
    _drift(model)
    _calibrate(model, batches=5)
    model = model.double().eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 21), generator=g)
    padded = torch.cat((prompt, torch.randint(0, TINY["vocab_size"], (2, 11), generator=g)), 1)
    valid = (torch.arange(32) < 21).expand(2, 32)
    with torch.no_grad():
        want_caches, caches = model.init_cache(2, 64), model.init_cache(2, 64)
        want = model.forward_cached(prompt, 0, want_caches)
        got = model.forward_cached(padded, 0, caches, compiled=compiled, valid=valid)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert_same_decode_state(caches, want_caches, atol=1e-12)
        following = torch.randint(0, TINY["vocab_size"], (2, 5), generator=g)
        after = model.forward_cached(following, 21, caches)
        torch.testing.assert_close(after, model.forward_cached(following, 21, want_caches), rtol=0, atol=1e-12)
        assert_same_decode_state(caches, want_caches, atol=1e-12)


def test_compiled_decode_step_of_the_100M_layout_is_one_graph(fresh_dynamo):
    """The 100M preset's layout (8 blocks x 4 recursions, MoD on every second block, so the first
    unit of the others has no router), narrowed: its 32 units share one graph, its 28 routers two (routers
    whose candidates an earlier depth masked, and the others)."""
    torch.manual_seed(0)
    model = hydra_lm.create_model("100M", vocab_size=128, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=128,
                                  max_seq_len=64).eval()
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    eager = model.generate(prompt, max_new_tokens=4)
    assert torch.equal(model.generate(prompt, max_new_tokens=4, compile_step=True), eager)
    assert compiled_graphs(run_cached_unit) == 1 and compiled_graphs(decide_entries) == 2


def test_units_of_different_layer_stacks_compile_one_graph_each(fresh_dynamo):
    """middle_cycle: a one-layer first and last block around a shared two-layer middle block (with a
    recursion embedding): two unit signatures, two unit graphs, then no recompilation. Without MoD, so
    that the middle block's first unit runs on every token (a unit no token enters is skipped)."""
    model = tiny_model(sharing="middle_cycle", n_blocks=4, mod_enabled=False).double().eval()
    prompt = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    eager = model.generate(prompt, max_new_tokens=8)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, compile_step=True), eager)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(prompt, max_new_tokens=8, compile_step=True), eager)
    assert compiled_graphs(run_cached_unit) == 2


def test_the_step_compiles_by_default_on_cuda_only(monkeypatch):
    assert decode_module.decode_compiles(torch.device("cuda"), None)
    assert not decode_module.decode_compiles(torch.device("cuda"), False)  # the opt-out
    assert not decode_module.decode_compiles(torch.device("cpu"), None)
    assert decode_module.decode_compiles(torch.device("cpu"), True)
    calls = []
    monkeypatch.setattr(decode_module, "compiled_decode_unit", lambda device: calls.append(device))
    model = tiny_model().eval()
    model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=3)
    assert calls == []  # a CPU generate runs eager units unless asked
