"""The decode kernels (``HydraConfig.decode_kernel``) against their references. The CCGQA kernel
(kernels/ccgqa_decode.py) against the PyTorch ops of ``CCGQAttention.forward`` on one cached token: the same
attention output and the same decode state (K/V slot, slot flag, conv history, value-shift state) step after
step, for rows whose token enters and rows whose token does not, in both of the kernel's attention paths (tl.dot
tiles; products and sums for fp64 and heads under 16 wide). The router's decision kernel (kernels/route_decode.py)
against ``ExpertChoiceRouter.decide_new``. On a GPU host the same tests run the compiled kernels on CUDA
tensors; on a CPU, Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 there)."""

import copy

import pytest
import torch

from hydra_lm.config import HydraConfig
from hydra_lm.model.attention import CCGQAttention
from hydra_lm.model.decode_step import DecodeStep
from hydra_lm.model.layers import RotaryEmbedding
from hydra_lm.model.routing import RANK_PRIOR, ExpertChoiceRouter

from support import TINY, VARIANTS, count_calls, tiny_model

pytest.importorskip("triton")

STATE = ("k", "v", "conv", "shift", "slot_valid")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("layout", [
    dict(n_heads=6, n_kv_heads=2, head_dim=8, dtype=torch.float64),  # three query heads a group, padded to four
    dict(n_heads=4, n_kv_heads=1, head_dim=16, qk_mean=False, dtype=torch.float64),
    dict(n_heads=4, n_kv_heads=4, head_dim=8, conv_seq_kernel=4, conv_ch_kernel=3, value_shift=False,
         dtype=torch.float64),  # five history slots (padded to eight), no value shift
    dict(n_heads=4, n_kv_heads=1, head_dim=16, dtype=torch.float32, start=300),  # tl.dot over two 256-slot tiles
    dict(n_heads=6, n_kv_heads=2, head_dim=32, dtype=torch.float32),  # tl.dot, one of four padded rows dead
    dict(n_heads=4, n_kv_heads=1, head_dim=8, dtype=torch.bfloat16),  # generate's cache dtype on a GPU
    # Triton's interpreter (3.9) multiplies bf16 tiles in tl.dot into garbage (1e10), so the bf16 tensor-core path
    # is checked on a GPU only.
    pytest.param(dict(n_heads=4, n_kv_heads=1, head_dim=16, dtype=torch.bfloat16, start=300),
                 marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 tl.dot is wrong in the interpreter")),
], ids=["fp64_gqa3", "fp64_no_qk_mean", "fp64_wide_convs", "fp32_dot_two_tiles", "fp32_dot_gqa3", "bf16_sums",
        "bf16_dot_two_tiles"])
def test_kernel_matches_the_reference_one_token_at_a_time(layout):
    from hydra_lm.kernels.ccgqa_decode import ccgqa_decode

    layout = dict(layout)
    dtype, start = layout.pop("dtype"), layout.pop("start", 9)
    torch.manual_seed(0)
    d = layout["head_dim"]
    attn = CCGQAttention(48, layout.pop("n_heads"), layout.pop("n_kv_heads"), decode_kernel="torch",
                         **layout).to(DEVICE, dtype)
    with torch.no_grad():
        for p in attn.parameters():  # conv biases and temperatures away from their zero init
            p.normal_(0, 0.3)
    rope = RotaryEmbedding(d, 512).to(DEVICE)
    batch, length = 3, start + 8
    want = attn.new_cache(batch, length, DEVICE, dtype)
    for t in (want.k, want.v, want.conv, want.shift):  # a history, as earlier steps would leave
        t.normal_()
    want.slot_valid[:, :start] = torch.rand(batch, start, device=DEVICE) > 0.4
    got = copy.deepcopy(want)
    # Every row's token enters at some step and skips at another.
    entered = torch.tensor([[True, False, True], [False, True, True], [True, True, False]], device=DEVICE)
    for step in range(3):
        x = torch.randn(batch, 1, 48, dtype=dtype, device=DEVICE)
        pos = torch.full((batch, 1), start + step, device=DEVICE)
        valid = entered[:, step:step + 1]
        with torch.no_grad():
            reference = attn(x, pos, rope, want, valid)
            out = attn.out(ccgqa_decode(attn, x, pos, rope, got, valid))
        # bf16: the kernel keeps fp32 between its steps where the reference rounds each op to bf16, so outputs of
        # about 8 differ by an ulp or two (0.06); a wrong mask or slot would be off by the outputs' own size
        tol = {torch.float64: dict(rtol=0, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-5),
               torch.bfloat16: dict(rtol=2e-2, atol=1e-1)}[dtype]
        torch.testing.assert_close(out, reference, **tol, msg=f"step {step}")
        for name in STATE:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), **tol, msg=f"{name}, step {step}")
    assert not torch.equal(got.conv, attn.new_cache(batch, length, DEVICE, dtype).conv)


