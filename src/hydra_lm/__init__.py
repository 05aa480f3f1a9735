"""hydra-lm: HYDRA language models (CCGQA attention, Mixture-of-Depths, Mixture-of-Recursions, MoE)."""

from __future__ import annotations

from .config import PRESETS, HydraConfig, preset_config, preset_names
from .model import HydraModel
from .model.factory import create_ccgqa_mod_mor_model, create_model
from .version import __version__

__all__ = [
    "__version__",
    "HydraConfig",
    "HydraModel",
    "PRESETS",
    "create_ccgqa_mod_mor_model",
    "create_model",
    "preset_config",
    "preset_names",
]
