"""SIGINT / SIGTERM: stop training after the step in progress and save a checkpoint."""

from __future__ import annotations

import signal
import time

REPEATED_SIGNAL_S = 2.0  # signals closer together than this count as one request


class StopRequest:
    """``reason`` is the first signal's name once one arrived; a second one stops at once."""

    def __init__(self, log):
        self.log = log
        self.reason: str | None = None
        self._at: float | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if self._at is not None:
            # A second Ctrl-C stops at once (checkpoints on disk are intact). One right after the
            # first is the same request: torchrun forwards the terminal's signal to its workers.
            if now - self._at > REPEATED_SIGNAL_S:
                raise KeyboardInterrupt
            return
        self._at = now
        self.reason = signal.Signals(signum).name
        self.log.info(f"{self.reason} received: saving a checkpoint after the step in progress")

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