@pytest.mark.parametrize("capacity", [0.25, 1.0])  # 1: a MoR ramp's first level, where every candidate enters
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_route_kernel_matches_the_routers_decision(dtype, capacity):
    """Gate, admission and the decode state's write of an expert-choice router's causal decision, step after step
    over a state that fills up: rows with no earlier candidate, rows past one 1,024-slot tile, candidates and
    non-candidates, a calibrated threshold. The admissions are exact; the logits as the precision allows."""
    from hydra_lm.kernels.route_decode import route_decode

    torch.manual_seed(0)
    batch, dim, length = 5, 48, 1300
    router = ExpertChoiceRouter(dim, 1, gate_scale=0.1).to(DEVICE, dtype)
    with torch.no_grad():
        router.proj.weight.normal_()
        router.proj.bias.normal_()
        router.threshold_sum.fill_(0.4 * 7)
        router.threshold_weight.fill_(7)
    want = torch.zeros(batch, 2, length, dtype=torch.promote_types(dtype, torch.float32), device=DEVICE)
    want[:, 0].normal_(mean=0.5)  # earlier candidates' logits: some above each new one, some below
    want[:, 1] = (torch.rand(batch, length, device=DEVICE) > 0.3).to(want.dtype)
    got = want.clone()
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    masks = []
    for step in range(6):
        x = torch.randn(batch, 1, dim, dtype=dtype, device=DEVICE)
        valid = None if step % 2 == 0 else torch.rand(batch, 1, device=DEVICE) > 0.3
        pos = torch.tensor([[step], [40 + step], [1030 + step], [1200 + step], [700]], device=DEVICE)
        with torch.no_grad():
            gate, admitted = router.decide_new(x, valid, "causal", 1, None, want, capacity, pos)
        mask = torch.zeros(batch, 1, dtype=torch.bool, device=DEVICE)
        weight = torch.zeros(batch, 1, dtype=gate.dtype, device=DEVICE)
        route_decode(router, x, valid, pos, capacity, RANK_PRIOR, got, weight, mask)
        assert torch.equal(mask, admitted if valid is None else admitted & valid), f"step {step}"
        torch.testing.assert_close(weight, gate, **tol, msg=f"step {step}")
        torch.testing.assert_close(got, want, **tol, msg=f"step {step}")
        masks.append(mask)
    masks = torch.cat(masks)
    assert masks.any() and not masks.all()  # decisions both ways (at capacity 1: the non-candidates only)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How often each Triton decode kernel ran. A model left on the PyTorch ops (a setting that stops reaching the
    code) would otherwise pass as its own reference."""
    import hydra_lm.kernels.ccgqa_decode as attention_kernel
    import hydra_lm.kernels.route_decode as route_kernel

    calls = {"attention": 0, "route": 0}
    count_calls(monkeypatch, attention_kernel, "ccgqa_decode", calls, "attention")
    count_calls(monkeypatch, route_kernel, "route_decode", calls, "route")
    return calls


# Variants whose decode has no expert-choice router for the route kernel (token choice keeps MoD's).
NO_ROUTE_KERNEL = ("static", "no_routing")


def _kernel_and_reference(models, ids, prefill: int, compiled: bool, calls: dict, routed: bool = True):
    """Teacher-forced logits of ``models`` ("triton", "torch"), checking that the first ran the kernels (the route
    kernel where ``routed``) and the second none."""
    fused = _teacher_forced_logits(models[0], ids, prefill, compiled)
    assert calls["attention"] > 0 and (calls["route"] > 0) == routed, calls
    ran = dict(calls)
    reference = _teacher_forced_logits(models[1], ids, prefill, compiled)
    assert calls == ran, "the PyTorch reference ran a kernel"
    return fused, reference


def _teacher_forced_logits(model, ids: torch.Tensor, prefill: int, compiled: bool) -> list[torch.Tensor]:
    with torch.no_grad():
        caches = model.init_cache(ids.shape[0], ids.shape[1])
        model.forward_cached(ids[:, :prefill], 0, caches)
        step = DecodeStep(model, caches, ids.shape[0], ids.device, graphed=False, compiled=compiled)
        return [step(ids[:, t:t + 1], t).clone() for t in range(prefill, ids.shape[1])]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decode_step_with_the_kernel_gives_the_full_forwards_logits(compiled, kernel_calls):
    """The whole decode step (every routed unit's attention through the kernel, eager or compiled as an opaque
    op that mutates the caches in place) against the full forward and the PyTorch decode path, in float64."""
    torch._dynamo.reset()
    ids = torch.randint(0, TINY["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    models = [tiny_model(decode_kernel=kernel).double().to(DEVICE).eval() for kernel in ("triton", "torch")]
    full = models[0](ids)["logits"]
    fused, reference = _kernel_and_reference(models, ids, 6, compiled, kernel_calls)
    for t, (a, b) in enumerate(zip(fused, reference)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"position {6 + t}")
        torch.testing.assert_close(a, full[:, 6 + t], rtol=0, atol=1e-9, msg=f"position {6 + t}")


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("hydra", "dense")])
def test_decode_step_with_the_kernels_in_every_routing_configuration(variant, kernel_calls):
    """Both kernels (where the configuration has expert-choice routers, the route kernel; token choice and static
    routing keep the compiled decision) give the PyTorch path's logits in float64, step after step."""
    ids = torch.randint(0, TINY["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    models = [tiny_model(decode_kernel=kernel, **VARIANTS[variant]).double().to(DEVICE).eval()
              for kernel in ("triton", "torch")]
    fused, reference = _kernel_and_reference(models, ids, 6, False, kernel_calls, variant not in NO_ROUTE_KERNEL)
    for t, (a, b) in enumerate(zip(fused, reference)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"position {6 + t}")


def test_prompts_of_several_lengths_decode_through_the_kernels_as_alone(kernel_calls):
    """Each row's own position reaches both kernels (the attention's cache slots, the route kernel's state): a batch
    of prompts of different lengths decodes with them as each prompt does alone, and as the PyTorch path does."""
    from test_causal_routing import _calibrate, _drift

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).to(DEVICE) for n in (9, 3, 6)]
    outs = []
    for kernel in ("triton", "torch"):
        model = tiny_model(decode_kernel=kernel)
        _drift(model)
        _calibrate(model, batches=3)
        model = model.double().to(DEVICE).eval()
        outs.append(model.generate(prompts, 6))
        if kernel == "triton":
            alone = [model.generate(p[None], 6)[0] for p in prompts]
            assert kernel_calls["attention"] > 0 and kernel_calls["route"] > 0
            ran = dict(kernel_calls)
    assert kernel_calls == ran  # the PyTorch path ran no kernel
    for fused, reference, single in zip(*outs, alone):
        assert torch.equal(fused, reference) and torch.equal(fused, single)


