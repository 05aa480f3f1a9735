"""Fused / chunked LM-head cross-entropy against F.cross_entropy on full logits."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from hydra_lm.model import loss as lce
from hydra_lm.model.loss import (chunked_linear_cross_entropy, linear_cross_entropy, naive_linear_cross_entropy,
                                 resolve_impl)

N, E, V, CHUNK = 50, 8, 37, 16  # 50 = 3 full chunks + a partial one


def _inputs(dtype=torch.float64, n=N, seed=0, ignore=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, E, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, E, generator=g, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    if ignore is not None:
        targets[ignore] = -100
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    loss = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def _chunked(hidden, weight, targets, fn=chunked_linear_cross_entropy, **kw):
    loss = fn(hidden, weight, targets, chunk_size=CHUNK, **kw)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


IGNORE_PATTERNS = {
    "none": None,
    "scattered": torch.arange(0, N, 3),
    "whole_chunk": slice(CHUNK, 2 * CHUNK),  # the second chunk has no valid target
    "tail": slice(N - 5, N),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("pattern", sorted(IGNORE_PATTERNS))
def test_matches_cross_entropy_loss_and_both_gradients(dtype, tol, pattern):
    hidden, weight, targets = _inputs(dtype, ignore=IGNORE_PATTERNS[pattern])
    got = _chunked(hidden, weight, targets)
    for g, r in zip(got, _reference(hidden, weight, targets)):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


def test_upstream_gradient_scale():
    hidden, weight, targets = _inputs(ignore=IGNORE_PATTERNS["scattered"])
    # backward scales the stored gradients by whatever flows in (loss weights, accumulation).
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK)
    gh, gw = torch.autograd.grad(3.0 * loss, (hidden, weight))
    _, rh, rw = _reference(hidden, weight, targets)
    torch.testing.assert_close(gh, 3.0 * rh)
    torch.testing.assert_close(gw, 3.0 * rw)


@pytest.mark.parametrize("fn", [chunked_linear_cross_entropy, naive_linear_cross_entropy], ids=["chunked", "naive"])
def test_all_targets_ignored_gives_zero_loss_and_gradients(fn):
    hidden, weight, targets = _inputs(ignore=slice(None))
    kw = {"chunk_size": CHUNK} if fn is chunked_linear_cross_entropy else {}
    loss = fn(hidden, weight, targets, **kw)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_one_side_requires_grad_and_leading_dims():
    hidden, weight, targets = _inputs()
    _, rh, rw = _reference(hidden, weight, targets)
    frozen_w = weight.detach()
    (gh,) = torch.autograd.grad(chunked_linear_cross_entropy(hidden, frozen_w, targets, chunk_size=CHUNK), (hidden,))
    torch.testing.assert_close(gh, rh)
    (gw,) = torch.autograd.grad(chunked_linear_cross_entropy(hidden.detach(), weight, targets, chunk_size=CHUNK),
                                (weight,))
    torch.testing.assert_close(gw, rw)
    # [B, T, E] hidden with [B, T] targets, as the model produces them.
    loss = chunked_linear_cross_entropy(hidden.reshape(5, 10, E), weight, targets.reshape(5, 10), chunk_size=CHUNK)
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, targets))


class _TiedLM(nn.Module):
    """Embedding -> mixing layer -> head sharing the embedding matrix."""

    def __init__(self, fn):
        super().__init__()
        self.embed = nn.Embedding(V, E, dtype=torch.float64)
        self.mix = nn.Linear(E, E, dtype=torch.float64)
        self.fn = fn

    def forward(self, ids, targets):
        return self.fn(torch.tanh(self.mix(self.embed(ids))), self.embed.weight, targets)


def _tied_grads(model, ids, targets):
    model.zero_grad()
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), model.embed.weight.grad.clone(), model.mix.weight.grad.clone()


def test_tied_weight_accumulates_embedding_and_head_gradients():
    torch.manual_seed(0)
    model = _TiedLM(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk_size=CHUNK))
    ids = torch.randint(0, V, (N,))
    targets = torch.roll(ids, -1)
    targets[::4] = -100
    got = _tied_grads(model, ids, targets)
    model.fn = lambda h, w, t: F.cross_entropy(h @ w.T, t)
    want = _tied_grads(model, ids, targets)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_compiles_fullgraph_without_recompiling_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TiedLM(lambda h, w, t: linear_cross_entropy(h, w, t, impl="auto", chunk_size=CHUNK))
    reference = _TiedLM(lambda h, w, t: F.cross_entropy(h @ w.T, t))
    reference.load_state_dict(model.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, V, (N,), generator=g)
        targets = torch.randint(0, V, (N,), generator=g)
        targets[CHUNK:2 * CHUNK] = -100
        got = _tied_grads(compiled, ids, targets)
        for a, b in zip(got, _tied_grads(reference, ids, targets)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1, "a second batch of the same shape must reuse the compiled graph"


def test_compiled_all_ignored_batch_is_finite():
    torch._dynamo.reset()
    hidden, weight, targets = _inputs(torch.float32, ignore=slice(None))
    compiled = torch.compile(chunked_linear_cross_entropy, fullgraph=True, backend="aot_eager")
    loss = compiled(hidden, weight, targets, chunk_size=CHUNK)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16], ids=["fp32_hidden", "bf16_hidden"])
def test_autocast_bf16_keeps_fp32_loss_and_input_grad_dtypes(hidden_dtype):
    hidden, weight, targets = _inputs(torch.float32, ignore=IGNORE_PATTERNS["scattered"])
    hidden = hidden.detach().to(hidden_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _chunked(hidden, weight, targets)
        want = (naive_linear_cross_entropy(hidden, weight, targets),)
        want += torch.autograd.grad(want[0], (hidden, weight))
    exact = _reference(hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_(), targets)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == hidden_dtype and got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)  # both: bf16 logits, fp32 softmax

    def relative_error(a, b):  # over the whole tensor: bf16 rounding moves single entries by more
        return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())

    # Gradients as the plain loss gives them under the same autocast, and close to the float64 truth (bf16
    # rounding leaves about 0.3%; a wrong scale, e.g. dividing by every token instead of the valid ones, 34%).
    assert all(relative_error(g, w) < 1e-2 for g, w in zip(got[1:], want[1:]))
    assert all(relative_error(g, r) < 1e-2 for g, r in zip(got, exact))


class _LargestTensor(TorchDispatchMode):
    """Largest tensor any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.mm_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.mm_calls += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_allocates_full_logits():
    n = 4 * CHUNK
    hidden, weight, targets = _inputs(torch.float32, n=n)
    padded = -(-V // lce.VOCAB_ALIGN) * lce.VOCAB_ALIGN  # the matmuls see the vocabulary padded for alignment
    # sizes chosen so only logits can exceed CHUNK * padded
    assert max(padded * E, n * E) < CHUNK * padded < n * V
    with _LargestTensor() as probe:
        loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK)
        loss.backward()
    assert probe.largest <= CHUNK * padded
    assert probe.mm_calls == 3 * 4  # logits, grad_hidden, grad_weight per chunk; backward adds none
    with torch.no_grad(), _LargestTensor() as probe:
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK)
    assert probe.mm_calls == 4, "evaluation must not compute gradients"
    with _LargestTensor() as probe:
        naive_linear_cross_entropy(hidden, weight, targets).backward()
    assert probe.largest >= n * V  # the probe does see full logits when they exist


