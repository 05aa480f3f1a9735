"""CCGQA (attention inside a compressed latent, arXiv 2510.04476) and plain GQA, with decode caches.

Both modules take a (possibly compacted) sequence ``x`` [B, N, E] with the ORIGINAL position of
every entry, ``pos`` [B, N]. Two ways to run:

* full: causal attention over the N entries (training, evaluation);
* cached (``cache`` given): the N entries are new tokens appended to a per-layer cache. ``valid``
  [B, N] marks which entries really are tokens of this unit; valid entries come first in every row
  (the router orders them so). Invalid entries are computed but never stored as valid, never
  attended to by valid ones and never advance the conv / value-shift state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention_backend import flexible_attention
from .layers import RotaryEmbedding, apply_rotary


@dataclass
class AttentionCache:
    """Decode state of one attention layer in one routed unit (slots indexed by original position)."""

    k: torch.Tensor  # [B, h_k, L, d]
    v: torch.Tensor  # [B, h_k, L, d]
    slot_valid: torch.Tensor  # [B, L] bool: this position entered the unit
    conv: torch.Tensor | None = None  # [B, P, C] last P pre-conv q/k latents of routed tokens (CCGQA)
    shift: torch.Tensor | None = None  # [B, c] value-shift projection of the previous routed token (CCGQA)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.slot_valid, self.conv, self.shift)
                   if t is not None)


def empty_kv_cache(batch: int, kv_heads: int, length: int, head_dim: int, device, dtype) -> AttentionCache:
    return AttentionCache(
        k=torch.zeros(batch, kv_heads, length, head_dim, device=device, dtype=dtype),
        v=torch.zeros(batch, kv_heads, length, head_dim, device=device, dtype=dtype),
        slot_valid=torch.zeros(batch, length, dtype=torch.bool, device=device),
    )


def _valid_counts(valid: torch.Tensor | None, batch: int, n: int, device: torch.device) -> torch.Tensor:
    if valid is None:
        return torch.full((batch,), n, dtype=torch.long, device=device)
    return valid.sum(dim=1)


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, i - s] along dim 1, zeros before the start."""
    return x if s == 0 else F.pad(x, (0, 0, s, 0))[:, : x.shape[1]]


