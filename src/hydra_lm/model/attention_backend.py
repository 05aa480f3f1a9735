"""Which kernel computes softmax attention: PyTorch SDPA (default; picks flash / cuDNN / efficient /
math itself), the FlashAttention package, or xFormers, chosen per model by ``HydraConfig.attention_backend``.
The choice serves attention without document masks (a run's ``--no-document_masking``, generation): attention
within documents runs model/doc_attention.py's masked kernels whatever it is (the trainer's log says so).

The packages are optional and imported lazily; a model asking for one that is missing fails on its
first CUDA forward with an error that says what to install, never a silent fallback. The check waits
for a CUDA call so that such a model still loads (and runs on SDPA) on a machine without the package.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS

FLASH_ATTN_AVAILABLE = importlib.util.find_spec("flash_attn") is not None
XFORMERS_AVAILABLE = importlib.util.find_spec("xformers") is not None
_PACKAGES = {"flash": ("flash-attn", FLASH_ATTN_AVAILABLE), "xformers": ("xformers", XFORMERS_AVAILABLE)}


def check_attention_backend(backend: str, device: torch.device | str) -> None:
    """A ValueError where ``HydraConfig.attention_backend`` ``backend`` cannot run on ``device``: a package's
    backend on CUDA without the package (elsewhere SDPA serves every backend)."""
    if torch.device(device).type == "cuda" and backend in _PACKAGES and not _PACKAGES[backend][1]:
        package = _PACKAGES[backend][0]
        raise ValueError(f"HydraConfig.attention_backend={backend!r} needs the {package} package: pip install "
                         f"{package}, or set attention_backend='auto' (--model.attention_backend auto)")


def flexible_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Causal attention over [B, H, N, D] tensors; k/v may have fewer heads (grouped-query attention).
    ``backend``: ``HydraConfig.attention_backend``; the packages serve CUDA calls, SDPA the rest."""
    gqa = q.shape[1] != k.shape[1]
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: choose one of {list(ATTENTION_BACKENDS)}")
    if not q.is_cuda or backend in ("auto", "sdpa"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    check_attention_backend(backend, q.device)
    if backend == "flash":
        from flash_attn import flash_attn_func  # takes [B, N, H, D] and handles GQA itself

        return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    import xformers.ops as xops

    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_bias=xops.LowerTriangularMask())
    return out.transpose(1, 2)


SDPA_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")


def sdpa_kernel_only(name: str):
    """A context in which SDPA may use only one kernel ("auto": SDPA's own choice), to compare them; the document
    mask's direct cuDNN call (doc_attention) runs only where that kernel is cuDNN's. Wrap the first (compiling)
    call too: a compiled graph keeps the kernel chosen at trace time."""
    if name not in SDPA_KERNELS:
        raise ValueError(f"SDPA kernel {name!r}: choose one of {list(SDPA_KERNELS)}")
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    return _only(sdpa_kernel([backend]), name == "cudnn")


@contextlib.contextmanager
def _only(restriction, cudnn: bool):
    """SDPA's kernel restriction, and the document mask's direct cuDNN call (doc_attention) allowed with cuDNN only."""
    from . import doc_attention

    allowed = doc_attention.cudnn_causal_bias_allowed
    doc_attention.cudnn_causal_bias_allowed = cudnn  # as SDPA's, an inner restriction replaces an outer one
    try:
        with restriction:
            yield
    finally:
        doc_attention.cudnn_causal_bias_allowed = allowed
