"""HYDRA model components."""

from .hydra import HydraModel

__all__ = ["HydraModel"]
