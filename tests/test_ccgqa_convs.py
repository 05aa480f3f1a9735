"""CCGQA's causal convolutions as shifted taps equal F.conv1d with the same weights, also per document."""

import pytest
import torch
import torch.nn.functional as F

from hydra_lm.model.attention import CCGQAttention

from support import tiny_model


def _attention(ks=3, kc=2, seed=0):
    torch.manual_seed(seed)
    attn = CCGQAttention(dim=64, n_heads=4, n_kv_heads=2, head_dim=8, conv_seq_kernel=ks, conv_ch_kernel=kc).double()
    for p in (attn.conv_seq.weight, attn.conv_seq.bias, attn.conv_ch.weight, attn.conv_ch.bias):
        torch.nn.init.normal_(p)  # default init is small: make every tap matter
    return attn


def _reference(attn, xp):
    """Both convs with F.conv1d on a left-padded [B, P + N, C] input."""
    y = F.conv1d(xp.transpose(1, 2), attn.conv_seq.weight, attn.conv_seq.bias, groups=attn.conv_seq.groups)
    return F.conv1d(y, attn.conv_ch.weight, attn.conv_ch.bias, groups=attn.conv_ch.groups).transpose(1, 2)


@pytest.mark.parametrize("ks,kc", [(3, 2), (4, 3), (2, 1)])
def test_taps_equal_conv1d_from_zeros_and_from_a_history(ks, kc):
    attn = _attention(ks, kc)
    qk = torch.randn(2, 11, attn.q_dim + attn.kv_dim, dtype=torch.float64, requires_grad=True)
    ref = _reference(attn, F.pad(qk, (0, 0, attn.conv_pad, 0)))
    out = attn.causal_convs(qk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(ref)
    params = (qk, attn.conv_seq.weight, attn.conv_seq.bias, attn.conv_ch.weight, attn.conv_ch.bias)
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    history = torch.randn(2, attn.conv_pad, qk.shape[-1], dtype=torch.float64)
    torch.testing.assert_close(attn.causal_convs(qk, history), _reference(attn, torch.cat((history, qk), 1)),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("ks,kc", [(3, 2), (4, 3)])
def test_document_boundaries_restart_both_convs(ks, kc):
    attn = _attention(ks, kc)
    lengths = [5, 1, 2, 9]  # documents shorter than the kernels too
    qk = torch.randn(2, sum(lengths), attn.q_dim + attn.kv_dim, dtype=torch.float64)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(2, -1)
    out = attn.causal_convs(qk, doc=doc)
    start = 0
    for n in lengths:
        piece = qk[:, start:start + n]
        torch.testing.assert_close(out[:, start:start + n], _reference(attn, F.pad(piece, (0, 0, attn.conv_pad, 0))),
                                   rtol=0, atol=1e-12)
        start += n
    one_doc = torch.zeros_like(doc)
    torch.testing.assert_close(attn.causal_convs(qk, doc=one_doc), attn.causal_convs(qk), rtol=0, atol=1e-12)


def test_parameter_names_and_shapes_are_unchanged():
    state = tiny_model().state_dict()
    conv = {k: tuple(v.shape) for k, v in state.items() if ".conv_" in k}
    assert conv["blocks.0.layers.0.attn.conv_seq.weight"] == (24, 1, 3)
    assert conv["blocks.0.layers.0.attn.conv_ch.weight"] == (24, 8, 2)
    assert {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1] for k in conv} == {
        "conv_seq.weight", "conv_seq.bias", "conv_ch.weight", "conv_ch.bias"}
