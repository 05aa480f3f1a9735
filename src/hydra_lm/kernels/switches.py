"""Which path every fused op takes: the global switch, per-kernel flags, environment, status.

Nothing here imports triton at module import: importing ``hydra_lm`` must stay cheap, and the
Triton interpreter only works when ``TRITON_INTERPRET=1`` is set before the first ``import
triton`` (triton builds ``tl.sum`` and friends at that moment). Triton is loaded by
``set_use_triton_kernels(True)``, so that no forward pass ever pays for (or traces) an import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import types
import warnings
from dataclasses import dataclass, field

import torch
from ..env import env_flag

# Per-kernel flags; each one is HYDRA_{ENABLE,DISABLE}_FUSED_<NAME in upper case> in the environment.
KERNELS = ("rms_norm", "rms_norm_bwd", "swiglu", "swiglu_bwd", "qk_norm", "qk_norm_bwd", "rope",
           "qk_norm_rope", "routing")

# float64 is accepted so that gradcheck can run through the kernels themselves.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)





def env_var_names(kernel: str) -> tuple[str, str]:
    """(enable, disable) environment variable names of one kernel flag."""
    return f"HYDRA_ENABLE_FUSED_{kernel.upper()}", f"HYDRA_DISABLE_FUSED_{kernel.upper()}"


@dataclass
class _State:
    requested: bool = False  # set_use_triton_kernels(); off until a GPU benchmark says otherwise
    env_disabled: bool = False  # HYDRA_DISABLE_TRITON
    interpret_env: bool = False  # TRITON_INTERPRET as read by refresh_from_env()
    flags: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(KERNELS, True))
    loaded: bool = False
    interpreter: bool = False  # the loaded triton runs kernels in its interpreter
    load_error: str | None = None
    active: bool = False  # requested and not env_disabled and loaded


STATE = _State()
# The Triton launchers, once loaded: TK.norms, TK.swiglu, TK.rope, TK.routing (modules).
TK: types.SimpleNamespace | None = None


def _update_active() -> None:
    STATE.active = STATE.requested and not STATE.env_disabled and STATE.loaded


def refresh_from_env() -> dict[str, bool]:
    """Read the HYDRA_* switches (and TRITON_INTERPRET) again; returns the per-kernel flags.

    A DISABLE variable wins over its ENABLE twin; ENABLE defaults to on, so only ``=0`` matters.
    """
    STATE.env_disabled = env_flag("HYDRA_DISABLE_TRITON", False)
    STATE.interpret_env = env_flag("TRITON_INTERPRET", False)
    for name in KERNELS:
        enable, disable = env_var_names(name)
        STATE.flags[name] = env_flag(enable, True) and not env_flag(disable, False)
    _update_active()
    return dict(STATE.flags)


def triton_available() -> bool:
    return STATE.loaded or importlib.util.find_spec("triton") is not None


def triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def load_triton() -> bool:
    """Import triton and the kernel modules once; False (with the reason kept) when that fails."""
    global TK
    if STATE.loaded or STATE.load_error is not None:
        return STATE.loaded
    try:
        from . import launch, triton_norms, triton_rope, triton_routing, triton_swiglu
    except Exception as exc:  # ImportError, or a triton too old for the language features we use
        STATE.load_error = f"{type(exc).__name__}: {exc}"
        return False
    TK = types.SimpleNamespace(norms=triton_norms, swiglu=triton_swiglu, rope=triton_rope, routing=triton_routing)
    STATE.interpreter = launch.interpreted()
    STATE.loaded = True
    return True


def set_use_triton_kernels(enabled: bool) -> bool:
    """Turn the Triton path on or off for every op; returns whether it is now really active."""
    STATE.requested = bool(enabled)
    if STATE.requested:
        if STATE.env_disabled:
            warnings.warn("HYDRA_DISABLE_TRITON is set: Triton kernels stay off", stacklevel=2)
        elif not load_triton():
            warnings.warn(f"Triton kernels unavailable ({STATE.load_error}); using PyTorch", stacklevel=2)
    _update_active()
    return STATE.active


def set_kernel_enabled(name: str, enabled: bool) -> None:
    """Switch one kernel flag from code (the environment only sets the starting value)."""
    if name not in STATE.flags:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    STATE.flags[name] = bool(enabled)


def kernel_enabled(name: str) -> bool:
    return STATE.active and STATE.flags[name]


def use_kernel(name: str, *tensors: torch.Tensor | None) -> bool:
    """True when op ``name`` should take the Triton path for these tensors.

    Compiled Triton needs CUDA tensors; the interpreter runs on CPU tensors as well.
    """
    if not (STATE.active and STATE.flags[name]):
        return False
    for t in tensors:
        if t is None:
            continue
        if not (t.is_cuda or STATE.interpreter):
            return False
        if t.is_floating_point() and t.dtype not in SUPPORTED_DTYPES:
            return False
    return True


def get_kernel_status() -> dict:
    """Where each op goes and why: availability, the global switch, flags, interpreter mode."""
    return {
        "triton_available": triton_available(),
        "triton_version": triton_version(),
        "triton_loaded": STATE.loaded,
        "triton_load_error": STATE.load_error,
        "use_triton_kernels": STATE.requested,
        "disabled_by_env": STATE.env_disabled,
        "active": STATE.active,
        # Before triton is loaded only the variable is known; afterwards, what triton really does.
        "interpreter": STATE.interpreter if STATE.loaded else STATE.interpret_env,
        "cuda_available": torch.cuda.is_available(),
        "kernels": {name: kernel_enabled(name) for name in KERNELS},
        "flags": dict(STATE.flags),
    }


refresh_from_env()
