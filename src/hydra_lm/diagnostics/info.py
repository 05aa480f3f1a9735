"""``hydra-lm info``: what a preset builds, what it costs per token, and how its attention is laid out."""

from __future__ import annotations

import torch

from ..config import preset_config
from ..model import HydraModel
from ..model.accounting import (count_parameters, dense_flops_per_token, executed_flops_per_token,
                               kv_cache_bytes_per_token, unit_token_counts)


def _m(n: float) -> str:
    return f"{n / 1e6:,.1f}M"


def _per_block(units: list[tuple[str, int, int]]) -> str:
    blocks: dict[str, list[str]] = {}
    for name, _, k in units:
        blocks.setdefault(name.split(".")[0], []).append(str(k))
    return ", ".join(f"{block} {'/'.join(ks)}" for block, ks in blocks.items())


def describe(model_size: str, seq_len: int = 1024, arch: str = "hydra", vocab_size: int | None = None) -> list[str]:
    if seq_len < 1:
        raise ValueError(f"--seq_len {seq_len}: the FLOP count needs a sequence of at least 1 token")
    overrides = {"arch": arch, "max_seq_len": max(seq_len, 2048)}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    cfg = preset_config(model_size, **overrides)
    with torch.device("meta"):
        model = HydraModel(cfg)
    params = count_parameters(model)
    flops = executed_flops_per_token(cfg, seq_len)
    full = dense_flops_per_token(cfg, seq_len)
    cache = kv_cache_bytes_per_token(cfg, seq_len)
    lines = [
        f"preset {cfg.preset} ({cfg.arch}), vocab {cfg.vocab_size}, width {cfg.dim}, MLP hidden {cfg.mlp_hidden}",
        f"parameters: total {_m(params.total)} | non-embedding {_m(params.non_embedding)} | "
        f"embedding {_m(params.embedding)} | effective (shared layers counted per use) {_m(params.effective)}",
    ]
    if cfg.arch == "hydra":
        lines += [
            f"blocks x recursions: {cfg.n_blocks} x {cfg.recursions} ({cfg.sharing} sharing) -> "
            f"{cfg.effective_layers} effective layers",
            f"attention (CCGQA latent): q {cfg.n_heads} heads x {cfg.head_dim} = {cfg.q_latent} "
            f"(dim/{cfg.dim // cfg.q_latent}), "
            f"kv {cfg.n_kv_heads} heads x {cfg.head_dim} = {cfg.kv_latent} (dim/{cfg.dim // cfg.kv_latent}), "
            f"{cfg.n_heads // cfg.n_kv_heads} query heads per kv head; "
            f"convs k_seq={cfg.conv_seq_kernel}, k_ch={cfg.conv_ch_kernel}",
            f"routing: MoD capacity {cfg.mod_capacity if cfg.mod_enabled else 1.0} on every {cfg.mod_every}. block"
            f"{' (the first too)' if cfg.mod_first_block and cfg.mod_every == 1 else ''}, "
            f"MoR {cfg.mor_routing}-choice ({'on' if cfg.mor_enabled else 'off'}, "
            f"{cfg.mor_capacity_schedule} schedule"
            f"{f' keeping {cfg.mor_capacity:g} of each depth' if cfg.mor_capacity_schedule == 'geometric' else ''}), "
            f"gate scale {cfg.mor_gate_scale}",
        ]
    else:
        lines.append(f"layers {cfg.n_layers}, attention GQA {cfg.n_heads}/{cfg.n_kv_heads} heads x {cfg.head_dim}")
    lines += [
        f"training FLOPs per token at seq_len {seq_len}: executed {flops / 1e9:.3f} GFLOP "
        f"(every token through every unit: {full / 1e9:.3f} GFLOP, ratio {full / flops:.2f}x)",
        f"KV cache per token (bf16): {cache['allocated'] / 1024:.1f} KiB allocated, "
        f"{cache['occupied'] / 1024:.1f} KiB at the configured capacities",
        f"tokens per row entering each depth (top-k, of {seq_len}): " + _per_block(unit_token_counts(cfg, seq_len)),
    ]
    return lines


def print_info(model_size: str, seq_len: int = 1024, arch: str = "hydra", vocab_size: int | None = None) -> None:
    print("\n".join(describe(model_size, seq_len, arch, vocab_size)))
