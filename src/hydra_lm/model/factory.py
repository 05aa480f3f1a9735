"""Building a model from a preset name, a ``HydraConfig`` or a dict (re-exported as ``hydra_lm.create_model``)."""

from __future__ import annotations

from typing import Any

from ..config import HydraConfig, preset_config, rederived
from .hydra import HydraModel


def create_model(preset_or_config: str | HydraConfig | dict = "debug", **overrides: Any) -> HydraModel:
    """Build a model from a preset name, a ``HydraConfig`` or a dict of config fields.

    ``overrides`` replace config fields (the derived ones follow, as ``HydraConfig.replace``); an unknown field
    raises ``ValueError``.
    """
    if isinstance(preset_or_config, HydraConfig):
        cfg = preset_or_config.replace(**overrides) if overrides else preset_or_config
    elif isinstance(preset_or_config, dict):
        cfg = HydraConfig.from_dict(rederived(preset_or_config, overrides))
    else:
        cfg = preset_config(preset_or_config, **overrides)
    return HydraModel(cfg)


def create_ccgqa_mod_mor_model(vocab_size: int, dim: int, n_mor_blocks: int, recursions: int, n_heads: int,
                               n_kv_heads: int, compression_factor: int = 4, capacity_ratio: float = 0.75,
                               **kw: Any) -> HydraModel:
    """A constructor with the argument names of the original HYDRA quick start (``n_mor_blocks``,
    ``capacity_ratio``), for code written against it.

    ``n_heads``/``n_kv_heads`` are latent heads: their size is ``dim / (compression_factor * n_heads)``.
    Extra keyword arguments are ``HydraConfig`` fields.
    """
    cfg = HydraConfig(vocab_size=vocab_size, dim=dim, n_blocks=n_mor_blocks, recursions=recursions,
                      n_heads=n_heads, n_kv_heads=n_kv_heads, compression_factor=compression_factor,
                      mod_capacity=capacity_ratio, **kw)
    return HydraModel(cfg)
