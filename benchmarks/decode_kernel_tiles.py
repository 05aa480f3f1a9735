"""The CCGQA decode kernel (``hydra_lm/kernels/ccgqa_decode.py``) alone, at one layer's shapes, over its attention
loop's tile (cached slots a tile), software-pipelining stages and warps: 50 launches captured in a CUDA graph,
replayed 20 times, in us a call (needs CUDA). The defaults are the 100M preset's layer (width 768, 6 query and 2
KV heads of 32), a bf16 cache of 1,024 slots.

    python benchmarks/decode_kernel_tiles.py [--batches 1,32] [--slots 200,1000]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton
import triton.language as tl
from graph_timing import us_per_call  # this folder's helper (the script's folder is on sys.path)

from hydra_lm.kernels.ccgqa_decode import _ccgqa_decode_kernel
from hydra_lm.model.attention import CCGQAttention
from hydra_lm.model.layers import RotaryEmbedding


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--length", type=int, default=1024, help="cache slots")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--slots", default="200,1000", help="cached slots before the token")
    p.add_argument("--tiles", default="64,128,256")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--warps", default="2,4")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    attn = CCGQAttention(args.dim, args.heads, args.kv_heads, args.head_dim).to(device)
    rope = RotaryEmbedding(args.head_dim, 2 * args.length).to(device)
    taps = attn.conv_ch.weight.permute(2, 0, 1).contiguous()  # as decode_step.decode_weights lays it out
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    ks, kc = attn.conv_seq.kernel_size[0], attn.conv_ch.kernel_size[0]
    rows = []
    for batch, slots in itertools.product(map(int, args.batches.split(",")), map(int, args.slots.split(","))):
        cache = attn.new_cache(batch, args.length, device, torch.bfloat16)
        for t in (cache.k, cache.v, cache.conv, cache.shift):
            t.normal_()
        cache.slot_valid[:, :slots] = True
        qkv = torch.randn(batch, attn.qkv.out_features, device=device, dtype=torch.bfloat16)
        pos = torch.full((batch,), slots, device=device, dtype=torch.long)
        valid = torch.ones(batch, dtype=torch.bool, device=device)
        y = torch.empty(batch, h * d, device=device, dtype=torch.bfloat16)
        for tile, stages, warps in itertools.product(*(map(int, s.split(",")) for s in (args.tiles, args.stages,
                                                                                         args.warps))):
            launch = functools.partial(
                _ccgqa_decode_kernel[(batch, hk)], qkv, attn.conv_seq.weight, attn.conv_seq.bias, taps,
                attn.conv_ch.bias, attn.temperature, rope.cos, rope.sin, pos, valid, cache.conv, cache.shift, cache.k,
                cache.v, cache.slot_valid, y, args.length, attn.eps, H=h, HK=hk, G=h // hk,
                GP=triton.next_power_of_2(h // hk), D=d, KS=ks, KC=kc, PP=triton.next_power_of_2(ks + kc - 2),
                VP=cache.shift.shape[1], QK_MEAN=attn.qk_mean, USE_DOT=True,
                QP=max(16, triton.next_power_of_2(h // hk)), BLOCK_L=tile, ACC=tl.float32, num_warps=warps,
                num_stages=stages)
            us = us_per_call(launch, calls=50, replays=20, warmup=1)
            rows.append(dict(batch=batch, slots=slots, tile=tile, stages=stages, warps=warps, us=us))
            print(f"batch {batch:4d}, {slots:5d} slots: tile {tile:4d}, {stages} stages, {warps} warps: {us:7.2f} us",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
