"""The shared-layers API (the seed's ``hydra.layers``): one import point for the building blocks."""

from .model.accounting import compute_memory_footprint
from .model.attention_backend import (FLASH_ATTN_AVAILABLE, XFORMERS_AVAILABLE, flexible_attention,
                                      get_attention_backend, set_attention_backend)
from .model.doc_attention import get_doc_mask_backend, set_doc_mask_backend
from .model.layers import (GradientCheckpointMixin, RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary,
                           get_activation, init_weights_normal, scale_residual_weights)

# The Triton kernels in hydra_lm.kernels are not called by the model's layers yet (a first GPU
# comparison did not show them beating torch.compile's fusion); the layers run on F.rms_norm,
# SDPA and torch.compile.
FUSED_KERNELS_AVAILABLE = False

__all__ = [
    "FLASH_ATTN_AVAILABLE",
    "FUSED_KERNELS_AVAILABLE",
    "XFORMERS_AVAILABLE",
    "GradientCheckpointMixin",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "apply_rotary",
    "compute_memory_footprint",
    "flexible_attention",
    "get_activation",
    "get_attention_backend",
    "get_doc_mask_backend",
    "init_weights_normal",
    "scale_residual_weights",
    "set_attention_backend",
    "set_doc_mask_backend",
]
