"""One decoded token's CCGQA attention in one Triton kernel: from the QKV projection's output to the latent
attention output, with every decode-state write (K/V slot, slot flag, conv history, value-shift state) on the way.

Compiled from PyTorch ops, this part of a one-token CCGQA layer was 17 kernels of about a microsecond each
(the convs' taps and the grouped conv's GEMM, q/k norms with the qk-mean, RoPE, the three cache writes, the
conv-history and value-shift updates, the attention mask, SDPA), and a decode step is bound by its kernels'
count, not by the bytes they move (benchmarks/BENCHMARKS.md, thirty-ninth session). torch.compile cannot fuse
across the GEMM and SDPA, and no maintained library has CCGQA's conv/qk-mean/value-shift prologue. Here one
program per (row, KV head) runs the convs over the cached history for its query heads and its key head, the
qk-mean, the value shift, the norms and temperature, RoPE at the token's position, and attention over the
row's valid slots before the token, in fp32 (fp64 for a float64 cache). The QKV projection stays cuBLAS's:
inside, two programs at batch 1 took 42 us reading the weights through two multiprocessors.

The reference is ``CCGQAttention.forward`` with a cache and one new token (``decode_kernel="torch"``); the
CPU tests run this kernel under ``TRITON_INTERPRET=1`` against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(t, cos, sin, D: tl.constexpr):
    """Rotate channel pairs (first half, second half) of ``t`` [H, D] by cos/sin [D/2]."""
    lo, hi = tl.split(tl.permute(tl.reshape(t, (t.shape[0], 2, D // 2)), (0, 2, 1)))
    out = tl.join(lo * cos[None, :] - hi * sin[None, :], lo * sin[None, :] + hi * cos[None, :])
    return tl.reshape(tl.permute(out, (0, 2, 1)), (t.shape[0], D))


@triton.jit
def _convs(qkv_row, conv_row, cs_w_ptr, cs_b_ptr, cc_w_ptr, cc_b_ptr, c, live, d,
           C: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, KC: tl.constexpr, ACC: tl.constexpr):
    """Heads' latents ``c`` [H, D] (channel indices; rows where ``live`` is False read nothing and give 0): their
    projections x0, and the two causal convs over the cached history and x0. Returns (conv output, x0)."""
    P: tl.constexpr = KS + KC - 2
    hm = live[:, None]
    x0 = tl.load(qkv_row + c, mask=hm, other=0.0).to(ACC)
    out = tl.load(cc_b_ptr + c, mask=hm, other=0.0).to(ACC)
    for t in tl.static_range(KC):
        # Depthwise conv (KS taps) for the t-th of the KC positions the grouped conv reads: history slot
        # m < P holds the latent P - m routed tokens back, slot P is this token.
        y1 = tl.load(cs_b_ptr + c, mask=hm, other=0.0).to(ACC)
        for j in tl.static_range(KS):
            if t + j < P:
                tap = tl.load(conv_row + (t + j) * C + c, mask=hm, other=0.0).to(ACC)
            else:
                tap = x0
            y1 += tl.load(cs_w_ptr + c * KS + j, mask=hm, other=0.0).to(ACC) * tap
        # The grouped conv, one group per head: weight by tap [KC, C, D (input channel of the group)]; out
        # channel c of head h reads the head's inputs h * D + i.
        w = tl.load(cc_w_ptr + (t * C + c[:, :, None]) * D + d[None, None, :], mask=hm[:, :, None], other=0.0)
        out += tl.sum(w.to(ACC) * y1[:, None, :], axis=2)
    return out, x0


@triton.jit
def _ccgqa_decode_kernel(
    qkv_ptr, cs_w_ptr, cs_b_ptr, cc_w_ptr, cc_b_ptr, temp_ptr, cos_ptr, sin_ptr, pos_ptr, valid_ptr,
    conv_ptr, shift_ptr, k_ptr, v_ptr, slot_ptr, y_ptr,
    L, eps,
    H: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, KS: tl.constexpr,
    KC: tl.constexpr, PP: tl.constexpr, VP: tl.constexpr, QK_MEAN: tl.constexpr, USE_DOT: tl.constexpr,
    QP: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)  # KV head; its query heads are g * G .. g * G + G - 1
    QD: tl.constexpr = H * D
    KVD: tl.constexpr = HK * D
    C: tl.constexpr = QD + KVD  # conv channels: the q latents, then the k latents
    P: tl.constexpr = KS + KC - 2  # cached pre-conv latents
    d = tl.arange(0, D)
    i = tl.arange(0, GP)
    live = i < G
    cq = (g * G + i)[:, None] * D + d[None, :]  # [GP, D]: the group's query heads' channels
    ck = (QD + g * D + d)[None, :]  # [1, D]: its key head's
    pos = tl.load(pos_ptr + b)
    valid = tl.load(valid_ptr + b).to(tl.int1)
    qkv_row = qkv_ptr + b * (QD + 2 * KVD)
    conv_row = conv_ptr + b * P * C

    q, q0 = _convs(qkv_row, conv_row, cs_w_ptr, cs_b_ptr, cc_w_ptr, cc_b_ptr, cq, live, d, C, D, KS, KC, ACC)
    k, k0 = _convs(qkv_row, conv_row, cs_w_ptr, cs_b_ptr, cc_w_ptr, cc_b_ptr, ck, tl.arange(0, 1) < 1, d, C, D, KS,
                   KC, ACC)
    if QK_MEAN:  # q += (q0 + k0 of its group) / 2; k += the mean of that over the group's query heads
        mean_q = tl.where(live[:, None], (q0 + k0) * 0.5, 0.0)
        q += mean_q
        k += tl.sum(mean_q, axis=0)[None, :] / G
    # L2-normalise to norm sqrt(D) (rms_norm), the key times its head's temperature, then RoPE.
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) / D + eps)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) / D + eps)[:, None] * tl.exp(tl.load(temp_ptr + g).to(ACC))
    half = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + pos * (D // 2) + half).to(ACC)
    sin = tl.load(sin_ptr + pos * (D // 2) + half).to(ACC)
    q = _rope(q, cos, sin, D)
    k = tl.reshape(_rope(k, cos, sin, D), (D,))

    # Value shift: value channels from VNOW on are the previous routed token's (the cached shift state).
    VNOW: tl.constexpr = KVD - VP
    vc = g * D + d
    shifted = vc >= VNOW
    v_cur = tl.load(qkv_row + QD + KVD + vc).to(ACC)
    if VP > 0:
        v = tl.where(shifted, tl.load(shift_ptr + b * VP + (vc - VNOW), mask=shifted, other=0.0).to(ACC), v_cur)
    else:
        v = v_cur

    # Softmax attention (scale 1/sqrt(D), SDPA's default) over this token's own slot, from registers, then
    # the row's valid slots before it in BLOCK_L tiles: through tl.dot in the cache's dtype with the query
    # heads padded to QP rows (USE_DOT), else as products and sums in ACC (fp64, or heads under 16 wide).
    scale = tl.rsqrt(tl.zeros((), dtype=ACC) + D)
    kv_row = (b * HK + g).to(tl.int64) * L * D  # a cache of 2**31 values or more overflows int32
    if USE_DOT:
        r = tl.arange(0, QP)
        q = tl.sum(tl.where(r[:, None, None] == i[None, :, None], q[None, :, :], 0.0), axis=1)  # [QP, D]
        q_dot = q.to(k_ptr.dtype.element_ty)
    else:
        r = i
    m_i = tl.sum(q * k[None, :], axis=1) * scale
    l_i = tl.full(m_i.shape, 1.0, dtype=ACC)
    acc = tl.zeros(q.shape, dtype=ACC) + v[None, :]
    for s0 in range(0, pos, BLOCK_L):
        s = s0 + tl.arange(0, BLOCK_L)
        use = (s < pos) & tl.load(slot_ptr + b * L + s, mask=s < pos, other=0).to(tl.int1)
        ks = tl.load(k_ptr + kv_row + s[:, None] * D + d[None, :], mask=use[:, None], other=0.0)
        vs = tl.load(v_ptr + kv_row + s[:, None] * D + d[None, :], mask=use[:, None], other=0.0)
        if USE_DOT:
            scores = tl.dot(q_dot, tl.trans(ks), input_precision="ieee", out_dtype=ACC) * scale
        else:
            scores = tl.sum(q[:, None, :] * ks.to(ACC)[None, :, :], axis=2) * scale
        scores = tl.where(use[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p.to(vs.dtype), vs, input_precision="ieee", out_dtype=ACC)
        else:
            pv = tl.sum(p[:, :, None] * vs.to(ACC)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    heads = (g * G + r)[:, None] * D + d[None, :]
    tl.store(y_ptr + b * QD + heads, (acc / l_i[:, None]).to(y_ptr.dtype.element_ty), mask=(r < G)[:, None])

    # The decode state. A routed-in token shifts the conv history by one slot (each program moves only the
    # channels it alone reads) and replaces the value-shift state; every read of them happened above.
    if valid:
        m = tl.arange(0, PP)[:, None, None]  # history slots, padded to a power of two
        mq = (m < P) & live[None, :, None]
        nq = tl.where(m + 1 < P, tl.load(conv_row + (m + 1) * C + cq[None], mask=mq & (m + 1 < P), other=0.0),
                      q0[None].to(conv_ptr.dtype.element_ty))
        nk = tl.where(m + 1 < P, tl.load(conv_row + (m + 1) * C + ck[None], mask=(m + 1 < P), other=0.0),
                      k0[None].to(conv_ptr.dtype.element_ty))
        tl.debug_barrier()
        tl.store(conv_row + m * C + cq[None], nq, mask=mq)
        tl.store(conv_row + m * C + ck[None], nk, mask=m < P)
        if VP > 0:
            tl.store(shift_ptr + b * VP + (vc - VNOW), v_cur.to(shift_ptr.dtype.element_ty), mask=shifted)
    tl.store(k_ptr + kv_row + pos * D + d, k.to(k_ptr.dtype.element_ty))
    tl.store(v_ptr + kv_row + pos * D + d, v.to(v_ptr.dtype.element_ty))
    if g == 0:  # no program reads the own slot's flag
        tl.store(slot_ptr + b * L + pos, valid.to(slot_ptr.dtype.element_ty))


# An opaque custom op (its fake below gives compiled graphs the output's shape): Dynamo does not trace the launch,
# and the graphs that call it mutate the caches in place (auto-functionalized, then re-inplaced by inductor).
@torch.library.custom_op("hydra_lm::ccgqa_decode", mutates_args=("conv", "shift", "k", "v", "slot_valid"))
def _ccgqa_decode(qkv: torch.Tensor, cs_w: torch.Tensor, cs_b: torch.Tensor, cc_w: torch.Tensor,
                  cc_b: torch.Tensor, temperature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  pos: torch.Tensor, valid: torch.Tensor, conv: torch.Tensor, shift: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, slot_valid: torch.Tensor, n_heads: int, kernel_seq: int, kernel_ch: int,
                  qk_mean: bool, eps: float) -> torch.Tensor:
    b = qkv.shape[0]
    hk, length, d = k.shape[1], k.shape[2], k.shape[3]
    named = dict(conv_seq=cs_w, conv_ch_taps=cc_w, rope_cos=cos, rope_sin=sin, conv_state=conv, shift_state=shift,
                 k_cache=k, v_cache=v, slot_valid=slot_valid)
    strided = [name for name, t in named.items() if not t.is_contiguous()]
    if strided:  # the kernel indexes every tensor as laid out contiguously
        raise ValueError(f"ccgqa_decode: {', '.join(strided)} not contiguous; pass the caches HydraModel.init_cache "
                         "allocates (or .contiguous() copies)")
    y = torch.empty(b, n_heads * d, dtype=k.dtype, device=qkv.device)
    group = n_heads // hk
    # tl.dot takes no fp64 on GPUs, nor operands under 16 wide: heads are at most 256 wide
    # (attention.DECODE_KERNEL_MAX_HEAD_DIM), so a tile holds 32 slots or more. Tiles of 8,192 cached values (256
    # slots of 32-wide heads) in two stages: at the 100M layout's shapes on an H200 the fastest of 64-256 slots, 1-3
    # stages and 2 or 4 warps (benchmarks/BENCHMARKS.md, fortieth session).
    fp64 = k.dtype == torch.float64
    use_dot = not fp64 and d >= 16
    heads = triton.next_power_of_2(group)
    _ccgqa_decode_kernel[(b, hk)](
        qkv, cs_w, cs_b, cc_w, cc_b, temperature, cos, sin, pos, valid, conv, shift, k, v, slot_valid, y,
        length, eps,
        H=n_heads, HK=hk, G=group, GP=heads, D=d, KS=kernel_seq, KC=kernel_ch,
        # One slot at least: convs of one tap keep no history (P = 0), and tl.arange takes no empty range.
        PP=max(1, triton.next_power_of_2(kernel_seq + kernel_ch - 2)), VP=shift.shape[1], QK_MEAN=qk_mean,
        USE_DOT=use_dot, QP=max(16, heads), BLOCK_L=min(256, 8192 // d) if use_dot else 32,
        ACC=tl.float64 if fp64 else tl.float32,
        num_warps=4, num_stages=2)
    return y


@_ccgqa_decode.register_fake
def _(qkv, cs_w, cs_b, cc_w, cc_b, temperature, cos, sin, pos, valid, conv, shift, k, v, slot_valid, n_heads,
      kernel_seq, kernel_ch, qk_mean, eps):
    return k.new_empty(qkv.shape[0], n_heads * k.shape[3])


def ccgqa_decode(attn, x: torch.Tensor, pos: torch.Tensor, rope, cache, valid: torch.Tensor | None) -> torch.Tensor:
    """``attn`` (a CCGQAttention) on one new token per row: x [B, 1, E] (normed), pos [B, 1], ``valid`` [B, 1]
    (None: every row's token is the unit's); updates ``cache`` in place and returns the attention's latent
    output [B, 1, n_heads * head_dim] in the cache's dtype, before the output projection. The grouped conv's
    weight is read by tap, [KC, C, D]: ``attn.conv_ch_taps`` where the decode step laid it out once
    (``decode_step.decode_weights``), else laid out here."""
    b = x.shape[0]
    valid = torch.ones(b, 1, dtype=torch.bool, device=x.device) if valid is None else valid
    taps = getattr(attn, "conv_ch_taps", None)
    taps = attn.conv_ch.weight.permute(2, 0, 1).contiguous() if taps is None else taps
    y = _ccgqa_decode(
        attn.qkv(x).reshape(b, -1).contiguous(), attn.conv_seq.weight, attn.conv_seq.bias, taps, attn.conv_ch.bias,
        attn.temperature, rope.cos, rope.sin, pos.reshape(b).contiguous(), valid.reshape(b).contiguous(),
        cache.conv, cache.shift, cache.k, cache.v, cache.slot_valid,
        attn.n_heads, attn.conv_seq.kernel_size[0], attn.conv_ch.kernel_size[0], attn.qk_mean, attn.eps)
    return y[:, None]
