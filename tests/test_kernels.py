"""Fused Triton kernels (hydra_lm.kernels) against their PyTorch references, on CPU through the
Triton interpreter, and (marked gpu) compiled on CUDA.

The interpreter only works if TRITON_INTERPRET=1 is set before triton's first import, so this
module sets it before importing anything that could import triton. When triton was already
imported in this process without it (another test module got there first), the interpreter tests
are skipped here and ``test_interpreter_suite_in_fresh_process`` runs this file in a child process.
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch


def _import_triton_in_interpreter_mode() -> None:
    # Never on a CUDA host: a process-wide interpreter would also slow every compiled GPU test.
    if "triton" in sys.modules or torch.cuda.is_available():
        return
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        try:
            import triton.language  # noqa: F401
        except ImportError:
            pass


_import_triton_in_interpreter_mode()

from hydra_lm import kernels  # noqa: E402
from hydra_lm.kernels import reference, switches  # noqa: E402
from hydra_lm.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary  # noqa: E402

CHILD_FLAG = "HYDRA_KERNEL_TESTS_CHILD"
TOL = dict(atol=1e-5, rtol=1e-5)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def restore_switches():
    """Every test leaves the global switches as it found them (kernels off by default)."""
    saved = dataclasses.replace(switches.STATE, flags=dict(switches.STATE.flags))
    yield
    for f in dataclasses.fields(saved):
        setattr(switches.STATE, f.name, getattr(saved, f.name))


def _triton_device() -> str | None:
    if not kernels.set_use_triton_kernels(True):
        return None
    if switches.STATE.interpreter:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.fixture
def dev(monkeypatch):
    """Triton path on; the device its tensors live on (CPU under the interpreter)."""
    device = _triton_device()
    if device is None:
        pytest.skip("triton is not usable in this process (see test_interpreter_suite_in_fresh_process)")
    if switches.STATE.interpreter:
        # triton still consults the variable when it lazily imports parts of itself at launch.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device


def _rand(*shape, device="cpu", dtype=torch.float32, seed=None, grad=True):
    g = torch.Generator().manual_seed(seed if seed is not None else sum(shape) * 7 + len(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(grad)


def _compare(fused, ref, inputs, tol=TOL, seed=0):
    """Outputs and every input gradient of ``fused`` equal those of ``ref``."""
    a = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    b = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out_a, out_b = fused(*a), ref(*b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in out_b]
    for x, y in zip(out_a, out_b):
        assert x.shape == y.shape and x.dtype == y.dtype
        torch.testing.assert_close(x, y, **tol)
    torch.autograd.backward(out_a, grads)
    torch.autograd.backward(out_b, grads)
    for x, y in zip(a, b):
        if y.requires_grad:
            assert x.grad is not None, "missing gradient"
            torch.testing.assert_close(x.grad, y.grad, **tol)


def _gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


class CallCounter:
    """Wraps a launcher of one Triton kernel module and counts its calls."""

    def __init__(self, monkeypatch, module: str, name: str):
        self.calls, target = 0, getattr(switches.TK, module)
        original = getattr(target, name)
        monkeypatch.setattr(target, name, lambda *args, **kwargs: self._count() or original(*args, **kwargs))

    def _count(self):
        self.calls += 1


# ----------------------------------------------------------------------------- references = model math
def test_references_compute_what_the_model_computes():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    norm = RMSNorm(8, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    torch.testing.assert_close(reference.rms_norm(x, norm.weight, 1e-6), norm(x))
    mlp = SwiGLUMLP(8, 6)
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)
    torch.testing.assert_close(mlp.down(reference.swiglu(gate, up)), mlp(x))
    rope = RotaryEmbedding(6, 16)
    q, k, t = torch.randn(2, 5, 4, 6), torch.randn(2, 5, 2, 6), torch.randn(2)
    pos = torch.tensor([[0, 2, 3, 7, 11], [1, 4, 5, 6, 15]])
    cos, sin = rope(pos, q.dtype)
    normed_k = torch.nn.functional.rms_norm(k, (6,), eps=1e-6) * t.exp()[:, None]
    want_q = apply_rotary(torch.nn.functional.rms_norm(q, (6,), eps=1e-6).transpose(1, 2), cos, sin)
    want_k = apply_rotary(normed_k.transpose(1, 2), cos, sin)
    got_q, got_k = reference.qk_norm_rope(q, k, t, rope.cos, rope.sin, pos, 1e-6)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    torch.testing.assert_close(reference.rope(q.transpose(1, 2), cos, sin), apply_rotary(q.transpose(1, 2), cos, sin))


# ----------------------------------------------------------------------------- forward + backward vs reference
@pytest.mark.parametrize("shape", [(2, 3, 13), (5, 40), (7,)])
def test_rms_norm_matches_reference(dev, shape):
    x, w = _rand(*shape, device=dev), _rand(shape[-1], device=dev)
    _compare(lambda x, w: kernels.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6), [x, w])


def test_rms_norm_strided_input_and_no_weight(dev):
    base = _rand(3, 4, 22, device=dev, grad=False)
    x = base[..., ::2].detach().requires_grad_(True)  # last dim not unit-stride: copied, still exact
    _compare(lambda x: kernels.rms_norm(x, None, 1e-5), lambda x: reference.rms_norm(x, None, 1e-5), [x])


def test_swiglu_matches_reference_on_chunk_views(dev):
    both = _rand(2, 5, 2 * 11, device=dev)

    def via(fn):
        return lambda t: fn(*t.chunk(2, dim=-1))

    _compare(via(kernels.swiglu), via(reference.swiglu), [both])
    _compare(kernels.swiglu, reference.swiglu, [_rand(3, 37, device=dev), _rand(3, 37, device=dev, seed=5)])


@pytest.mark.parametrize("with_temperature", [True, False])
def test_qk_norm_matches_reference(dev, with_temperature):
    x = _rand(2, 3, 5, 6, device=dev)  # [B, N, H, d]
    t = _rand(5, device=dev, seed=3) if with_temperature else None
    inputs = [x, t] if with_temperature else [x]
    _compare(lambda x, t=None: kernels.qk_norm(x, t, 1e-6), lambda x, t=None: reference.qk_norm(x, t, 1e-6), inputs)
    with pytest.raises(ValueError, match="heads"):
        kernels.qk_norm(x, _rand(4, device=dev), 1e-6)


@pytest.mark.parametrize("table_batch", [2, 1])
def test_rope_matches_reference_on_the_model_layout(dev, table_batch):
    x = _rand(2, 5, 3, 10, device=dev)  # [B, N, H, D]; the model rotates x.transpose(1, 2)
    cos = _rand(table_batch, 1, 5, 5, device=dev, grad=False)
    sin = _rand(table_batch, 1, 5, 5, device=dev, seed=11, grad=False)
    _compare(lambda x: kernels.rope(x.transpose(1, 2), cos, sin),
             lambda x: reference.rope(x.transpose(1, 2), cos, sin), [x])


def test_rope_gradient_is_rotation_by_minus_angle(dev):
    # The public kernel this replaces had no backward, so q and k never learned: check it directly.
    rope = RotaryEmbedding(8, 32).to(dev)
    pos = torch.tensor([[0, 3, 4, 9], [2, 5, 17, 31]], device=dev)
    cos, sin = rope(pos, torch.float32)
    x = _rand(2, 3, 4, 8, device=dev)
    g = _rand(2, 3, 4, 8, device=dev, seed=1, grad=False)
    (kernels.rope(x, cos, sin) * g).sum().backward()
    torch.testing.assert_close(x.grad, reference.rope(g, cos, -sin), **TOL)
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("with_temperature", [True, False])
def test_qk_norm_rope_matches_reference_at_gathered_positions(dev, with_temperature):
    rope = RotaryEmbedding(6, 40).to(dev)
    pos = torch.tensor([[0, 2, 3, 7, 11], [1, 4, 5, 30, 39]], device=dev)  # routed: gaps
    q, k = _rand(2, 5, 4, 6, device=dev), _rand(2, 5, 2, 6, device=dev, seed=2)
    t = _rand(2, device=dev, seed=4) if with_temperature else None

    def run(fn):
        return lambda q, k, t=None: fn(q, k, t, rope.cos, rope.sin, pos, 1e-6)

    _compare(run(kernels.qk_norm_rope), run(reference.qk_norm_rope), [q, k, t] if with_temperature else [q, k])


def test_qk_norm_rope_accepts_strided_q_k_from_one_projection(dev):
    rope = RotaryEmbedding(4, 16).to(dev)
    pos = torch.tensor([[5, 1, 2]], device=dev)
    qk = _rand(1, 3, 3 * 4 + 1 * 4, device=dev)
    t = _rand(1, device=dev, seed=9)

    def run(fn):
        return lambda qk, t: fn(qk[..., :12].unflatten(-1, (3, 4)), qk[..., 12:].unflatten(-1, (1, 4)), t,
                                rope.cos, rope.sin, pos, 1e-6)

    _compare(run(kernels.qk_norm_rope), run(reference.qk_norm_rope), [qk, t])


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_routing_gather_and_gated_scatter_match_reference(dev, index_dtype):
    x = _rand(2, 9, 7, device=dev)
    idx = torch.tensor([[0, 3, 4, 8], [1, 2, 6, 7]], device=dev, dtype=index_dtype)
    delta, gate = _rand(2, 4, 7, device=dev, seed=1), _rand(2, 4, device=dev, seed=2)
    _compare(kernels.gather_rows, lambda x, i: reference.gather_rows(x, i.long()), [x, idx])
    _compare(kernels.scatter_add_gated, lambda x, i, d, g: reference.scatter_add_gated(x, i.long(), d, g),
             [x, idx, delta, gate])


def test_routing_round_trip_as_a_routed_unit_uses_it(dev):
    x = _rand(2, 8, 5, device=dev)
    idx = torch.sort(torch.topk(_rand(2, 8, device=dev, seed=3, grad=False), 3, dim=1).indices, dim=1).values
    gate = torch.sigmoid(_rand(2, 3, device=dev, seed=4))

    def unit(gather, scatter):
        def run(x, gate):
            sel = gather(x, idx)
            return scatter(x, idx, torch.tanh(sel) * 2.0 - sel, gate)
        return run

    _compare(unit(kernels.gather_rows, kernels.scatter_add_gated),
             unit(reference.gather_rows, reference.scatter_add_gated), [x, gate])


# ----------------------------------------------------------------------------- float64 gradcheck through the kernels
def test_gradcheck_float64(dev):
    f64 = dict(device=dev, dtype=torch.float64)
    _gradcheck(lambda x, w: kernels.rms_norm(x, w, 1e-6), (_rand(3, 5, **f64), _rand(5, **f64)))
    _gradcheck(kernels.swiglu, (_rand(2, 7, **f64), _rand(2, 7, seed=1, **f64)))
    _gradcheck(lambda x, t: kernels.qk_norm(x, t, 1e-6), (_rand(2, 3, 4, **f64), _rand(3, **f64)))
    cos, sin = _rand(1, 1, 3, 2, grad=False, **f64), _rand(1, 1, 3, 2, seed=5, grad=False, **f64)
    _gradcheck(lambda x: kernels.rope(x, cos, sin), (_rand(2, 2, 3, 4, **f64),))
    table_c, table_s = _rand(9, 2, grad=False, **f64), _rand(9, 2, seed=6, grad=False, **f64)
    pos = torch.tensor([[1, 8, 4]], device=dev)
    _gradcheck(lambda q, k, t: kernels.qk_norm_rope(q, k, t, table_c, table_s, pos, 1e-6),
               (_rand(1, 3, 2, 4, **f64), _rand(1, 3, 1, 4, seed=7, **f64), _rand(1, **f64)))
    idx = torch.tensor([[3, 0], [1, 2]], device=dev)
    _gradcheck(kernels.gather_rows, (_rand(2, 4, 3, **f64), idx))
    _gradcheck(lambda x, d, g: kernels.scatter_add_gated(x, idx, d, g),
               (_rand(2, 4, 3, **f64), _rand(2, 2, 3, seed=8, **f64), _rand(2, 2, seed=9, **f64)))


# ----------------------------------------------------------------------------- switches really switch
def test_set_use_triton_kernels_switches_the_dispatch(dev, monkeypatch):
    counter = CallCounter(monkeypatch, "norms", "norm_fwd")
    x, w = _rand(2, 6, device=dev), _rand(6, device=dev)
    kernels.rms_norm(x, w)
    assert counter.calls == 1
    kernels.set_use_triton_kernels(False)
    torch.testing.assert_close(kernels.rms_norm(x, w), reference.rms_norm(x, w, 1e-6))
    assert counter.calls == 1
    assert kernels.get_kernel_status()["kernels"]["rms_norm"] is False


@pytest.mark.parametrize("env", [{"HYDRA_DISABLE_FUSED_ROPE": "1"}, {"HYDRA_ENABLE_FUSED_ROPE": "0"},
                                 {"HYDRA_DISABLE_TRITON": "1"}])
def test_environment_switches_take_effect_on_refresh_only(dev, monkeypatch, env):
    counter = CallCounter(monkeypatch, "rope", "rope_apply")
    x, cos = _rand(1, 2, 3, 4, device=dev), _rand(1, 1, 3, 2, device=dev, grad=False)
    sin = _rand(1, 1, 3, 2, device=dev, seed=1, grad=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    kernels.rope(x, cos, sin)
    assert counter.calls == 1, "the environment is read by refresh_from_env(), never inside a forward"
    kernels.refresh_from_env()
    kernels.rope(x, cos, sin).sum().backward()
    assert counter.calls == 1
    torch.testing.assert_close(x.grad, reference.rope(torch.ones_like(x), cos, -sin))
    status = kernels.get_kernel_status()
    assert status["kernels"]["rope"] is False
    assert status["disabled_by_env"] is ("HYDRA_DISABLE_TRITON" in env)
    if "HYDRA_DISABLE_TRITON" in env:
        with pytest.warns(UserWarning, match="HYDRA_DISABLE_TRITON"):
            assert kernels.set_use_triton_kernels(True) is False


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "qk_norm"])
def test_backward_flags_fall_back_to_the_reference_backward(dev, monkeypatch, op):
    module, launcher = ("swiglu", "swiglu_bwd") if op == "swiglu" else ("norms", "norm_bwd")
    counter = CallCounter(monkeypatch, module, launcher)
    monkeypatch.setenv(f"HYDRA_DISABLE_FUSED_{op.upper()}_BWD", "1")
    kernels.refresh_from_env()
    x, y = _rand(3, 2, 5, device=dev), _rand(3, 2, 5, device=dev, seed=1)
    cases = {"rms_norm": (lambda a, b: kernels.rms_norm(a, b[0, 0], 1e-6),
                          lambda a, b: reference.rms_norm(a, b[0, 0], 1e-6)),
             "swiglu": (kernels.swiglu, reference.swiglu),
             "qk_norm": (lambda a, b: kernels.qk_norm(a, b[0, :, 0], 1e-6),
                         lambda a, b: reference.qk_norm(a, b[0, :, 0], 1e-6))}
    _compare(*cases[op], [x, y])
    assert counter.calls == 0
    kernels.set_kernel_enabled(f"{op}_bwd", True)
    _compare(*cases[op], [x, y])
    assert counter.calls == 1


def test_dispatch_rules():
    x = torch.randn(2, 4)
    assert not switches.use_kernel("rms_norm", x), "off by default"
    switches.STATE.active = True
    switches.STATE.interpreter = False
    assert not switches.use_kernel("rms_norm", x), "compiled Triton never gets CPU tensors"
    switches.STATE.interpreter = True
    assert switches.use_kernel("rms_norm", x, None)
    assert not switches.use_kernel("rms_norm", x.to(torch.float8_e4m3fn)), "unsupported dtypes go to the reference"
    kernels.set_kernel_enabled("rms_norm", False)
    assert not switches.use_kernel("rms_norm", x)
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.set_kernel_enabled("flash", True)
    switches.STATE.loaded, switches.STATE.load_error = False, "ImportError: no triton"
    with pytest.warns(UserWarning, match="no triton"):
        assert kernels.set_use_triton_kernels(True) is False
    assert kernels.get_kernel_status()["triton_load_error"] == "ImportError: no triton"


def test_kernel_status_contents():
    status = kernels.get_kernel_status()
    for key in ("triton_available", "triton_version", "use_triton_kernels", "interpreter", "active",
                "disabled_by_env", "cuda_available", "kernels", "flags"):
        assert key in status
    assert status["use_triton_kernels"] is False and status["active"] is False
    assert set(status["kernels"]) == set(kernels.KERNELS)
    assert set(kernels.KERNELS) >= {"rope", "rms_norm", "rms_norm_bwd", "swiglu_bwd", "qk_norm_bwd"}
    if status["triton_available"]:
        assert isinstance(status["triton_version"], str)


def test_benchmark_runs_and_prints(dev, capsys):
    results = kernels.benchmark_kernels(batch_size=1, seq_len=4, dim=16, device=dev, head_dim=4,
                                        kernels=["rms_norm", "qk_norm_rope", "scatter_add_gated"],
                                        warmup=0, reps=1, compile=False)
    assert results["device"] == dev and set(results["kernels"]) == {"rms_norm", "qk_norm_rope", "scatter_add_gated"}
    for row in results["kernels"].values():
        assert row["errors"] == {} and row["pytorch_ms"] > 0 and row["triton_ms"] > 0
        assert set(row["timing"].values()) == {"cuda-graph" if dev == "cuda" else "back-to-back"}
    if dev == "cpu":
        assert "interpreter" in results["triton_mode"]
    text = kernels.print_benchmark_results(results)
    assert "qk_norm_rope" in text and "qk_norm_rope" in capsys.readouterr().out


def test_interpreter_suite_in_fresh_process():
    if os.environ.get(CHILD_FLAG) or torch.cuda.is_available():
        pytest.skip("child process, or a CUDA host (tested compiled there)")
    if not switches.triton_available():
        pytest.skip("triton not installed")
    if _triton_device() is not None:
        pytest.skip("the interpreter tests already ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_FLAG: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# ----------------------------------------------------------------------------- GPU: bf16, compile, timing
@pytest.mark.gpu
@needs_cuda
def test_bf16_on_gpu_matches_fp32_reference():
    assert kernels.set_use_triton_kernels(True)
    tol = dict(atol=3e-2, rtol=3e-2)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w = _rand(4, 64, 768, **bf), _rand(768, **bf)
    _compare(lambda x, w: kernels.rms_norm(x, w, 1e-6),
             lambda x, w: reference.rms_norm(x.float(), w.float(), 1e-6).bfloat16(), [x, w], tol)
    g, u = _rand(4, 64, 2048, **bf), _rand(4, 64, 2048, seed=1, **bf)
    _compare(kernels.swiglu, lambda g, u: reference.swiglu(g.float(), u.float()).bfloat16(), [g, u], tol)
    rope = RotaryEmbedding(64, 512).cuda()
    pos = torch.sort(torch.randperm(512, device="cuda")[:128]).values.expand(4, 128).contiguous()
    q, k, t = _rand(4, 128, 12, 64, **bf), _rand(4, 128, 3, 64, seed=2, **bf), _rand(3, device="cuda", seed=3)

    def ref(q, k, t):
        outs = reference.qk_norm_rope(q.float(), k.float(), t, rope.cos, rope.sin, pos, 1e-6)
        return tuple(o.bfloat16() for o in outs)

    _compare(lambda q, k, t: kernels.qk_norm_rope(q, k, t, rope.cos, rope.sin, pos, 1e-6), ref, [q, k, t], tol)


@pytest.mark.gpu
@needs_cuda
def test_ops_compile_fullgraph_on_gpu_with_the_same_gradients():
    assert kernels.set_use_triton_kernels(True)
    rope = RotaryEmbedding(64, 256).cuda()
    pos = torch.arange(256, device="cuda").expand(2, 256)
    idx = torch.arange(0, 256, 2, device="cuda").expand(2, 128).contiguous()

    def unit(x, w, q, k, t, gate):
        qo, ko = kernels.qk_norm_rope(q, k, t, rope.cos, rope.sin, pos, 1e-6)
        sel = kernels.gather_rows(kernels.rms_norm(x, w, 1e-6), idx)
        # swiglu(sel, sel): one tensor entering an autograd Function twice (see ops.swiglu).
        delta = kernels.swiglu(*torch.cat((sel, sel * 0.5), -1).chunk(2, -1)) + kernels.swiglu(sel, sel)
        y = kernels.scatter_add_gated(x, idx, delta, gate)
        return y.square().sum() + (qo * kernels.rope(ko, rope.cos[pos][:, None], rope.sin[pos][:, None])).sum()

    args = [_rand(2, 256, 128, device="cuda"), _rand(128, device="cuda"), _rand(2, 256, 2, 64, device="cuda"),
            _rand(2, 256, 2, 64, device="cuda", seed=1), _rand(2, device="cuda"), _rand(2, 128, device="cuda")]
    eager = torch.autograd.grad(unit(*args), args)
    compiled = torch.autograd.grad(torch.compile(unit, fullgraph=True)(*args), args)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
