"""Muon for the hidden matrices and AdamW for everything else, as one ``torch.optim.Optimizer``.

Checkpoints save optimizer state through ``get_optimizer_state_dict``, which maps the state of
one optimizer to parameter names. Holding both parts in one object keeps that path (and FSDP /
DDP resharding on load) unchanged: the groups of both parts are this optimizer's groups, and
both parts share its ``state``, so the ordinary ``state_dict`` / ``load_state_dict`` round-trip
the whole thing.
"""

from __future__ import annotations

from typing import Any

import torch

from .muon import Muon


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], *, lr: float, adamw_lr: float,
                 betas: tuple[float, float], fused: bool):
        # Muon scales each matrix's orthogonalised update to AdamW's typical RMS, so it takes AdamW's
        # learning rate and weight decay. Both parts can be captured in a CUDA graph (a device-tensor LR).
        self._muon = Muon(muon_groups, lr=lr)
        self._adamw = torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=betas, eps=1e-8, fused=fused)
        self._n_muon = len(self._muon.param_groups)
        super().__init__(self._muon.param_groups + self._adamw.param_groups, defaults={})
        self._link()

    def _link(self) -> None:
        """Point both parts at this optimizer's groups and state (``load_state_dict`` replaces both)."""
        self._muon.param_groups = self.param_groups[:self._n_muon]
        self._adamw.param_groups = self.param_groups[self._n_muon:]
        self._muon.state = self._adamw.state = self.state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_muon" in self.__dict__:
            self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        self._adamw.step()
        return loss
