"""--experimental_fa3: switch SDPA's flash kernel to FlashAttention-3 where the installed torch
registers it, and say which flash kernels this torch offers either way."""

from __future__ import annotations

import torch
import torch.nn.attention as attention


def enable_fa3(device: torch.device) -> tuple[str, bool]:
    """Activate FA3 if possible; returns one line for the log and whether FA3 is now SDPA's flash kernel."""
    offered = list(getattr(attention, "list_flash_attention_impls", lambda: [])())
    offer = f"this torch {torch.__version__} registers flash kernels {offered or 'none'}"
    if "FA3" not in offered:
        return f"--experimental_fa3: {offer}; FA3 is not among them, SDPA keeps its default kernels", False
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return f"--experimental_fa3: {offer}; FA3 needs a Hopper (sm90+) GPU, this run is on {device}: not used", False
    try:
        attention.activate_flash_attention_impl("FA3")
    except Exception as err:  # the kernel package is missing or does not fit this GPU
        return f"--experimental_fa3: {offer}; activating FA3 failed ({err}): SDPA keeps its default kernels", False
    return f"--experimental_fa3: {offer}; SDPA's flash kernel is now {attention.current_flash_attention_impl()}", True