def test_decode_step_with_the_kernels_tensor_core_path_follows_the_reference(kernel_calls):
    """Heads 16 wide in float32: the kernel's tl.dot path through a model's decode step, teacher-forced."""
    overrides = dict(dim=128, n_heads=2, n_kv_heads=1)  # head_dim 128 / 4 / 2 = 16
    ids = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    models = [tiny_model(decode_kernel=k, **overrides).to(DEVICE).eval() for k in ("triton", "torch")]
    fused, reference = _kernel_and_reference(models, ids, 5, False, kernel_calls)
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_decode_step_with_the_kernel_and_one_tap_convs_follows_the_reference(kernel_calls):
    """Convs of one tap each (a valid configuration) keep no conv history: the kernel's history update pads it to one
    masked slot and writes nothing, and the model decodes as on the PyTorch path."""
    overrides = dict(conv_seq_kernel=1, conv_ch_kernel=1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    models = [tiny_model(decode_kernel=k, **overrides).double().to(DEVICE).eval() for k in ("triton", "torch")]
    fused, reference = _kernel_and_reference(models, ids, 5, False, kernel_calls)
    for t, (a, b) in enumerate(zip(fused, reference)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"position {5 + t}")


def _one_step(attn, cache, pos: int, rope_len: int, dtype, seed: int = 0):
    """The kernel's latent output for one token at ``pos`` of every row, over ``cache`` (history flags all off)."""
    from hydra_lm.kernels.ccgqa_decode import ccgqa_decode

    g = torch.Generator().manual_seed(seed)
    batch = cache.k.shape[0]
    x = torch.randn(batch, 1, attn.qkv.in_features, generator=g).to(DEVICE, dtype)
    rope = RotaryEmbedding(attn.head_dim, rope_len).to(DEVICE)
    with torch.no_grad():
        return ccgqa_decode(attn, x, torch.full((batch, 1), pos, device=DEVICE), rope, cache, None)


def test_kernel_addresses_caches_of_2_to_the_31_values():
    """A K/V cache of more than 2**31 values: the last KV head's slots start past int32's range. Allocated, never
    filled (the pages stay untouched), so its output and written slot must match a short cache's."""
    torch.manual_seed(0)
    attn = CCGQAttention(48, 4, 4, 16, decode_kernel="torch").to(DEVICE, torch.float16)
    pos, short = 3, 8
    length = 2**31 // (3 * 16) + 1  # (head 3) * length * 16 > 2**31 - 1
    small = attn.new_cache(1, short, DEVICE, torch.float16)
    big = copy.copy(small)
    big.k, big.v = (torch.empty(1, 4, length, 16, device=DEVICE, dtype=torch.float16) for _ in range(2))
    big.slot_valid = torch.zeros(1, length, dtype=torch.bool, device=DEVICE)
    big.conv, big.shift = small.conv.clone(), small.shift.clone()
    want, got = _one_step(attn, small, pos, short, torch.float16), _one_step(attn, big, pos, short, torch.float16)
    assert torch.equal(got, want)
    for name in ("k", "v"):
        assert torch.equal(getattr(big, name)[:, :, pos], getattr(small, name)[:, :, pos]), name
    assert bool(big.slot_valid[0, pos])


def test_kernel_takes_heads_up_to_256_wide():
    """Heads 256 wide (the widest the kernel takes) in half precision, through tl.dot's tiles of 32 slots."""
    from hydra_lm.kernels.ccgqa_decode import ccgqa_decode

    torch.manual_seed(0)
    attn = CCGQAttention(48, 1, 1, 256, decode_kernel="torch").to(DEVICE)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    attn.half().float()  # weights the half-precision copy holds exactly
    cache = attn.new_cache(1, 40, DEVICE, torch.float16)
    for t in (cache.k, cache.v):
        t.normal_()
    cache.slot_valid[:, :20] = True
    reference = copy.deepcopy(cache)
    for name in ("k", "v", "conv", "shift"):
        setattr(reference, name, getattr(reference, name).float())
    x = torch.randn(1, 1, 48, device=DEVICE).half()
    pos, rope = torch.full((1, 1), 20, device=DEVICE), RotaryEmbedding(256, 40).to(DEVICE)
    with torch.no_grad():
        want = attn(x.float(), pos, rope, reference, None)
        attn.half()
        got = attn.out(ccgqa_decode(attn, x, pos, rope, cache, None))
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-3)


