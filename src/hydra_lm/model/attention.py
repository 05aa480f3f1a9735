"""CCGQA (attention inside a compressed latent, arXiv 2510.04476) and plain GQA, with decode caches.

Both modules take a (possibly compacted) sequence ``x`` [B, N, E] with the ORIGINAL position of
every entry, ``pos`` [B, N]. Two ways to run:

* full: causal attention over the N entries (training, evaluation);
* cached (``cache`` given, no documents): the N entries are new tokens appended to a per-layer cache. ``valid``
  [B, N] marks which entries really are tokens of this unit; valid entries come first in every row
  (the router orders them so). Invalid entries are computed but never stored as valid, never
  attended to by valid ones and never advance the conv / value-shift state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ATTENTION_BACKENDS, DECODE_KERNELS, HydraConfig
from ..kernels import TRITON_AVAILABLE
from .attention_backend import check_attention_backend, flexible_attention
from .doc_attention import Documents, doc_causal_attention, resolve_doc_mask_backend
from .layers import RotaryEmbedding, apply_rotary



# The CCGQA decode kernel keeps a group's query heads and their accumulator in registers ([16, head_dim] fp32 per
# program): heads of 1,024 did not finish compiling in 8 minutes on an H100. Wider heads take the PyTorch ops.
DECODE_KERNEL_MAX_HEAD_DIM = 256


def decode_kernels_run(setting: str, device: torch.device) -> bool:
    """Whether a decode step on ``device`` runs the Triton decode kernels (``HydraConfig.decode_kernel``: "auto"
    on CUDA with Triton installed, "triton" always, "torch" never); a ValueError for "triton" where they cannot
    run."""
    if setting == "torch" or (setting == "auto" and not (torch.device(device).type == "cuda" and TRITON_AVAILABLE)):
        return False
    if setting == "triton":
        if not TRITON_AVAILABLE:
            raise ValueError("decode_kernel='triton': Triton is not installed; set HydraConfig.decode_kernel='auto' "
                             "or 'torch' (--model.decode_kernel)")
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("decode_kernel='triton' on a CPU runs only in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before starting Python, or decode_kernel='auto' or 'torch' "
                             "(--model.decode_kernel)")
    return True


def kernels_for_device(config: HydraConfig, device: torch.device) -> tuple[HydraConfig, list[str]]:
    """``config`` with each kernel choice ``device`` cannot run (``decode_kernel``, ``attention_backend``,
    ``doc_mask_backend``) set to "auto", and a line saying so for each. They change how attention is computed, not
    what, so a run saved with a kernel of its training host still evaluates and generates elsewhere."""
    checks = {"decode_kernel": lambda value: decode_kernels_run(value, device),
              "attention_backend": lambda value: check_attention_backend(value, device),
              "doc_mask_backend": lambda value: resolve_doc_mask_backend(value, device, config.head_dim)}
    changes = {}
    for name, check in checks.items():
        try:
            check(getattr(config, name))
        except ValueError:
            changes[name] = "auto"
    notes = [f"the run's {name}={getattr(config, name)!r} cannot run on {torch.device(device)}: using 'auto' (the "
             "same attention, computed another way)" for name in changes]
    return (config.replace(**changes) if changes else config), notes


@dataclass
class AttentionCache:
    """Decode state of one attention layer in one routed unit (slots indexed by original position)."""

    k: torch.Tensor  # [B, h_k, L, d]
    v: torch.Tensor  # [B, h_k, L, d]
    slot_valid: torch.Tensor  # [B, L] bool: this position entered the unit
    conv: torch.Tensor | None = None  # [B, P, C] last P pre-conv q/k latents of routed tokens (CCGQA)
    shift: torch.Tensor | None = None  # [B, c] value-shift projection of the previous routed token (CCGQA)
    # [B, 2, L] per position (router logit, 1 if a candidate of the unit): the decode state of
    # the expert-choice router gating this unit (routing.ExpertChoiceRouter.decode_admits); first layer only.
    route: torch.Tensor | None = None


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


def _no_documents(cache: AttentionCache | None, doc: Documents | None) -> None:
    # No caller passes both: a cache holds one sequence, so CCGQA's conv / value-shift state would run on across
    # the documents' boundaries and the cached attention would attend across them.
    if cache is not None and doc is not None:
        raise ValueError("attention: a forward with a KV cache (a decode step or prefill) takes no documents (doc)")


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: Documents | None,
                   backend: str = "auto") -> torch.Tensor:
    """Causal attention over the whole (compacted) row; with ``doc``, the entries' documents, only within
    a document. ``backend``: ``HydraConfig.attention_backend``."""
    if doc is None:
        device = q.device.type
        if backend not in ("auto", "sdpa") and torch.is_autocast_enabled(device):
            # SDPA casts to the autocast dtype itself; the packages do not (flash-attn takes only fp16 / bf16,
            # xFormers one dtype for all three), and CCGQA's q/k leave the fp32 norms in fp32.
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return flexible_attention(q, k, v, backend=backend)
    return doc_causal_attention(q, k, v, doc)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     valid: torch.Tensor | None, cache: AttentionCache) -> torch.Tensor:
    """Store k/v of the new entries at their positions, then attend over every valid slot <= position.

    q [B, h_q, N, d]; k, v [B, h_k, N, d]; returns [B, h_q, N, d].
    """
    b, h_k, n, d = k.shape
    # index_put_, not scatter_: compiled, inductor writes an index_put_ in place (its reinplacing pass), while a
    # scatter_ into a graph input becomes a copy of the whole cache, scattered, then copied back: two passes
    # over every unit's K and V caches at every decode step.
    rows = torch.arange(b, device=pos.device)[:, None]
    at = (rows[..., None], torch.arange(h_k, device=pos.device)[None, :, None], pos[:, None, :])  # [B, h_k, n]
    cache.k.index_put_(at, k.to(cache.k.dtype))
    cache.v.index_put_(at, v.to(cache.v.dtype))
    is_valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid
    cache.slot_valid.index_put_((rows, pos), is_valid)
    slots = torch.arange(cache.k.shape[2], device=pos.device)
    before = slots[None, None, :] <= pos[:, :, None]
    # Each entry may always see its own slot, so no row is fully masked (which would give NaN).
    mask = (cache.slot_valid[:, None, :] & before) | (slots[None, None, :] == pos[:, :, None])
    # In the narrower of q's and the cache's dtypes: under autocast the cache is stored in the autocast dtype
    # (HydraModel.init_cache), which SDPA would cast q and an fp32 cache to anyway, so it is read as stored
    # instead of converted whole at every call.
    dtype = cache.k.dtype if cache.k.element_size() < q.element_size() else q.dtype
    return F.scaled_dot_product_attention(q.to(dtype), cache.k.to(dtype), cache.v.to(dtype), attn_mask=mask[:, None],
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

    One new token per row with a cache (a decode step) runs steps 1-5 up to W_o as one Triton kernel on CUDA
    (``decode_kernel``, ``HydraConfig.decode_kernel``; kernels/ccgqa_decode.py); these ops are its reference.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, conv_seq_kernel: int = 3,
                 conv_ch_kernel: int = 2, qk_mean: bool = True, value_shift: bool = True, eps: float = 1e-6,
                 backend: str = "auto", decode_kernel: str = "auto"):
        super().__init__()
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel {decode_kernel!r}: choose one of {list(DECODE_KERNELS)}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.backend = backend  # HydraConfig.attention_backend
        self.decode_kernel = decode_kernel  # HydraConfig.decode_kernel
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
                doc: Documents | None = None) -> torch.Tensor:
        _no_documents(cache, doc)
        b, n, _ = x.shape
        if cache is not None and n == 1 and self._runs_decode_kernel(x):
            from ..kernels.ccgqa_decode import ccgqa_decode  # imports Triton: only where the kernel runs

            return self.out(ccgqa_decode(self, x, pos, rope, cache, valid))
        h_q, h_k, d = self.n_heads, self.n_kv_heads, self.head_dim
        ids = None if doc is None else doc.ids
        q0, k0, v_now, v_prev = self.qkv(x).split(
            [self.q_dim, self.kv_dim, self.kv_dim - self.v_prev_dim, self.v_prev_dim], dim=-1)
        qk = torch.cat((q0, k0), dim=-1)

        # The convs read the cached latents (decode) or zeros (a sequence start); computed before
        # the cache is advanced below.
        history = cache.conv.to(qk.dtype) if cache is not None else None
        conv = self.causal_convs(qk, history, ids)
        if ids is not None:
            if self.value_shift:
                v_prev = torch.where(_same_doc(ids, 1)[..., None], _shift(v_prev, 1), torch.zeros_like(v_prev))
        elif cache is None:
            if self.value_shift:
                v_prev = _shift(v_prev, 1)
        else:
            count = _valid_counts(valid, b, n, x.device)
            qk_padded = torch.cat((history, qk), dim=1)
            take = (count[:, None] + torch.arange(self.conv_pad, device=x.device))[..., None]
            cache.conv.copy_(qk_padded.gather(1, take.expand(-1, -1, qk.shape[-1])))
            if self.value_shift:
                shifted = torch.cat((cache.shift[:, None].to(v_prev.dtype), v_prev), dim=1)
                cache.shift.copy_(shifted.gather(1, count[:, None, None].expand(-1, 1, self.v_prev_dim))[:, 0])
                v_prev = shifted[:, :n]
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
        y = cached_attention(q, k, v, pos, valid, cache) if cache is not None else \
            full_attention(q, k, v, doc, self.backend)
        return self.out(y.transpose(1, 2).reshape(b, n, self.q_dim))

    def _runs_decode_kernel(self, x: torch.Tensor) -> bool:
        """Whether a one-token cached forward on ``x`` runs the Triton decode kernel (``decode_kernel``)."""
        d = self.head_dim
        if d & (d - 1) or d > DECODE_KERNEL_MAX_HEAD_DIM:
            if self.decode_kernel == "triton":
                why = "is not a power of two" if d & (d - 1) else f"is over the kernel's {DECODE_KERNEL_MAX_HEAD_DIM}"
                raise ValueError(f"decode_kernel='triton': head_dim {d} {why}; set "
                                 "HydraConfig.decode_kernel='auto' or 'torch' (--model.decode_kernel)")
            return False
        return decode_kernels_run(self.decode_kernel, x.device)

    def causal_convs(self, qk: torch.Tensor, history: torch.Tensor | None = None,
                     doc: torch.Tensor | None = None) -> torch.Tensor:
        """Depthwise causal conv over time, then the grouped causal conv, on qk [B, N, C].

        ``history`` [B, P, C]: the P = conv_pad pre-conv latents before the first entry (zeros
        when None). With ``doc`` [B, N] every document is a sequence of its own: a tap reaching into
        another document (or before the row) reads what a fresh sequence reads there, zero input
        for the first conv and the first conv's output on zeros (its bias) for the second.

        Written as sums of shifted taps times weights so that torch.compile fuses them with their
        neighbours (F.conv1d, through cuDNN, measured no faster: benchmarks/BENCHMARKS.md).
        """
        b, n, c = qk.shape
        ks, kc, p = self.conv_seq.kernel_size[0], self.conv_ch.kernel_size[0], self.conv_pad
        xp = F.pad(qk, (0, 0, p, 0)) if history is None else torch.cat((history, qk), dim=1)
        # Document of each padded position (-1 before the row); a tap is kept iff it reads from
        # the document of the position it computes.
        docp = None if doc is None else F.pad(doc, (p, 0), value=-1)
        n1 = n + kc - 1  # first-conv outputs the second conv needs (positions -(kc-1) .. n-1)

        # conv_seq: out[i] = bias + sum_j w[:, j] * xp[i + j] (cross-correlation, like F.conv1d),
        # accumulated in at least float32 (compile fuses the chain into one kernel).
        acc = torch.promote_types(qk.dtype, torch.float32)
        w1 = self.conv_seq.weight[:, 0].to(acc)  # [C, ks]
        y1 = self.conv_seq.bias.to(acc)
        for j in range(ks):
            tap = xp[:, j: j + n1]
            if docp is not None:
                keep = docp[:, j: j + n1] == docp[:, ks - 1: ks - 1 + n1]
                tap = torch.where(keep[..., None], tap, torch.zeros_like(tap))
            y1 = y1 + w1[:, j] * tap.to(acc)
        y1 = y1.to(qk.dtype)

        # conv_ch: one group per head (width d), so per group a [d, kc*d] matmul over the kc taps.
        groups = self.conv_ch.groups
        d = c // groups
        taps = []
        for j in range(kc):
            tap = y1[:, j: j + n]
            if docp is not None:
                d1 = docp[:, ks - 1:]  # document of each first-conv output
                keep = d1[:, j: j + n] == d1[:, kc - 1: kc - 1 + n]
                tap = torch.where(keep[..., None], tap, self.conv_seq.bias.to(tap.dtype))
            taps.append(tap.reshape(b, n, groups, 1, d))
        stacked = torch.cat(taps, dim=3).reshape(b, n, groups, kc * d)
        # weight [C_out, d_in, kc] -> [groups, d_out, kc * d_in], matching the tap order above.
        w2 = self.conv_ch.weight.view(groups, d, d, kc).transpose(2, 3).reshape(groups, d, kc * d)
        y2 = torch.einsum("bngi,goi->bngo", stacked, w2.to(stacked.dtype)).reshape(b, n, c)
        return y2 + self.conv_ch.bias.to(y2.dtype)


class GQAttention(nn.Module):
    """Standard grouped-query attention with RoPE (the dense baseline's attention)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, backend: str = "auto"):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.backend = backend  # HydraConfig.attention_backend
        self.q_dim, self.kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        self.qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim, bias=False)
        self.out = nn.Linear(self.q_dim, dim, bias=False)

    def new_cache(self, batch: int, length: int, device, dtype) -> AttentionCache:
        return empty_kv_cache(batch, self.n_kv_heads, length, self.head_dim, device, dtype)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: RotaryEmbedding,
                cache: AttentionCache | None = None, valid: torch.Tensor | None = None,
                doc: Documents | None = None) -> torch.Tensor:
        _no_documents(cache, doc)
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        cos, sin = rope(pos, q.dtype)
        q = apply_rotary(q.reshape(b, n, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rotary(k.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = cached_attention(q, k, v, pos, valid, cache) if cache is not None else \
            full_attention(q, k, v, doc, self.backend)
        return self.out(y.transpose(1, 2).reshape(b, n, self.q_dim))


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Switch a built model's attention kernel (``HydraConfig.attention_backend``: auto, sdpa, flash,
    xformers). The config field chooses it at construction; this changes it afterwards, in the model's
    config too, so the two never disagree. A compiled model recompiles on its next call."""
    config = getattr(model, "config", None)
    if config is not None:
        model.config = config.replace(attention_backend=backend)  # validates the name
    elif backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: choose one of {list(ATTENTION_BACKENDS)}")
    for module in model.modules():
        if isinstance(module, (CCGQAttention, GQAttention)):
            module.backend = backend