def test_each_chunks_logit_gradient_is_freed_before_the_next_chunk_runs(monkeypatch):
    """The loss is the forward's last op, so what it holds adds to the step's peak: one chunk's logits and gradient,
    not also the previous chunk's gradient."""
    import weakref

    alive_at_start, earlier = [], []
    run_chunk = lce._chunk_loss_and_grad

    def tracked(*args):
        alive_at_start.append(sum(ref() is not None for ref in earlier))
        part, g = run_chunk(*args)
        earlier.append(weakref.ref(g))
        return part, g

    monkeypatch.setattr(lce, "_chunk_loss_and_grad", tracked)
    hidden, weight, targets = _inputs(torch.float32)
    chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK).backward()
    assert alive_at_start == [0, 0, 0, 0]


def test_a_target_outside_the_vocabulary_gives_a_nan_loss_and_no_gradient_through_the_padding():
    """V = 37 is padded to 64 columns, whose logits are -inf: a target there must not read as an infinite loss (the
    Triton kernel and F.cross_entropy's contract: the loss is NaN, not a number that looks like divergence)."""
    hidden, weight, targets = _inputs(torch.float64)
    for bad in (V + 3, -7):
        t = targets.clone()
        t[5] = bad
        loss = chunked_linear_cross_entropy(hidden, weight, t, chunk_size=CHUNK)
        assert torch.isnan(loss)
        grad_h, grad_w = torch.autograd.grad(loss, (hidden, weight))
        assert torch.isfinite(grad_h).all() and torch.isfinite(grad_w).all()
        assert torch.count_nonzero(grad_h[5]) == 0  # the row outside the vocabulary gets no gradient


