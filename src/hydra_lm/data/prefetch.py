"""Ordered background prefetch: worker threads compute batches ahead, the consumer gets them in order.

Batches are pure functions of a cursor, so the consumer alone decides what counts as consumed;
discarding the queue (``reset``) is all a state restore needs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class OrderedPrefetcher:
    def __init__(self, make: Callable[[Any], Any], threads: int, depth: int):
        self._make = make
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="hydra-prefetch")
        self._depth = max(1, depth, threads)
        self._queue: deque[tuple[Hashable, Future]] = deque()
        self._keys: Iterator | None = None

    @property
    def active(self) -> bool:
        return self._keys is not None or bool(self._queue)

    def restart(self, keys: Iterator) -> None:
        self.reset()
        self._keys = keys

    def reset(self) -> None:
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()
        self._keys = None

    def _fill(self) -> None:
        while self._keys is not None and len(self._queue) < self._depth:
            key = next(self._keys, _END)
            if key is _END:
                self._keys = None
                break
            self._queue.append((key, self._pool.submit(self._make, key)))

    def next(self) -> tuple[Hashable, Any]:
        """``(key, result)`` for the next key in order; raises StopIteration when the keys run out."""
        self._fill()
        if not self._queue:
            raise StopIteration
        key, fut = self._queue.popleft()
        self._fill()
        return key, fut.result()

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=False, cancel_futures=True)


_END = object()