def _same_doc(doc: torch.Tensor, s: int) -> torch.Tensor:
    """[B, N] bool: entry i - s exists and belongs to the same document as entry i."""
    return doc == (doc if s == 0 else F.pad(doc, (s, 0), value=-1)[:, : doc.shape[1]])


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor | None) -> torch.Tensor:
    """Causal attention over the whole (compacted) row; with ``doc`` [B, N], only within a document."""
    if doc is None:
        return flexible_attention(q, k, v, is_causal=True)
    gqa = q.shape[1] != k.shape[1]
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask = causal & (doc[:, :, None] == doc[:, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor | None, cache: AttentionCache) -> torch.Tensor:
    """Store k/v of the new entries at their positions, then attend over every valid slot <= position.

    q [B, h_q, N, d]; k, v [B, h_k, N, d]; returns [B, h_q, N, d].
    """
    b, h_k, n, d = k.shape
    index = pos[:, None, :, None].expand(b, h_k, n, d)
    cache.k.scatter_(2, index, k.to(cache.k.dtype))
    cache.v.scatter_(2, index, v.to(cache.v.dtype))
    is_valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid
    cache.slot_valid.scatter_(1, pos, is_valid)
    slots = torch.arange(cache.k.shape[2], device=pos.device)
    before = slots[None, None, :] <= pos[:, :, None]
    # Each entry may always see its own slot, so no row is fully masked (which would give NaN).
    mask = (cache.slot_valid[:, None, :] & before) | (slots[None, None, :] == pos[:, :, None])
    return F.scaled_dot_product_attention(q, cache.k.to(q.dtype), cache.v.to(q.dtype), attn_mask=mask[:, None],
                                          enable_gqa=q.shape[1] != h_k)


class CCGQAttention(nn.Module):
    """Compressed convolutional grouped-query attention.

    1. q0 = x W_q (E -> h_q d), k0 = x W_k (E -> h_k d) in one fused projection with the values;
    2. [q0; k0] -> depthwise causal conv over time (kernel k_seq) -> grouped causal conv, one group
       per head (kernel k_ch);
    3. q-k-mean: q += (q0 + k0 of its group) / 2, k += mean over the group of that;
    4. value shift: half of the value channels come from the previous token of the sequence;
    5. L2-normalise q, k to norm sqrt(d) (k times a learnable per-KV-head temperature exp(t)),
       RoPE at the original positions, causal softmax attention in the latent, W_o back to E.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, conv_seq_kernel: int = 3,
                 conv_ch_kernel: int = 2, qk_mean: bool = True, value_shift: bool = True, eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_dim, self.kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        self.qk_mean, self.value_shift, self.eps = qk_mean, value_shift, eps
        self.v_prev_dim = self.kv_dim // 2 if value_shift else 0
        # One matmul for q0, k0, v (current token) and the value-shift projection (applied to x_t,
        # shifted afterwards: x_{t-1} W = (x W)_{t-1}, so we shift the small latent, not x).
        self.qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim, bias=False)
        channels = self.q_dim + self.kv_dim
        self.conv_seq = nn.Conv1d(channels, channels, conv_seq_kernel, groups=channels)
        self.conv_ch = nn.Conv1d(channels, channels, conv_ch_kernel, groups=n_heads + n_kv_heads)
        self.conv_pad = (conv_seq_kernel - 1) + (conv_ch_kernel - 1)
        self.temperature = nn.Parameter(torch.zeros(n_kv_heads))
        self.out = nn.Linear(self.q_dim, dim, bias=False)

    def new_cache(self, batch: int, length: int, device, dtype) -> AttentionCache:
        cache = empty_kv_cache(batch, self.n_kv_heads, length, self.head_dim, device, dtype)
        cache.conv = torch.zeros(batch, self.conv_pad, self.q_dim + self.kv_dim, device=device, dtype=dtype)
        cache.shift = torch.zeros(batch, self.v_prev_dim, device=device, dtype=dtype)
        return cache

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: RotaryEmbedding,
                cache: AttentionCache | None = None, valid: torch.Tensor | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        h_q, h_k, d = self.n_heads, self.n_kv_heads, self.head_dim
        q0, k0, v_now, v_prev = self.qkv(x).split(
            [self.q_dim, self.kv_dim, self.kv_dim - self.v_prev_dim, self.v_prev_dim], dim=-1)
        qk = torch.cat((q0, k0), dim=-1)

        if doc is not None:
            conv = self._doc_conv(qk, doc)
            if self.value_shift:
                v_prev = torch.where(_same_doc(doc, 1)[..., None], _shift(v_prev, 1), torch.zeros_like(v_prev))
        elif cache is None:
            qk_padded = F.pad(qk, (0, 0, self.conv_pad, 0))
            if self.value_shift:
                v_prev = _shift(v_prev, 1)
        else:
            count = _valid_counts(valid, b, n, x.device)
            qk_padded = torch.cat((cache.conv.to(qk.dtype), qk), dim=1)
            take = (count[:, None] + torch.arange(self.conv_pad, device=x.device))[..., None]
            cache.conv.copy_(qk_padded.gather(1, take.expand(-1, -1, qk.shape[-1])))
            if self.value_shift:
                shifted = torch.cat((cache.shift[:, None].to(v_prev.dtype), v_prev), dim=1)
                cache.shift.copy_(shifted.gather(1, count[:, None, None].expand(-1, 1, self.v_prev_dim))[:, 0])
                v_prev = shifted[:, :n]

        if doc is None:
            conv = self.conv_ch(self.conv_seq(qk_padded.transpose(1, 2))).transpose(1, 2)
        q, k = conv.split([self.q_dim, self.kv_dim], dim=-1)
        q = q.reshape(b, n, h_k, h_q // h_k, d)
        k = k.reshape(b, n, h_k, d)
        if self.qk_mean:
            mean_q = (q0.reshape(b, n, h_k, h_q // h_k, d) + k0.reshape(b, n, h_k, 1, d)) * 0.5
            q = q + mean_q
            k = k + mean_q.mean(dim=3)
        v = torch.cat((v_now, v_prev), dim=-1) if self.value_shift else v_now
        # rms_norm == x / ||x|| * sqrt(d): the L2 normalisation to norm sqrt(d) in one fused op.
        q = F.rms_norm(q.reshape(b, n, h_q, d), (d,), eps=self.eps)
        k = F.rms_norm(k, (d,), eps=self.eps) * self.temperature.exp().to(k.dtype)[:, None]
        cos, sin = rope(pos, q.dtype)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = v.reshape(b, n, h_k, d).transpose(1, 2)
        y = cached_attention(q, k, v, pos, valid, cache) if cache is not None else full_attention(q, k, v, doc)
        return self.out(y.transpose(1, 2).reshape(b, n, self.q_dim))

    def _doc_conv(self, qk: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        """Both causal convs, with every document treated as a sequence of its own.

        A tap that reaches into another document reads what a fresh sequence would read there:
        zero input for the first conv, and the first conv's output on zeros (its bias) for the second.
        """
        ks, kc = self.conv_seq.kernel_size[0], self.conv_ch.kernel_size[0]
        w1 = self.conv_seq.weight[:, 0]  # [C, ks]
        y1 = self.conv_seq.bias
        for s in range(ks):
            y1 = y1 + w1[:, ks - 1 - s] * torch.where(_same_doc(doc, s)[..., None], _shift(qk, s), 0.0)
        y2 = self.conv_ch.bias
        for s in range(kc):
            tap = torch.where(_same_doc(doc, s)[..., None], _shift(y1, s), self.conv_seq.bias)
            weight = self.conv_ch.weight[:, :, kc - 1 - s: kc - s]
            y2 = y2 + F.conv1d(tap.transpose(1, 2), weight, groups=self.conv_ch.groups).transpose(1, 2)
        return y2


class GQAttention(nn.Module):
    """Standard grouped-query attention with RoPE (the dense baseline's attention)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_dim, self.kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        self.qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim, bias=False)
        self.out = nn.Linear(self.q_dim, dim, bias=False)

    def new_cache(self, batch: int, length: int, device, dtype) -> AttentionCache:
        return empty_kv_cache(batch, self.n_kv_heads, length, self.head_dim, device, dtype)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: RotaryEmbedding,
                cache: AttentionCache | None = None, valid: torch.Tensor | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        cos, sin = rope(pos, q.dtype)
        q = apply_rotary(q.reshape(b, n, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rotary(k.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = cached_attention(q, k, v, pos, valid, cache) if cache is not None else full_attention(q, k, v, doc)
        return self.out(y.transpose(1, 2).reshape(b, n, self.q_dim))
