"""One trainer per run directory: an advisory ``flock`` on ``RUN_DIR/.lock`` held for the run's life.

Two trainers on one ``--out`` would delete each other's half-written checkpoints and interleave
their files. The kernel drops a ``flock`` when its holder dies (even by SIGKILL), so a lock left
by a crashed run is simply taken over; the file's content (pid, host, start time) only serves the
error message. The file is never deleted: unlinking a locked file would let a third process lock a
new file of the same name while the second still holds the old one.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirectoryInUse(ValueError):
    """Another live process holds the run directory."""


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.read(fd, 4096))
            os.close(fd)
            raise RunDirectoryInUse(f"{self.path.parent} is in use by another trainer ({holder}); wait for it to "
                                    "finish or stop it, or train into another --out directory") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode("utf-8"))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {int(info['pid'])} on host {info['host']}, since {since}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "holder unknown: it has not written its pid yet"
