"""A run that stops making progress leaves its Python stacks in its log.

If no training step and no evaluation batch finishes for ``stall_dump_s`` seconds, every thread's
stack is appended to RUN_DIR/train.log (other ranks: their stderr), and again every ``stall_dump_s``
while the stall lasts; the run itself goes on. A stall inside a compile, a collective or a data thread
then says where it waits, which a killed run would otherwise take with it.

A Python watchdog thread reads the stacks (``sys._current_frames``) while it holds the GIL; ``faulthandler``'s
watchdog reads them without it while other threads change them, which can crash the process. The cost: a thread
that holds the GIL without end (a C call that never releases it) delays the dump until it does. Waits on the GPU,
a collective, a lock or I/O release the GIL.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path


class StallDump:
    def __init__(self, log_path: Path | None, after_s: float):
        self.after_s = after_s
        self._file = None
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if after_s > 0:
            self._file = open(log_path, "a") if log_path is not None else sys.stderr  # closed by close()
            self._thread = threading.Thread(target=self._watch, name="stall-dump", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        """Progress: the next dump comes ``after_s`` after the last call."""
        self._last_beat = time.monotonic()

    def _watch(self) -> None:
        dumped_at = -float("inf")
        while True:
            # The next moment a dump may be due: after_s past the last beat, and after_s past the last dump.
            due = max(self._last_beat, dumped_at) + self.after_s
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            now = time.monotonic()
            if now - self._last_beat >= self.after_s and now - dumped_at >= self.after_s:
                self._dump(now - self._last_beat)
                dumped_at = now

    def _dump(self, stalled_s: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"Stall: no training step or evaluation batch finished for {stalled_s:.1f} s "
                 f"(--stall_dump_s {self.after_s:g}); every thread's stack, most recent call last:\n"]
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():  # not this watchdog's own
                lines.append(f"Thread {names.get(ident, '?')} ({ident}):\n")
                lines.extend(traceback.format_stack(frame))
        try:
            self._file.write("".join(lines))
            self._file.flush()
        except OSError:  # the log cannot be written (a full disk): the run goes on without the dump
            pass

    def close(self) -> None:
        if self._file is None:
            return
        self._stop.set()
        self._thread.join()
        if self._file is not sys.stderr:
            self._file.close()
        self._file = None
