"""SIGINT / SIGTERM: stop training after the step in progress and save a checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

REPEATED_SIGNAL_S = 2.0  # signals closer together than this count as one request
# A signal sent to the whole process group (Ctrl-C, `timeout`, a scheduler) also reaches the
# compiler's helper processes (inductor's workers, g++, ptxas): a step that is compiling then fails
# or, seen on an H100, waits forever for a dead worker. After this long the process exits instead.
STEP_GRACE_S = 300.0
EXIT_INTERRUPTED = 130


class StopRequest:
    """``reason`` is the first signal's name once one arrived; a second one stops at once, and so does
    work in progress (a step, the pretest, an evaluation batch) that has not ended ``grace_s`` after the
    first. A checkpoint being written (``saving``) is not timed: cut short, it would lose the checkpoint."""

    def __init__(self, log, grace_s: float = STEP_GRACE_S):
        self.log = log
        self.grace_s = grace_s
        self.reason: str | None = None
        self._at: float | None = None
        self._previous: dict = {}
        self._watchdog: threading.Timer | None = None
        self._saving = False
        self._step_ended = False  # the step in progress at the signal ended (``acknowledge``), or a save failed

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
        # Logged by ``acknowledge``, not here: a print inside the handler, landing while the main thread prints,
        # raises "reentrant call" into the step.
        if not self._saving:
            self._arm()

    def _arm(self) -> None:
        if self._watchdog is None:  # the handler may have armed it between a caller's check and its call
            self._watchdog = threading.Timer(self.grace_s, self._give_up)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def acknowledge(self) -> None:
        """The step in progress ended and the run stops: say so (once) and end the grace period, which bounds the
        step alone, not the checkpoint and the final evaluation that follow (a second signal still stops them)."""
        if self._at is None or self._step_ended:
            return
        self._disarm()
        self._step_ended = True
        self.log.info(f"{self.reason} received: the run stops after the step in progress")

    @contextlib.contextmanager
    def saving(self):
        """Writing a checkpoint: a first signal before or during it waits for it (a second one still stops at once),
        and what runs after it until the stop is acknowledged gets a grace period of its own. An error of the save is
        its own, not the interrupted step's."""
        self._saving = True
        self._disarm()
        try:
            yield
        except BaseException:
            self._step_ended = True  # the run ends on this error
            raise
        finally:
            self._saving = False
            if self._at is not None and not self._step_ended:
                self._arm()

    def _give_up(self) -> None:
        self.log.warning(f"the step in progress did not finish within {self.grace_s:.0f} s of {self.reason} (a "
                       "compilation whose helper processes the signal stopped too?): exiting without a new "
                       "checkpoint; the last one saved is intact")
        os._exit(EXIT_INTERRUPTED)

    def step_failed(self, error: BaseException) -> bool:
        """Whether a step that raised ``error`` failed because of the stop request (reported, then the
        run stops as interrupted) rather than on its own (the caller re-raises): only a step in progress at the
        signal can be (a full disk while the interrupt checkpoint is written is its own error)."""
        if self.reason is None or self._step_ended:
            return False
        self.log.warning(f"the step in progress failed after {self.reason} ({type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''}; a signal to the process group also "
                       "stops the compiler's helper processes): stopping without a new checkpoint; the last one "
                       "saved is intact")
        return True

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def uninstall(self) -> None:
        self._disarm()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
