"""Triton kernels for what torch.compile cannot fuse, each with a PyTorch reference it is tested against (on a
CPU under ``TRITON_INTERPRET=1``). Imported only where a kernel runs: Triton is optional on CPU machines."""
