"""Anomaly monitor that switches a misbehaving speed optimization off, and back on after a clean stretch.

At every log point (values already on the host: no extra synchronisation) the monitor looks for a
loss spike (above ``loss_spike_threshold`` x its average) and throughput below ``throughput_drop_threshold`` x its
average; non-finite losses and gradients reach it from the divergence guard (``note_divergence``). Each anomaly is
logged and recorded. Three within ``window`` steps (``anomaly_window``: never fewer than three log points span) switch
off the most invasive optimization still on (CUDA graphs, then
torch.compile, then the fused chunked loss); the trainer then continues from its last good
checkpoint. An optimization that has been off for ``window`` steps without a new anomaly is
switched on again ("graduates"). One that failed its pretest (see ``pretest``) stays off for the rest of
the invocation. What is off and the monitor's averages are saved in checkpoints, so a resumed run
takes the decisions an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from .schedule import ema_update

ANOMALIES_TO_SWITCH = 3
EMA_BETA = 0.9


def anomaly_window(window: int, log_every: int) -> int:
    """The monitor's window in steps: ``window``, widened where it could not hold ``ANOMALIES_TO_SWITCH`` log points
    (the monitor sees a loss only there): with --log_every 50, a window of 100 held two, and loss spikes alone could
    never switch anything off."""
    return max(window, (ANOMALIES_TO_SWITCH - 1) * log_every + 1)


@dataclass
class Switch:
    """One optimization the trainer can turn off and on while running."""

    name: str
    key: str  # the TrainConfig flag it stands for: names it in checkpoints and pretests
    turn_off: Callable[[], None]
    turn_on: Callable[[], None]
    on: bool = True
    off_since: int = -1
    failed_pretest: bool = False  # off until the next start, which tests it again
    pretested: bool = True  # whether a start pretests it (pretest.PRETESTED names the flags that can be)


class AnomalyMonitor:
    def __init__(self, window: int, loss_spike: float, throughput_drop: float):
        self.window, self.loss_spike, self.throughput_drop = window, loss_spike, throughput_drop
        self.loss_ema: float | None = None
        self.tps_ema: float | None = None
        self.recent: deque[int] = deque()  # steps of anomalies within the window
        self.last_anomaly = -1

    def observe(self, step: int, loss: float, grad_norm: float, tokens_per_s: float) -> list[str]:
        found = []  # non-finite losses and gradients never get here: the divergence guard takes them (note_divergence)
        if self.loss_ema is not None and not loss <= self.loss_spike * self.loss_ema:
            found.append(f"loss spike: {loss:.4g} > {self.loss_spike:g} x its average {self.loss_ema:.4g}")
        if self.tps_ema is not None and tokens_per_s < self.throughput_drop * self.tps_ema:
            found.append(f"throughput drop: {tokens_per_s:,.0f} tokens/s < {self.throughput_drop:g} x its average "
                         f"{self.tps_ema:,.0f}")
        if math.isfinite(loss):
            self.loss_ema = ema_update(self.loss_ema, loss, EMA_BETA, self.loss_spike)
        if tokens_per_s > 0 and self.throughput_drop > 0:  # 0: the throughput check is off
            self.tps_ema = ema_update(self.tps_ema, tokens_per_s, EMA_BETA, 1 / self.throughput_drop)
        for _ in found:
            self.record(step)
        return found

    def record(self, step: int) -> None:
        self.recent.append(step)
        self.last_anomaly = step
        while self.recent and self.recent[0] <= step - self.window:
            self.recent.popleft()

    def too_many(self) -> bool:
        return len(self.recent) >= ANOMALIES_TO_SWITCH

    def state_dict(self) -> dict[str, Any]:
        return {"loss_ema": self.loss_ema, "tps_ema": self.tps_ema, "recent": list(self.recent),
                "last_anomaly": self.last_anomaly}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_ema, self.tps_ema = state["loss_ema"], state["tps_ema"]
        self.recent = deque(state["recent"])
        self.last_anomaly = state["last_anomaly"]


class SafeOptimizations:
    def __init__(self, switches: list[Switch], monitor: AnomalyMonitor, warn: Callable[[str], None],
                 record: Callable[[dict[str, Any]], None]):
        self.switches, self.monitor, self.warn, self.record = switches, monitor, warn, record
        self.switched_after: int | None = None  # the first anomaly of the burst behind the latest switch-off

    def observe(self, step: int, loss: float, grad_norm: float, tokens_per_s: float) -> Switch | None:
        """Feed one log point; returns the optimization switched off (the caller reloads its last good
        state), if any."""
        for anomaly in self.monitor.observe(step, loss, grad_norm, tokens_per_s):
            self.warn(f"anomaly at step {step}: {anomaly}")
            self.record({"kind": "anomaly", "step": step, "anomaly": anomaly})
        self._graduate(step)
        return self._switch_off_if_needed(step)

    def note_divergence(self, step: int, rolled_back_to: int) -> Switch | None:
        """A non-finite loss or gradient seen by the divergence guard at ``step`` counts as an anomaly too. Called
        after the rollback to ``rolled_back_to`` (which forgets the anomalies after it), it is counted there, so
        that repeated divergences add up."""
        self.monitor.record(rolled_back_to)
        self.record({"kind": "anomaly", "step": step, "anomaly": "non-finite loss or gradients"})
        return self._switch_off_if_needed(rolled_back_to)

    def restarted_at(self, step: int) -> None:
        """The trainer went back to ``step`` (a rollback): clean stretches count from there."""
        for s in self.switches:
            if not s.on:
                s.off_since = min(s.off_since, step)
        self.monitor.recent = deque(x for x in self.monitor.recent if x <= step)
        self.monitor.last_anomaly = min(self.monitor.last_anomaly, step)

    def disable(self, key: str, step: int, reason: str) -> Switch | None:
        """Switch an optimization off for the rest of this invocation (it failed its pretest)."""
        switch = next((s for s in self.switches if s.key == key and s.on), None)
        if switch is None:
            return None
        switch.turn_off()
        switch.on, switch.off_since, switch.failed_pretest = False, step, True
        self.warn(f"pretest failed for {switch.name}: {reason}; switched it off for this run (it is tested again at "
                  "the next start)")
        self.record({"kind": "safety", "step": step, "optimization": switch.name, "action": "off",
                     "reason": f"pretest: {reason}"})
        return switch

    def state_dict(self) -> dict[str, Any]:
        """Switched-off optimizations (a failed pretest is not kept: the next start tests it again) and the monitor."""
        off = {s.key: s.off_since for s in self.switches if not s.on and not s.failed_pretest}
        return {"off": off, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state["monitor"])
        for s in self.switches:
            if s.key in state["off"] and s.on:
                s.turn_off()
                s.on, s.off_since = False, int(state["off"][s.key])
                self.warn(f"{s.name} stays off as the checkpoint recorded (switched off at step {s.off_since}); it "
                          f"is tried again after {self.monitor.window} clean steps")

    def _switch_off_if_needed(self, step: int) -> Switch | None:
        if not self.monitor.too_many():
            return None
        culprit = next((s for s in self.switches if s.on), None)
        if culprit is None:
            return None
        culprit.turn_off()
        culprit.on, culprit.off_since = False, step
        self.switched_after = min(self.monitor.recent)
        self.monitor.recent.clear()
        self.monitor.tps_ema = None  # the slower path sets a new level: its first steps are no drops
        self.warn(f"{ANOMALIES_TO_SWITCH} anomalies within {self.monitor.window} steps: switched {culprit.name} off "
                  f"at step {step}; it is tried again after {self.monitor.window} clean steps")
        self.record({"kind": "safety", "step": step, "optimization": culprit.name, "action": "off"})
        return culprit

    def _graduate(self, step: int) -> None:
        for s in self.switches:
            clean = step - max(s.off_since, self.monitor.last_anomaly) >= self.monitor.window
            if not s.on and not s.failed_pretest and clean:
                s.turn_on()
                s.on = True
                self.monitor.tps_ema = None
                self.warn(f"{s.name} switched on again at step {step}: {step - s.off_since} steps without an anomaly")
                self.record({"kind": "safety", "step": step, "optimization": s.name, "action": "on"})