def test_decode_kernel_setting_is_checked_with_what_to_change(monkeypatch):
    with pytest.raises(ValueError, match="decode_kernel"):
        HydraConfig(decode_kernel="fused")
    with pytest.raises(ValueError, match="decode_kernel"):
        CCGQAttention(48, 2, 1, 8, decode_kernel="cuda")
    cache_step = (torch.zeros(1, 1, 48), torch.zeros(1, 1, dtype=torch.long), RotaryEmbedding(12, 8))
    odd = CCGQAttention(48, 2, 1, 12, decode_kernel="triton")  # 12 wide: no power of two
    with pytest.raises(ValueError, match="head_dim 12 is not a power of two.*'auto' or 'torch'"):
        odd(*cache_step, odd.new_cache(1, 8, "cpu", torch.float32))
    wide = CCGQAttention(48, 1, 1, 512, decode_kernel="triton")
    with pytest.raises(ValueError, match="head_dim 512 is over the kernel's 256.*'auto' or 'torch'"):
        wide(torch.zeros(1, 1, 48), torch.zeros(1, 1, dtype=torch.long), RotaryEmbedding(512, 8),
             wide.new_cache(1, 8, "cpu", torch.float32))
    assert not CCGQAttention(48, 1, 1, 512, decode_kernel="auto")._runs_decode_kernel(torch.zeros(1, device=DEVICE))
    attn = CCGQAttention(48, 2, 1, 8, decode_kernel="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attn(torch.zeros(1, 1, 48), torch.zeros(1, 1, dtype=torch.long), RotaryEmbedding(8, 8),
             attn.new_cache(1, 8, "cpu", torch.float32))


