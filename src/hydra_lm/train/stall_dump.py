"""A run that stops making progress leaves its Python stacks in its log.

If no training step and no evaluation batch finishes for ``stall_dump_s`` seconds, every thread's
stack is appended to RUN_DIR/train.log (other ranks: their stderr), and again every ``stall_dump_s``
while the stall lasts; the run itself goes on. A stall inside a compile, a collective or a data thread
then says where it waits, which a killed run would otherwise take with it. The standard library's
``faulthandler`` does the dumping from its own thread, so it works while the main thread is blocked.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from pathlib import Path


class StallDump:
    def __init__(self, log_path: Path | None, after_s: float):
        self.after_s = after_s
        self._file = None
        self._armed_at = -float("inf")
        if after_s > 0:
            self._file = open(log_path, "a") if log_path is not None else sys.stderr  # closed by close()
            self.beat()

    def beat(self) -> None:
        """Progress: the dump fires ``after_s`` after the last call. Re-arming starts a thread, so it is
        done at most ten times per ``after_s`` (a stall is still reported within 1.1 x ``after_s``)."""
        if self._file is None:
            return
        now = time.monotonic()
        if now - self._armed_at >= self.after_s / 10:
            self._armed_at = now
            self._file.flush()
            faulthandler.dump_traceback_later(self.after_s, repeat=True, file=self._file)

    def close(self) -> None:
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        if self._file is not sys.stderr:
            self._file.close()
        self._file = None
