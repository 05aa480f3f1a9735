"""Counting: parameters (unique vs effective), FLOPs actually executed per token, KV-cache bytes.

FLOPs follow the tokens each routed unit really processes in top-k training (k fixed per unit), so
MFU computed from them is honest: skipped tokens do no work and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import HydraConfig


@dataclass
class ParamCounts:
    total: int  # unique parameters (tied embeddings counted once)
    embedding: int
    non_embedding: int
    effective: int  # shared layers counted once per application (what a dense model of equal depth holds)


def count_parameters(model) -> ParamCounts:
    total = model.num_parameters()
    embedding = model.embed.weight.numel() * (1 if model.config.tie_embeddings else 2)
    extra = 0
    for block in model.blocks:
        stack = sum(p.numel() for p in block.layers.parameters())
        extra += stack * (block.recursions - 1)
    return ParamCounts(total, embedding, total - embedding, total + extra)


def _layer_linear_params(cfg: HydraConfig) -> int:
    attn = cfg.dim * (cfg.q_latent + 2 * cfg.kv_latent) + cfg.q_latent * cfg.dim
    return attn + 3 * cfg.dim * cfg.mlp_hidden


def _layer_conv_flops(cfg: HydraConfig) -> int:
    if cfg.arch != "hydra":
        return 0
    channels = cfg.q_latent + cfg.kv_latent
    groups = cfg.n_heads + cfg.n_kv_heads
    return 2 * channels * cfg.conv_seq_kernel + 2 * channels * (channels // groups) * cfg.conv_ch_kernel


def unit_token_counts(cfg: HydraConfig, seq_len: int, mor_ramp: float = 1.0) -> list[tuple[str, int, int]]:
    """(unit name, layers in its stack, tokens per row it runs on) for every unit, as the model's default routing
    runs them: top-k, or every token where ``static_routing_mode`` weights all of them by their gates; ``mor_ramp``:
    the curriculum's MoR capacity ramp (``HydraModel.set_curriculum``), which runs more tokens per depth."""
    from .hydra import HydraModel  # the block layout is defined once, by the model

    with torch.device("meta"):  # layout only: no memory for weights
        blocks = HydraModel._build_blocks(cfg)
    units = []
    for block in blocks:
        block.mor_ramp = float(mor_ramp)
        for j, k in enumerate(block.tokens_per_depth(seq_len)):
            units.append((f"{block.name}.depth{j}", len(block.layers), seq_len if cfg.static_routing_mode else k))
    return units


def executed_flops_per_token(cfg: HydraConfig, seq_len: int, training: bool = True, mor_ramp: float = 1.0) -> float:
    """Matmul/conv/attention FLOPs per input token actually executed (x3 for a training step), at the MoR
    capacity ramp ``mor_ramp`` (``unit_token_counts``)."""
    per_row = 0.0
    linear = 2 * _layer_linear_params(cfg) + _layer_conv_flops(cfg)
    attn_width = cfg.n_heads * cfg.head_dim
    for _, n_layers, k in unit_token_counts(cfg, seq_len, mor_ramp):
        mean_context = (k + 1) / 2  # causal: query i sees i+1 keys among the k routed tokens
        per_row += n_layers * k * (linear + 4 * attn_width * mean_context + 2 * cfg.dim)  # + router
    per_token = per_row / seq_len + 2 * cfg.dim * cfg.vocab_size
    if cfg.moe:
        per_layer = cfg.moe_top_k * 6 * cfg.dim * cfg.moe_hidden + 2 * cfg.dim * cfg.moe_num_experts
        per_token += cfg.moe_num_layers * per_layer
    return per_token * (3 if training else 1)


def curriculum_flops_per_token(cfg: HydraConfig, seq_len: int, mod_active: bool, mor_active: bool,
                               mor_ramp: float = 1.0) -> float:
    """Executed training FLOPs/token while the routing curriculum (``train.curriculum``) has MoD / MoR switched
    on or off and the MoR capacities at ``mor_ramp``."""
    live = cfg.replace(mod_enabled=cfg.mod_enabled and mod_active, mor_enabled=cfg.mor_enabled and mor_active)
    return executed_flops_per_token(live, seq_len, training=True, mor_ramp=mor_ramp)  # MoR off: the ramp moves nothing


def flops_per_token_in_phase(cfg: HydraConfig, seq_len: int, mod_active: bool, mor_active: bool,
                             mor_ramp: float = 1.0, cache: dict | None = None) -> float:
    """``curriculum_flops_per_token``, memoised in ``cache`` by routing state (it lays out the model's blocks, ~25 ms
    for the 100M preset): the trainer's MFU at every log step and compare's FLOP budgets ask for few states often."""
    key = (mod_active, mor_active, mor_ramp if mor_active else 1.0)
    if cache is not None and key in cache:
        return cache[key]
    value = curriculum_flops_per_token(cfg, seq_len, *key)
    if cache is not None:
        cache[key] = value
    return value


def dense_flops_per_token(cfg: HydraConfig, seq_len: int, training: bool = True) -> float:
    """What the same units would cost if every token ran every unit (no routing)."""
    full = cfg.replace(mod_enabled=False, mor_enabled=False)
    return executed_flops_per_token(full, seq_len, training)


def kv_cache_bytes_per_token(cfg: HydraConfig, seq_len: int, bytes_per_value: int = 2) -> dict[str, float]:
    """Latent K/V bytes per cached position: ``allocated`` (a slot per unit and position, as
    ``HydraModel.init_cache`` does) and ``occupied`` (only positions routed into each unit)."""
    per_layer = 2 * cfg.kv_latent * bytes_per_value
    allocated = occupied = 0.0
    for _, n_layers, k in unit_token_counts(cfg, seq_len):
        allocated += n_layers * per_layer
        occupied += n_layers * per_layer * k / seq_len
    return {"allocated": allocated, "occupied": occupied}
