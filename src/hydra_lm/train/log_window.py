"""The training log's window: what accumulates on the device between two metrics records."""

from __future__ import annotations

import time
from typing import Any

import torch

from .moe_training import expert_load_record


class LogWindow:
    """Sums of (loss, ce, aux, ponder, moe, grad norm) over the window's kept steps and their count, the last
    step's routing statistics and learning rate, and the MoE expert load; read back once per record (``means``).
    A step the batch filter skipped changed nothing, so it feeds neither the sums nor their count."""

    def __init__(self, device: torch.device, saved: dict | None = None):
        self.t0 = self.opened = time.perf_counter()
        self.steps = 0  # with those of the interrupted window a resumed run continues
        self.timed_steps = 0  # steps since t0: throughput counts training steps only
        self.opened_steps = 0  # steps since the window opened (in this process)
        self.sums = torch.zeros(7, device=device)  # the six sums, then the count of kept steps (a device tensor)
        self.kept = 0.0  # that count as read by the last ``means``
        self.stats: torch.Tensor | None = None
        self.lr = 0.0
        self.moe_load: torch.Tensor | None = None
        self.moe_steps = 0
        if saved is not None:  # a resumed run continues the interrupted window
            self.steps = int(saved["steps"])
            sums = list(saved["sums"])  # windows saved before the kept count kept every step
            self.sums = torch.tensor(sums if len(sums) == 7 else [*sums, self.steps], device=device)
            if saved.get("moe_load") is not None:
                self.moe_load = torch.tensor(saved["moe_load"], device=device)
                self.moe_steps = int(saved["moe_steps"])

    def add(self, parts: torch.Tensor, grad_norm: torch.Tensor, stats: torch.Tensor, lr: float,
            keep: torch.Tensor | None = None) -> None:
        """``keep``: the batch filter's device flag (0.0: a skipped step, left out without a host sync)."""
        step = torch.cat([parts, grad_norm.detach().float().reshape(1), parts.new_ones(1)])
        if keep is not None:  # a where, not a product: a skipped NaN batch times 0 stays NaN
            step = torch.where(keep > 0, step, 0.0)
        self.sums += step
        self.stats = stats
        self.steps += 1
        self.timed_steps += 1
        self.opened_steps += 1
        self.lr = lr

    def add_moe_load(self, load: torch.Tensor) -> None:
        """The last micro-batch's expert shares, summed over the window."""
        self.moe_load = load.clone() if self.moe_load is None else self.moe_load + load  # a step's buffer
        self.moe_steps += 1

    def restart_timer(self, t0: float) -> None:
        self.t0, self.timed_steps = t0, 0

    def means(self) -> list[float]:
        """The six means over the kept steps (NaN, logged as null, when the filter skipped every one)."""
        *sums, self.kept = self.sums.tolist()  # the one host sync per log interval
        return [s / self.kept if self.kept else float("nan") for s in sums]

    def state(self) -> dict | None:
        """What a checkpoint keeps of the window (None: nothing to continue)."""
        if self.steps == 0:
            return None
        moe = {} if self.moe_load is None else {"moe_load": self.moe_load.tolist(), "moe_steps": self.moe_steps}
        return {"sums": self.sums.tolist(), "steps": self.steps, **moe}

    def record(self, step: int, tokens_per_step: int, run: dict[str, Any], router_names: list[str],
               moe_names: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """(a "train" metrics record: the window's means, then ``run``'s fields, then routing and MoE
        load; MoE starvation warnings by expert)."""
        loss, ce, aux, ponder, moe, gnorm = self.means()
        now = time.perf_counter()
        # A window of start-up steps alone (compiling, capturing) has no training time: their own rate, start-up in.
        steps, elapsed = (self.timed_steps, now - self.t0) if self.timed_steps else \
            (self.opened_steps, now - self.opened)
        record: dict[str, Any] = {
            "kind": "train", "step": step, "loss": loss, "ce_loss": ce, "aux_loss": aux, "ponder_loss": ponder,
            "moe_loss": moe, "lr": self.lr, "grad_norm": gnorm,
            "tokens_per_s": steps * tokens_per_step / max(elapsed, 1e-9), **run,
        }
        if self.stats is not None and self.stats.numel():
            fracs = self.stats[:, 0].tolist()
            record["routing_exec_frac"] = dict(zip(router_names, fracs))
            record["exec_frac_mean"] = sum(fracs) / len(fracs)
        warnings: dict[str, str] = {}
        if self.moe_load is not None:
            record["moe_expert_load"], warnings = expert_load_record(self.moe_load / self.moe_steps, moe_names)
        return record, warnings
