"""Stochastic weight averaging (--swa): an equal-weight running average of the weights over the
last part of the run, kept beside the trained ones and evaluated next to them at the end.

The router threshold buffers are averaged too (``use_buffers``): causal routing reads them, so an
average of the weights with the live model's thresholds would route with a mismatched boundary.
The average is updated on the device after every optimizer step past ``start_step``; nothing
is read back to the host until a checkpoint records how many steps it holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch.optim.swa_utils import AveragedModel

SWA_FILE = "swa.safetensors"


class WeightAverage:
    def __init__(self, model: torch.nn.Module, start_step: int):
        self.start_step = start_step
        self.averaged = AveragedModel(model, use_buffers=True)

    @property
    def module(self) -> torch.nn.Module:
        return self.averaged.module

    @property
    def steps_averaged(self) -> int:
        return int(self.averaged.n_averaged)

    def update(self, model: torch.nn.Module, step: int) -> None:
        """Fold in ``model`` as it is after optimizer step ``step`` (counted from 1)."""
        if step > self.start_step:
            self.averaged.update_parameters(model)

    def save(self, directory: Path) -> None:
        save_model(self.module, str(directory / SWA_FILE), metadata={"format": "hydra-lm-swa"})

    def state_dict(self) -> dict:
        return {"steps_averaged": self.steps_averaged}

    def load(self, directory: Path, state: dict) -> None:
        """Restore the average a checkpoint holds (a checkpoint from before the start holds none; older ones also
        hold a ``start_step``, which the run's config gives)."""
        n = int(state.get("steps_averaged", 0)) if state else 0
        if n:
            load_model(self.module, str(directory / SWA_FILE), strict=False)
        self.averaged.n_averaged.fill_(n)
