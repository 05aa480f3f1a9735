"""--experimental_fp8: float8 matmuls for the transformer layers' Linear weights through torchao.

Only the Linear layers inside the routed blocks (attention projections and MLPs) are converted,
and only those whose both dimensions are multiples of 16 (what the float8 GEMM accepts); the
embedding, LM head, routers and MoE experts stay in bf16. Scaling is torchao's dynamic
tensor-wise default. ``--fp8_format e4m3`` casts inputs, weights and output gradients to e4m3;
``e5m2`` keeps e4m3 for the forward operands and gives the output gradients e5m2's wider range.
Needs a CUDA GPU of compute capability 9.0 or newer (Hopper) and torchao (the ``gpu`` extra).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_FORMATS = ("e4m3", "e5m2")
MIN_CAPABILITY = (9, 0)


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


def convert_to_fp8(model: nn.Module, fmt: str, device: torch.device) -> int:
    """Swap the eligible Linear layers for torchao's float8 ones; returns how many were converted."""
    check_fp8_device(device)
    try:
        from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError("--experimental_fp8 needs torchao: pip install 'hydra-lm[gpu]'") from None
    # A routed unit runs on as few tokens as its depth keeps (e.g. one per row): the weight gradient's
    # inner dimension is that token count, and the float8 GEMM needs multiples of 16, so pad it.
    config = Float8LinearConfig(pad_inner_dim=True)
    if fmt == "e5m2":
        try:
            config = Float8LinearConfig(pad_inner_dim=True,
                                        cast_config_grad_output=CastConfig(target_dtype=torch.float8_e5m2))
        except TypeError:
            raise ValueError("--fp8_format e5m2 needs a torchao whose CastConfig takes target_dtype: upgrade "
                             "torchao or use --fp8_format e4m3") from None
    before = sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    return sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules()) - before
