"""The MoD / MoR routing curriculum.

By default every router is on from the first step: a dense start spends the most expensive
steps of a run at full depth, and at equal training time it ended clearly worse. A run may still
start dense (routers that start on a random network route on noise) and switch routing on in
phases, all measured in optimizer steps of the whole run (``max_steps``):

* MoD is off until ``mod_enable_pct``. From there it switches on as soon as the CE-loss EMA is
  below ``mod_loss_gate`` (5.0), and at ``mod_force_enable_pct`` (default: ``mod_enable_pct``) whatever the loss.
* MoR runs every token at full depth until ``mor_enable_pct``, then routes (adaptive depth).
* Once on, a router stays on; ``--mod_off`` / ``--mor_off`` keep one off for the whole run (a resume that gives
  one after that router's switch is refused: ``run.check_routing_kept``).

The loss EMA is updated on the device every step and read only at log steps (where the loop
synchronises anyway), so the gate is checked every ``log_every`` steps.

Short runs (``max_steps`` < SHORT_RUN_STEPS): the EMA of a short run is still dominated by its first
steps when the gate opens, so whether MoD switches at ``mod_enable_pct`` or at the force step would
depend on noise. By default such runs skip the gate and switch MoD on exactly at the force step
(``mod_force_enable_pct``, which is ``mod_enable_pct`` unless given: MoD may switch on from the one and does at
the other); ``--no_short_run_override`` keeps the gate as in a long run. The phase fractions are never changed.

With ``--mor_ramp`` MoR does not jump from full depth to its configured capacities: over the
next ``mor_ramp_pct`` of the run the capacities move there in MOR_RAMP_LEVELS steps (1/4, 2/4
and 3/4 of the way, each for a third of the span, then all of the way at its end), so a compiled
model sees a few fixed shapes rather than a new one every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import SHORT_RUN_STEPS, TrainConfig

MOR_RAMP_LEVELS = 4


def mod_force_pct(cfg: TrainConfig) -> float:
    """The fraction at which MoD switches on whatever the loss (None, the default: at ``mod_enable_pct``)."""
    return cfg.mod_enable_pct if cfg.mod_force_enable_pct is None else cfg.mod_force_enable_pct


@dataclass(frozen=True)
class CurriculumPlan:
    mod_gate_step: int | None  # None: MoD never on
    mod_force_step: int | None
    mor_step: int | None  # None: MoR never on
    loss_gate: float | None  # None: no loss gate (MoD on at mod_gate_step)
    mor_ramp_end: int | None = None  # None: MoR at its configured capacities as soon as it is on

    @classmethod
    def from_config(cls, cfg: TrainConfig, routable: tuple[bool, bool] = (True, True)) -> "CurriculumPlan":
        steps = cfg.max_steps
        has_mod, has_mor = routable
        short = steps < SHORT_RUN_STEPS and not cfg.no_short_run_override
        mod_on = has_mod and not cfg.mod_off
        mor_on = has_mor and not cfg.mor_off
        force_step = round(mod_force_pct(cfg) * steps)
        return cls(
            # A short run without the gate switches at the force step: the help promises MoD off until then.
            mod_gate_step=(force_step if short else round(cfg.mod_enable_pct * steps)) if mod_on else None,
            mod_force_step=force_step if mod_on else None,
            mor_step=round(cfg.mor_enable_pct * steps) if mor_on else None,
            loss_gate=None if short else cfg.mod_loss_gate,
            mor_ramp_end=round((cfg.mor_enable_pct + cfg.mor_ramp_pct) * steps) if mor_on and cfg.mor_ramp else None,
        )

    def describe(self) -> str:
        if self.mod_gate_step is None:
            mod = "MoD off"
        elif self.loss_gate is None or self.mod_force_step == self.mod_gate_step:
            mod = f"MoD on at step {self.mod_gate_step}"
        else:
            mod = (f"MoD on from step {self.mod_gate_step} once CE EMA < {self.loss_gate:g}, forced at step "
                   f"{self.mod_force_step}")
        mor = "MoR off" if self.mor_step is None else f"MoR on at step {self.mor_step}"
        if self.mor_step is not None and self.mor_ramp_end is not None:
            mor += f", capacity ramped in {MOR_RAMP_LEVELS} levels until step {self.mor_ramp_end}"
        return f"{mod}; {mor}"

    def ramp_level(self, step: int) -> float:
        """Quantised MoR ramp at ``step`` (MoR on): k / MOR_RAMP_LEVELS in the k-th of the span's
        MOR_RAMP_LEVELS - 1 equal parts, 1 from its end on."""
        if self.mor_ramp_end is None or self.mor_step is None or step >= self.mor_ramp_end:
            return 1.0
        # In integers: the level changes exactly at the steps ``ramp_steps`` gives.
        part = (step - self.mor_step) * (MOR_RAMP_LEVELS - 1) // self._ramp_span()
        return (part + 1) / MOR_RAMP_LEVELS

    def ramp_steps(self) -> list[int]:
        """The steps at which the MoR ramp moves to its next level (its end included); empty without a ramp."""
        if self.mor_ramp_end is None or self.mor_step is None:
            return []
        span = self._ramp_span()
        # The first step of part k: the least s with (s - mor_step) * (LEVELS - 1) >= k * span.
        return [self.mor_step - (-k * span // (MOR_RAMP_LEVELS - 1)) for k in range(1, MOR_RAMP_LEVELS - 1)] + \
            [self.mor_ramp_end]

    def _ramp_span(self) -> int:
        return max(1, self.mor_ramp_end - self.mor_step)


class Curriculum:
    def __init__(self, plan: CurriculumPlan, ema_beta: float = 0.98):
        self.plan = plan
        self.ema_beta = ema_beta
        self.mod_active = False
        self.mor_active = False
        self.gate_open = False
        self._ema: torch.Tensor | None = None  # biased EMA of the CE loss, on the training device
        self._ema_weight: torch.Tensor | None = None  # its bias: the EMA of 1 over the same (finite) steps
        self._applied: tuple[bool, bool, float] | None = None
        self._loaded: tuple[bool, bool, float] | None = None  # a resumed checkpoint's routing, until the first apply
        self.mor_ramp = 1.0

    # ------------------------------------------------------------------ per step
    def decide(self, step: int) -> tuple[bool, bool, float]:
        """The routing (mod_active, mor_active, mor_ramp) for the step with 0-based index ``step``."""
        p = self.plan
        if not self.mod_active and p.mod_gate_step is not None:
            if step >= p.mod_force_step or (step >= p.mod_gate_step and (p.loss_gate is None or self.gate_open)):
                self.mod_active = True
        if not self.mor_active and p.mor_step is not None and step >= p.mor_step:
            self.mor_active = True
        self.mor_ramp = p.ramp_level(step) if self.mor_active else 1.0
        return self.mod_active, self.mor_active, self.mor_ramp

    def apply(self, step: int, model) -> str | None:
        """Decide the routing for the step with 0-based index ``step``; returns a message on a switch."""
        p = self.plan
        state = self.decide(step)
        if state == self._applied:
            return None
        previous = self._applied
        model.set_curriculum(mod_active=self.mod_active, mor_active=self.mor_active, mor_ramp=self.mor_ramp)
        self._applied = state
        if previous is None:  # a resume's first step: a switch is one against the checkpoint's routing
            previous, self._loaded = self._loaded, None
            if previous is None or previous == state:
                return None
        on = {True: "on", False: "off"}
        ramp = f" (capacity ramp {self.mor_ramp:g})" if self.mor_active and p.mor_ramp_end is not None else ""
        return f"curriculum: step {step}: MoD {on[self.mod_active]}, MoR {on[self.mor_active]}{ramp}"

    def observe(self, ce_loss: torch.Tensor) -> None:
        """Fold one step's CE loss into the EMA without leaving the device. A non-finite loss (a batch the batch
        filter skipped) leaves it as it was: folded in, it would keep the loss gate shut for the rest of the run."""
        ce = ce_loss.detach().float()
        if self._ema is None:
            self._ema, self._ema_weight = torch.zeros_like(ce), torch.zeros_like(ce)
        finite, b = torch.isfinite(ce), self.ema_beta
        self._ema = torch.where(finite, b * self._ema + (1 - b) * ce, self._ema)
        self._ema_weight = torch.where(finite, b * self._ema_weight + (1 - b), self._ema_weight)

    def ema(self) -> float | None:
        """The bias-corrected loss EMA (a host sync: call at log steps only); None before a finite loss."""
        if self._ema is None or float(self._ema_weight) == 0:
            return None
        return float(self._ema) / float(self._ema_weight)

    def check_gate(self, next_step: int) -> None:
        p = self.plan
        if self.mod_active or self.gate_open or p.loss_gate is None or p.mod_gate_step is None:
            return
        if next_step >= p.mod_gate_step:
            value = self.ema()
            if value is not None and value < p.loss_gate:
                self.gate_open = True

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"mod_active": self.mod_active, "mor_active": self.mor_active, "mor_ramp": self.mor_ramp,
                "gate_open": self.gate_open,
                "ema_biased": None if self._ema is None else float(self._ema),
                "ema_weight": None if self._ema is None else float(self._ema_weight)}

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        self.mod_active = bool(state["mod_active"])
        self.mor_active = bool(state["mor_active"])
        self.gate_open = bool(state["gate_open"])
        ema = state["ema_biased"]
        # Checkpoints before "ema_weight" counted every step: the weight of that many.
        weight = state.get("ema_weight", 1 - self.ema_beta ** int(state.get("ema_count", 0)))
        self._ema = None if ema is None else torch.tensor(ema, dtype=torch.float32, device=device)
        self._ema_weight = None if ema is None else torch.tensor(weight, dtype=torch.float32, device=device)
        self._applied = None
        self._loaded = (self.mod_active, self.mor_active, float(state.get("mor_ramp", 1.0)))
