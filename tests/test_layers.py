"""The building blocks: layers, attention backends, memory footprint (each imported from its defining module)."""

import math

import pytest
import torch
import torch.nn.functional as F

from hydra_lm.model import attention, attention_backend, layers
from hydra_lm.train.memory_estimate import compute_memory_footprint
from hydra_lm.model.attention import CCGQAttention, GQAttention, set_attention_backend
from support import tiny_model


def test_rmsnorm_and_swiglu_match_their_definitions():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    norm = layers.RMSNorm(16)
    torch.nn.init.normal_(norm.weight)
    ref = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight
    torch.testing.assert_close(norm(x), ref)
    mlp = layers.SwiGLUMLP(16, 24)
    gate, up = mlp.gate_up.weight.split(24)
    torch.testing.assert_close(mlp(x), (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.down.weight.T)


def test_rotary_is_relative_and_norm_preserving():
    rope = layers.RotaryEmbedding(8, 64)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i, j):
        ci, si = rope(torch.tensor([[i]]), torch.float32)
        cj, sj = rope(torch.tensor([[j]]), torch.float32)
        return (layers.apply_rotary(q, ci, si) * layers.apply_rotary(k, cj, sj)).sum()
    torch.testing.assert_close(score(10, 3), score(27, 20), rtol=1e-5, atol=1e-5)
    c, s = rope(torch.tensor([[13]]), torch.float32)
    torch.testing.assert_close(layers.apply_rotary(q, c, s).norm(), q.norm())


def test_a_float64_model_gets_the_exact_rotary_table_and_a_float32_one_its_rounding():
    """A float64 model is the reference the kernels and decode are checked against to 1e-9: its table must not be
    float32's widened (3e-8 off)."""
    rope = layers.RotaryEmbedding(64, 512, theta=10000.0)
    angles = torch.outer(torch.arange(512, dtype=torch.float64),
                         1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert rope.cos.dtype == torch.float32
    torch.testing.assert_close(rope.cos, angles.cos().float(), rtol=0, atol=0)
    rope.double()
    torch.testing.assert_close(rope.cos, angles.cos(), rtol=0, atol=1e-15)
    torch.testing.assert_close(rope.sin, angles.sin(), rtol=0, atol=1e-15)
    rope.float()
    torch.testing.assert_close(rope.sin, angles.sin().float(), rtol=0, atol=0)


def test_flexible_attention_expands_gqa_and_validates_backends():
    q, k, v = torch.randn(2, 8, 10, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    out = attention_backend.flexible_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    torch.testing.assert_close(out, ref)
    # The packages serve CUDA calls only: on a CPU every backend is SDPA.
    for backend in ("sdpa", "flash", "xformers"):
        torch.testing.assert_close(attention_backend.flexible_attention(q, k, v, backend=backend), out)
    with pytest.raises(ValueError, match="choose one of"):
        attention_backend.flexible_attention(q, k, v, backend="magic")
    with pytest.raises(ValueError, match=r"HydraConfig.attention_backend='magic': must be one of"):
        tiny_model(attention_backend="magic")
    model = tiny_model(attention_backend="sdpa", arch="dense", n_layers=2, n_heads=4, n_kv_heads=2)
    assert {m.backend for m in model.modules() if isinstance(m, GQAttention)} == {"sdpa"}


def test_forcing_an_sdpa_kernel_also_keeps_document_masks_off_the_direct_cudnn_call():
    """bench --sdpa_kernel: the dense document mask's direct cuDNN call (CUDA, doc_attention) obeys the forced
    kernel, inside nested restrictions, and the setting comes back after an error."""
    from hydra_lm.model import doc_attention

    assert doc_attention.cudnn_causal_bias_allowed
    with attention_backend.sdpa_kernel_only("math"):
        assert not doc_attention.cudnn_causal_bias_allowed and not torch.backends.cuda.cudnn_sdp_enabled()
        with attention_backend.sdpa_kernel_only("cudnn"):
            assert doc_attention.cudnn_causal_bias_allowed
        assert not doc_attention.cudnn_causal_bias_allowed
    with pytest.raises(RuntimeError), attention_backend.sdpa_kernel_only("flash"):
        raise RuntimeError
    with attention_backend.sdpa_kernel_only("auto"):
        assert doc_attention.cudnn_causal_bias_allowed


def test_set_attention_backend_switches_a_built_model_and_its_config_together():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    before = model(ids)["logits"]
    set_attention_backend(model, "sdpa")
    kernels = {m.backend for m in model.modules() if isinstance(m, CCGQAttention)}
    assert kernels == {"sdpa"} and model.config.attention_backend == "sdpa"
    torch.testing.assert_close(model(ids)["logits"], before)  # on a CPU every backend is SDPA
    with pytest.raises(ValueError, match="attention_backend='magic': must be one of"):
        set_attention_backend(model, "magic")
    assert model.config.attention_backend == "sdpa"  # a refused name changes nothing


@pytest.mark.parametrize("overrides", [{}, {"arch": "dense", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}],
                         ids=["ccgqa", "gqa"])
def test_the_packages_get_q_k_v_in_the_autocast_dtype(overrides, monkeypatch):
    # Under CUDA autocast CCGQA's q and k leave the fp32 norms in fp32 while v is bf16: SDPA casts them itself, but
    # flash-attn takes only fp16 / bf16 and xFormers one dtype for all three. CPU autocast keeps rms_norm in its
    # input's dtype: patched to run in fp32 as CUDA autocast runs it.
    rms_norm = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda x, shape, weight=None, eps=None: rms_norm(
        x.float(), shape, None if weight is None else weight.float(), eps))
    seen = []
    flexible = attention.flexible_attention
    monkeypatch.setattr(attention, "flexible_attention",
                        lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or flexible(q, k, v, **kw))
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tiny_model(attention_backend="flash", **overrides).eval()(ids)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen)


def test_gradient_checkpoint_mixin_and_memory_footprint():
    model = tiny_model()
    before = compute_memory_footprint(model, batch_size=4, seq_len=64)
    model.enable_gradient_checkpointing()
    assert model.gradient_checkpointing
    after = compute_memory_footprint(model, batch_size=4, seq_len=64)
    assert after["activations_mb"] < before["activations_mb"]
    assert math.isclose(before["weights_mb"], model.num_parameters() * 4 / 2**20)
    model.disable_gradient_checkpointing()
    assert not model.gradient_checkpointing


def test_init_helpers():
    lin = torch.nn.Linear(256, 256)
    layers.init_weights_normal(lin, std=0.02)
    assert abs(lin.weight.std().item() - 0.02) < 0.002 and lin.bias.abs().sum() == 0
    layers.scale_residual_weights([lin], n_residual_layers=8, std=0.02)
    assert abs(lin.weight.std().item() - 0.02 / 4) < 0.001
