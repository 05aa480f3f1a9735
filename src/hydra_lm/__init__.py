"""hydra-lm: HYDRA language models (CCGQA attention, Mixture-of-Depths, Mixture-of-Recursions, MoE)."""

from __future__ import annotations

from .config import PRESETS, HydraConfig, preset_config, preset_names
from .model import HydraModel
from .model.factory import create_ccgqa_mod_mor_model, create_model
from .version import __version__

# Loaded on first use: they pull in the training package, which a plain model import does not need.
_LAZY = {"optimize_for_gpu": "train.optimize", "create_optimized_training_setup": "train.optimize",
         "detect_device_capabilities": "train.optimize"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "HydraConfig",
    "HydraModel",
    "PRESETS",
    "create_ccgqa_mod_mor_model",
    "create_model",
    "create_optimized_training_setup",
    "detect_device_capabilities",
    "optimize_for_gpu",
    "preset_config",
    "preset_names",
]
