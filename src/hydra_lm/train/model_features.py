"""The settings that change a built model (gradient checkpointing, float8 layers, FlashAttention-3) and the check of
the MoE settings against it: one code path for ``hydra-lm train`` and the one-call setup (``optimize``)."""

from __future__ import annotations

import torch

from ..model.hydra import HydraModel
from .attention_kernels import enable_fa3
from .fp8 import FP8_FORMATS, convert_to_fp8
from .moe_training import MOE_SETTINGS, check_moe_options
from .options import TrainConfig

# What apply_model_features reads (off at their defaults)
MODEL_SIDE = ("experimental_fa3", "experimental_fp8", "gradient_checkpointing", *MOE_SETTINGS)


def apply_model_features(model: HydraModel, cfg: TrainConfig, device: torch.device) -> list[str]:
    """Apply ``cfg``'s model-side settings to ``model`` (on ``device``; before it is wrapped or compiled, which
    must see the float8 layers); returns what to log."""
    check_moe_options(cfg, model.config.arch, model.config.moe)
    if model.config.doc_mask_backend == "flex" and device.type != "cuda":
        # torch's FlexAttention has no backward off CUDA: without this, the first backward fails naming no setting
        raise ValueError(f"--model.doc_mask_backend flex trains on CUDA only (FlexAttention has no backward on "
                         f"{device.type}): use --model.doc_mask_backend auto here; a model trained with flex still "
                         "evaluates and generates on the CPU")
    notes = []
    # The packages and SDPA's flash kernel serve attention without document masks only (model/attention_backend.py)
    masked = ("; but with document masks (--document_masking, the default) attention runs PyTorch's masked kernels: "
              "add --no-document_masking for {} to take effect") if cfg.document_masking else ""
    if model.config.attention_backend in ("flash", "xformers") and masked:
        notes.append(f"--model.attention_backend {model.config.attention_backend} serves attention without document "
                     "masks only" + masked.format(model.config.attention_backend))
    if cfg.experimental_fa3:
        note, active = enable_fa3(device)
        notes.append(note + (masked.format("FA3") if active else ""))  # the masks matter only to FA3 in use
    if cfg.experimental_fp8:
        n = convert_to_fp8(model, cfg.fp8_format, device, cfg.fp8_min_tokens, cfg.fp8_recipe)
        notes.append(f"--experimental_fp8: {n} Linear layers of the transformer layers now train in float8 "
                     f"({FP8_FORMATS[cfg.fp8_format]}, {cfg.fp8_recipe} scaling) on calls of at least "
                     f"{cfg.fp8_min_tokens} tokens, bf16 below")
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
        model.checkpoint_every = cfg.checkpoint_every or 1
    return notes
