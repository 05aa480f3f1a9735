"""--experimental_fp8: float8 matmuls for the transformer layers' Linear weights through torchao.

Only the Linear layers inside the routed blocks (attention projections and MLPs) are converted,
and only those whose both dimensions are multiples of 16 (what the float8 GEMM accepts); the
embedding, LM head, routers and MoE experts stay in bf16. ``--fp8_recipe`` picks torchao's dynamic
scaling. The default, ``rowwise_with_gw_hp`` (a scale per row of each operand, e4m3 operands and output
gradients, the weight gradient's GEMM in bf16), is the one measured faster than bf16: on the 1B preset's
unit at the whole batch (16,384 tokens, H200) 7.37 ms against bf16's 8.10, where ``tensorwise`` took
8.77 and ``rowwise`` 10.50, and 1.04x bf16's tokens/s in the trainer (benchmarks/BENCHMARKS.md,
twenty-ninth session). ``tensorwise`` (one scale per tensor) takes ``--fp8_format e5m2`` (e4m3
forward, e5m2 output gradients: torchao's default, and every FP8 number before the twenty-ninth
session) or ``e4m3``; the row-wise recipes cast everything to e4m3, so they take ``e4m3`` only.
Needs a CUDA GPU of compute capability 9.0 or newer (Hopper) and torchao (the ``gpu`` extra).

A converted layer runs a call in float8 only when the call brings at least ``--fp8_min_tokens`` tokens,
and in bf16 otherwise. A routed block's weights serve all its depths: the first sees the whole batch,
the deeper ones (and MoD's) a few tokens per row, where casting the whole weight to float8 (and its
transpose in the backward) on every call costs more than the faster GEMM saves (with the default
recipe the 1B unit breaks even between 2,048 and 8,192 tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

# torchao's scaling recipes (Float8LinearConfig.from_recipe_name), the first the default
FP8_RECIPES = ("rowwise_with_gw_hp", "tensorwise", "rowwise")
# --fp8_format -> what it casts to what, as the trainer logs it
FP8_FORMATS = {"e5m2": "e4m3 forward, e5m2 output gradients", "e4m3": "e4m3 forward and output gradients"}
MIN_CAPABILITY = (9, 0)


def check_fp8_setting(fmt: str, recipe: str) -> None:
    """Refuse an unknown format or recipe, or a row-wise recipe (whose GEMMs take e4m3 operands) with e5m2."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"--fp8_format {fmt!r}: choose one of {', '.join(FP8_FORMATS)}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"--fp8_recipe {recipe!r}: choose one of {', '.join(FP8_RECIPES)}")
    if recipe != "tensorwise" and fmt != "e4m3":
        raise ValueError(f"--fp8_recipe {recipe} casts the output gradients to e4m3 (torchao's recipe): drop "
                         f"--fp8_format {fmt}, or add --fp8_recipe tensorwise for {fmt} gradients")


def check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"--experimental_fp8 needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.0+ (Hopper); "
                         f"this run is on {device}: drop --experimental_fp8")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"--experimental_fp8 needs compute capability {MIN_CAPABILITY[0]}.0+ (Hopper); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: drop "
                         "--experimental_fp8")


def convertible(module: nn.Module, fqn: str) -> bool:
    """A Linear of a transformer layer (not a router) whose dimensions the float8 GEMM accepts."""
    return (isinstance(module, nn.Linear) and fqn.startswith("blocks.") and ".layers." in fqn
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


@functools.cache
def token_gated_float8_linear() -> type:
    """torchao's ``Float8Linear`` with a per-call size gate (a class made on first use: torchao is optional)."""
    from torchao.float8.float8_linear import Float8Linear

    class TokenGatedFloat8Linear(Float8Linear):
        """A call on fewer than ``min_tokens`` tokens runs the plain bf16 matmul on the same weight. The
        gate reads only shapes, so a compiled unit (dynamic token count) specialises once per side."""

        min_tokens: int = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.numel() < self.min_tokens * x.shape[-1]:
                return F.linear(x, self.weight, self.bias)
            return super().forward(x)

    return TokenGatedFloat8Linear


def convert_to_fp8(model: nn.Module, fmt: str, device: torch.device, min_tokens: int = 0,
                   recipe: str = FP8_RECIPES[0]) -> int:
    """Swap the eligible Linear layers for torchao's float8 ones, each running in float8 only the calls on
    at least ``min_tokens`` tokens; returns how many were converted. ``recipe``: torchao's scaling recipe
    (``FP8_RECIPES``); the row-wise ones cast the output gradients to e4m3, so they need ``fmt`` e4m3."""
    check_fp8_device(device)
    try:
        from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        raise ValueError("--experimental_fp8 needs torchao: pip install 'hydra-lm[gpu]'") from None
    check_fp8_setting(fmt, recipe)
    grad_dtype = torch.float8_e5m2 if fmt == "e5m2" else torch.float8_e4m3fn
    # A routed unit runs on as few tokens as its depth keeps (e.g. one per row): the weight gradient's
    # inner dimension is that token count, and the float8 GEMM needs multiples of 16, so pad it. The
    # gradients' dtype is set, not left to torchao's default (e5m2), so that each format is what it says.
    try:
        if recipe == "tensorwise":
            config = Float8LinearConfig(pad_inner_dim=True,
                                        cast_config_grad_output=CastConfig(target_dtype=grad_dtype))
        else:
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    except TypeError:
        raise ValueError("--experimental_fp8 needs a torchao whose CastConfig takes target_dtype (0.10 or newer): "
                         "upgrade torchao") from None
    convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    # The gate subclasses Float8Linear without state of its own, so the converted modules take its class
    # (torchao's conversion applies its own compiler patches; building the modules ourselves would skip them).
    gated, n = token_gated_float8_linear(), 0
    for m in model.modules():
        if type(m) is Float8Linear:
            m.__class__, m.min_tokens = gated, int(min_tokens)
            n += 1
    return n
