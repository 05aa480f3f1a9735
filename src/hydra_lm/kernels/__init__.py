"""Triton kernels for what torch.compile cannot fuse, each with a PyTorch reference it is tested against (on a
CPU under ``TRITON_INTERPRET=1``). Imported only where a kernel runs: Triton is optional on CPU machines."""

import importlib.util

# Whether Triton is installed (checked without importing it): the kernels' callers fall back to PyTorch without it.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