@pytest.mark.parametrize("name", ["k_cache", "shift_state", "rope_sin"])
def test_kernel_refuses_strided_caches(name):
    from hydra_lm.kernels.ccgqa_decode import ccgqa_decode

    attn = CCGQAttention(48, 2, 1, 8, decode_kernel="triton").to(DEVICE)
    cache = attn.new_cache(2, 8, DEVICE, torch.float32)
    rope = RotaryEmbedding(8, 8).to(DEVICE)
    if name == "k_cache":
        cache.k = cache.k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, other layout
    elif name == "shift_state":  # every other column of a wider tensor
        cache.shift = torch.zeros(2, 2 * cache.shift.shape[1], device=DEVICE)[:, ::2]
    else:
        rope.sin = torch.zeros(8, 8, device=DEVICE)[:, :4]
    with pytest.raises(ValueError, match=f"{name} not contiguous"):
        ccgqa_decode(attn, torch.zeros(2, 1, 48, device=DEVICE), torch.zeros(2, 1, dtype=torch.long, device=DEVICE),
                     rope, cache, None)


def test_route_kernel_reads_positions_and_flags_given_as_columns_of_wider_tensors():
    """``pos`` and ``valid`` [B, 1] sliced out of wider tensors (strided views): each row's own is read."""
    from hydra_lm.kernels.route_decode import route_decode

    torch.manual_seed(0)
    batch, dim, length = 3, 16, 32
    router = ExpertChoiceRouter(dim, 1, gate_scale=1.0).to(DEVICE, torch.float64)
    with torch.no_grad():
        router.proj.weight.normal_()
        router.proj.bias.normal_()
    want = torch.zeros(batch, 2, length, dtype=torch.float64, device=DEVICE)
    want[:, 0].normal_()
    want[:, 1] = 1
    got = want.clone()
    x = torch.randn(batch, 1, dim, dtype=torch.float64, device=DEVICE)
    pos = torch.tensor([[5, 100], [9, 100], [20, 100]], device=DEVICE)[:, :1]
    valid = torch.tensor([[True, False], [False, False], [True, False]], device=DEVICE)[:, :1]
    with torch.no_grad():
        gate, admitted = router.decide_new(x, valid, "causal", 1, None, want, 0.25, pos)
    mask = torch.zeros(batch, 1, dtype=torch.bool, device=DEVICE)
    weight = torch.zeros(batch, 1, dtype=gate.dtype, device=DEVICE)
    route_decode(router, x, valid, pos, 0.25, RANK_PRIOR, got, weight, mask)
    assert torch.equal(mask, admitted & valid)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_route_kernel_refuses_a_strided_state():
    from hydra_lm.kernels.route_decode import route_decode

    router = ExpertChoiceRouter(16, 1).to(DEVICE)
    state = torch.zeros(2, 8, 2, device=DEVICE).transpose(1, 2)  # [B, 2, L], not laid out as one
    with pytest.raises(ValueError, match="route_decode: state not contiguous"):
        route_decode(router, torch.zeros(2, 1, 16, device=DEVICE), None,
                     torch.zeros(2, 1, dtype=torch.long, device=DEVICE), 0.5, RANK_PRIOR, state,
                     torch.zeros(2, 1, device=DEVICE), torch.zeros(2, 1, dtype=torch.bool, device=DEVICE))


def test_auto_runs_the_pytorch_ops_off_cuda(monkeypatch):
    from hydra_lm.kernels import ccgqa_decode as kernel_module
    from hydra_lm.kernels import route_decode as route_module

    monkeypatch.setattr(kernel_module, "ccgqa_decode", lambda *a: pytest.fail("the kernel ran on a CPU under auto"))
    monkeypatch.setattr(route_module, "route_decode", lambda *a: pytest.fail("the kernel ran on a CPU under auto"))
    model = tiny_model().eval()
    assert model.config.decode_kernel == "auto"
    model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=3)