def test_invalid_arguments_are_rejected():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="targets"):
        chunked_linear_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="weight"):
        chunked_linear_cross_entropy(hidden, weight.T, targets)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(hidden, weight, targets, impl="fused")


# ---------------------------------------------------------------- implementation selection


def test_auto_selection(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(lce, "LIGER_INSTALLED", False)
    assert resolve_impl("auto", cuda) == "chunked"
    monkeypatch.setattr(lce, "LIGER_INSTALLED", True)
    assert resolve_impl("auto", cuda) == "liger"
    assert resolve_impl("auto", cpu) == "chunked"
    assert resolve_impl("liger", cuda) == "liger"
    assert resolve_impl("naive", cuda) == "naive" and resolve_impl("chunked", cpu) == "chunked"


def test_missing_liger_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(lce, "LIGER_INSTALLED", False)
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        linear_cross_entropy(hidden, weight, targets, impl="liger")
    monkeypatch.setattr(lce, "LIGER_INSTALLED", True)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_impl("liger", torch.device("cpu"))


@pytest.mark.parametrize("impl", ["auto", "chunked", "naive"])
def test_selector_impls_agree_on_cpu(impl):
    hidden, weight, targets = _inputs(ignore=IGNORE_PATTERNS["whole_chunk"])
    got = _chunked(hidden, weight, targets, fn=linear_cross_entropy, impl=impl)
    for g, r in zip(got, _reference(hidden, weight, targets)):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- GPU


def _gpu_case(dtype, n=4096 + 300, e=256, v=32000, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, e, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, e, device="cuda", generator=g) * e ** -0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    targets[::7] = -100
    targets[:1024] = -100
    return hidden, weight, targets


def _run(impl, hidden, weight, targets, autocast):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(hidden, weight, targets, impl=impl, chunk_size=1024)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_gpu_liger_chunked_naive_agree(autocast, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 means fp32 (a trainer may have set it)
    impls = ["chunked", "naive"] + (["liger"] if lce.LIGER_INSTALLED else [])
    if "liger" not in impls:
        warnings.warn("liger-kernel not installed: GPU check covers chunked vs naive only", stacklevel=1)
    hidden, weight, targets = _gpu_case(torch.float32)
    exact = _run("naive", hidden.double().detach().requires_grad_(), weight.double().detach().requires_grad_(),
                 targets, autocast=False)
    tol = 2e-2 if autocast else 1e-4
    for impl in impls:
        got = _run(impl, hidden, weight, targets, autocast)
        assert got[1].dtype == hidden.dtype and got[2].dtype == weight.dtype, impl
        for g, r in zip(got, exact):
            torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol * r.abs().max().item(),
                                       msg=lambda m, impl=impl: f"{impl}: {m}")
    all_ignored = torch.full_like(targets, -100)
    for impl in impls:
        loss, gh, gw = _run(impl, hidden, weight, all_ignored, autocast)
        assert loss.item() == 0.0 and not gh.any() and not gw.any(), impl


@pytest.mark.gpu
def test_gpu_chunked_empty_batch_gives_zero_head_gradient():
    """No chunk's GEMM writes the head gradient of an empty batch: it must still be zero, not uninitialised."""
    weight = torch.randn(50257, 64, device="cuda", requires_grad=True)  # padded to 50,304 rows inside
    stale = torch.ones(50304, 64, device="cuda")  # freed below; the caching allocator hands its block out next
    del stale
    hidden = torch.empty(0, 64, device="cuda", requires_grad=True)
    loss, gh, gw = _run("chunked", hidden, weight, torch.empty(0, dtype=torch.long, device="cuda"), autocast=True)
    assert loss.item() == 0.0 and gh.shape == (0, 64) and gw.shape == weight.shape and not gw.any()


def test_the_models_loss_paths_agree_on_a_batch_with_no_valid_target():
    """Every target ignored (e.g. a row of padding): the model's unfused and fused losses are both 0 with zero
    gradients, not NaN on one path and 0 on the other."""
    from support import tiny_model

    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    for impl in ("naive", "chunked"):
        model = tiny_model()
        model.ce_impl = impl
        out = model(ids, targets=torch.full_like(ids, -100))
        out["ce_loss"].backward()
        assert out["ce_loss"].item() == 0.0, impl
        assert not model.lm_head.weight.grad.any(), impl
