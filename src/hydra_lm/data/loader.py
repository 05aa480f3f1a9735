"""``PackedLoader``: fixed-shape, resumable, rank-sharded batches from a prepared data directory.

Rows are windows of ``seq_len + 1`` tokens cut from the split's token stream with stride
``seq_len`` (each token is a target at most once per epoch: exactly once in evaluation). Training shuffles the
rows of each epoch with a generator seeded by ``(seed, epoch)`` and shifts the cut points by a random offset,
so repeated epochs see new document splits (the tokens before the offset and after the last whole row are not
targets in that epoch). Step ``k`` of rank ``r`` takes the rows at
``position + i * world_size + r`` of the epoch's order, ``position`` counting rows consumed by
all ranks; the state is therefore the same on every rank, and a run may resume with another
world size or batch size and still see every remaining row of the epoch once.
"""

from __future__ import annotations

import math
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from .prefetch import OrderedPrefetcher
from .shards import PREPARE_HINT, open_split, read_meta

IGNORE_INDEX = -100
STATE_VERSION = 1
_CHECK_CHUNK = 1 << 26


class PackedLoader:
    """Yield ``{"input_ids", "targets", "doc_ids"}`` batches of shape ``[batch_size, seq_len]``.

    ``doc_ids`` numbers the documents inside each row from 0 (a document begins at its ``eos``
    separator), so a model can keep attention, convolutions and value shifts inside one
    document. ``targets`` is ``IGNORE_INDEX`` (-100) only on padding, which appears only when
    ``loop=False`` pads the last row and batch so that an evaluation pass covers every token.

    ``loop=True`` iterates forever over epochs; ``loop=False`` makes one deterministic pass and
    then stops (the next ``iter`` starts a new identical pass). ``prefetch_threads > 0`` builds
    batches ahead in threads; ``state_dict`` still describes only the batches handed out.
    """

    def __init__(self, data_dir: str | Path, split: str = "train", batch_size: int = 8, seq_len: int = 1024,
                 seed: int = 0, rank: int = 0, world_size: int = 1, *, loop: bool = True,
                 shuffle: bool | None = None, random_offset: bool | None = None, prefetch_threads: int = 0,
                 prefetch_buffer_size: int = 8, validate: bool = True):
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("world_size", world_size, 1),
                                 ("seed", seed, 0), ("rank", rank, 0), ("prefetch_threads", prefetch_threads, 0),
                                 ("prefetch_buffer_size", prefetch_buffer_size, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if rank >= world_size:
            raise ValueError(f"rank={rank} must be < world_size={world_size}")
        self.data_dir, self.split = Path(data_dir), split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size, self.loop = rank, world_size, loop
        self.shuffle = loop if shuffle is None else bool(shuffle)
        self.random_offset = (self.shuffle and loop) if random_offset is None else bool(random_offset)
        self.meta = read_meta(self.data_dir)
        self.tokens, self.starts = open_split(self.data_dir, split, self.meta)
        self.vocab_size = int(self.meta["vocab_size"])
        self.eos_id, self.pad_id = int(self.meta["eos_id"]), int(self.meta.get("pad_id", self.meta["eos_id"]))
        if len(self.tokens) < 2:
            raise ValueError(f"split {split!r} of {self.data_dir} is empty (was it prepared with val_fraction=0?): "
                             f"{PREPARE_HINT} with more data or another val_fraction")
        if validate:
            self._check_ids()
        per_step = batch_size * world_size
        worst = max(0, (len(self.tokens) - 1 - (seq_len - 1 if self.random_offset else 0)) // seq_len)
        if loop and worst < per_step:
            shorter = " (the split is shorter than seq_len)" if len(self.tokens) <= seq_len else ""
            raise ValueError(f"split {split!r} of {self.data_dir} has {len(self.tokens):,} tokens, about {worst} rows "
                             f"of seq_len={seq_len}{shorter}: fewer than batch_size*world_size={per_step}; lower "
                             f"batch_size or seq_len, or prepare more data")
        self._epoch = self._position = self._step = 0
        self._lock = threading.Lock()
        self._layouts: dict[int, tuple[int, int, np.ndarray | None]] = {}
        self._prefetcher = None
        if prefetch_threads > 0:
            # The prefetcher reaches the loader only weakly: `del loader` frees it at once and stops the threads,
            # where a cycle kept them alive until a garbage collection.
            loader = weakref.proxy(self)
            self._prefetcher = OrderedPrefetcher(lambda cursor: loader._batch_at(cursor), prefetch_threads,
                                                 prefetch_buffer_size)
            weakref.finalize(self, self._prefetcher.close)

    # validation -------------------------------------------------------------------------------
    def _check_ids(self) -> None:
        top = 0
        for lo in range(0, len(self.tokens), _CHECK_CHUNK):
            top = max(top, int(self.tokens[lo:lo + _CHECK_CHUNK].max()))
        if top >= self.vocab_size or self.eos_id >= self.vocab_size:
            raise ValueError(f"{self.data_dir}/{self.split}.bin holds token id {max(top, self.eos_id)} >= vocab_size "
                             f"{self.vocab_size} recorded in meta.json: the files do not belong together; "
                             f"{PREPARE_HINT}")

    # epoch layout ------------------------------------------------------------------------------
    def _layout(self, epoch: int) -> tuple[int, int, np.ndarray | None]:
        """``(offset, rows, order)`` of an epoch; ``order`` None means rows in stream order."""
        with self._lock:
            hit = self._layouts.get(epoch)
            if hit is not None:
                return hit
            n, t = len(self.tokens), self.seq_len
            rng = np.random.default_rng([self.seed, epoch])
            offset = min(int(rng.integers(t)), n - 2) if self.random_offset else 0
            rows = (n - 1 - offset) // t
            if not self.loop and (n - 1 - offset) % t:
                rows += 1  # a padded tail row, so evaluation sees every token
            order = None
            if self.shuffle:  # int32 halves the memory of the order on corpora of up to 2**31 rows
                order = np.arange(rows, dtype=np.int32 if rows < 2**31 else np.int64)
                rng.shuffle(order)
            if len(self._layouts) >= 2:  # the consumer's epoch and, near its end, the prefetcher's next one
                self._layouts.pop(min(self._layouts))
            self._layouts[epoch] = (offset, rows, order)
            return offset, rows, order

    def steps_per_epoch(self, epoch: int | None = None) -> int:
        rows = self._layout(self._epoch if epoch is None else epoch)[1]
        per_step = self.batch_size * self.world_size
        return rows // per_step if self.loop else math.ceil(rows / per_step)

    def __len__(self) -> int:
        return self.steps_per_epoch()

    @property
    def epoch(self) -> int:
        return self._epoch

    def _normalize(self, epoch: int, position: int) -> tuple[int, int]:
        if self.loop:
            per_step = self.batch_size * self.world_size
            while position + per_step > self._layout(epoch)[1]:
                epoch, position = epoch + 1, 0
        return epoch, position

    def _advance(self, cursor: tuple[int, int]) -> tuple[int, int]:
        return self._normalize(cursor[0], cursor[1] + self.batch_size * self.world_size)

    def _pass_over(self, cursor: tuple[int, int]) -> bool:
        return not self.loop and cursor[1] >= self._layout(cursor[0])[1]

    # batches -----------------------------------------------------------------------------------
    def _doc_ids(self, start: int, n_real: int) -> np.ndarray:
        t = self.seq_len
        ids = np.zeros(t, dtype=np.int32)
        if n_real == 0:
            return ids
        lo = int(np.searchsorted(self.starts, start, side="right"))
        hi = int(np.searchsorted(self.starts, start + n_real - 1, side="right"))
        ids[np.asarray(self.starts[lo:hi]) - start] = 1
        np.cumsum(ids, out=ids)
        if n_real < t:
            ids[n_real:] = ids[n_real - 1] + 1  # padding as one more document keeps ids non-decreasing
        return ids

    def _batch_at(self, cursor: tuple[int, int]) -> dict[str, torch.Tensor]:
        epoch, position = cursor
        offset, rows, order = self._layout(epoch)
        b, t = self.batch_size, self.seq_len
        window = np.full((b, t + 1), self.pad_id, dtype=np.int64)
        doc_ids = np.zeros((b, t), dtype=np.int32)
        real = np.zeros(b, dtype=np.int64)
        for i in range(b):
            g = position + i * self.world_size + self.rank
            if g >= rows:
                continue  # a padding row: only loop=False runs past the last row
            start = offset + int(order[g] if order is not None else g) * t
            chunk = self.tokens[start:start + t + 1]
            window[i, :len(chunk)] = chunk
            real[i] = len(chunk)
            doc_ids[i] = self._doc_ids(start, min(len(chunk), t))
        targets = window[:, 1:].copy()
        short = real < t + 1
        if short.any():
            cols = np.arange(t)
            targets[short] = np.where(cols[None, :] >= (real[short, None] - 1), IGNORE_INDEX, targets[short])
        return {"input_ids": torch.from_numpy(np.ascontiguousarray(window[:, :-1])),
                "targets": torch.from_numpy(targets), "doc_ids": torch.from_numpy(doc_ids)}

    def _cursors_from(self, cursor: tuple[int, int]):
        return _cursors(weakref.proxy(self), cursor)  # held by the prefetcher: a weak reference, as above

    # iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        cursor = self._normalize(self._epoch, self._position)
        if self._pass_over(cursor):
            self._epoch, self._position = cursor[0], 0
            if self._prefetcher is not None:
                self._prefetcher.reset()
            raise StopIteration
        if self._prefetcher is None:
            batch = self._batch_at(cursor)
        else:
            if not self._prefetcher.active:
                self._prefetcher.restart(self._cursors_from(cursor))
            key, batch = self._prefetcher.next()
            if key != cursor:  # cannot happen unless the state was changed behind the prefetcher's back
                self._prefetcher.restart(self._cursors_from(cursor))
                key, batch = self._prefetcher.next()
        self._epoch, self._position = self._advance(cursor)
        self._step += 1
        return batch

    # state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable position after the last batch handed out (the same on every rank but ``rank``)."""
        return {"version": STATE_VERSION, "split": self.split, "seed": self.seed, "epoch": self._epoch,
                "position": self._position, "step": self._step, "rank": self.rank, "world_size": self.world_size,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "shuffle": self.shuffle, "loop": self.loop,
                "random_offset": self.random_offset, "data_fingerprint": self.meta.get("fingerprint"),
                "data_content": self.meta.get("content_sha256")}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the loader that saved ``state`` stopped.

        The seed comes from the state; rank, world size and batch size come from this loader, so
        a resume on another number of ranks shares out the epoch's remaining rows.
        """
        missing = {"epoch", "position", "seed", "seq_len"} - set(state)
        if missing:
            raise ValueError(f"not a PackedLoader state: missing {sorted(missing)}")
        if not same_data(state, self.meta):
            raise ValueError(f"the loader state was saved for other data than {self.data_dir}: the data there changed "
                             f"since the run started (prepared again from a changed corpus or with other options), "
                             f"or the run started on another directory. Resume with the data the run started with "
                             f"(prepare it again from the same corpus and options), or start a new run on this data")
        for name in ("split", "seq_len", "shuffle", "loop", "random_offset"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(f"the loader state has {name}={state[name]!r}, this loader {getattr(self, name)!r}: "
                                 f"create the loader with the saved {name}")
        if int(state["seed"]) != self.seed:
            with self._lock:
                self.seed, self._layouts = int(state["seed"]), {}
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._step = int(state.get("step", 0))
        if self._prefetcher is not None:
            self._prefetcher.reset()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def same_data(state: dict, meta: dict) -> bool:
    """Whether a loader ``state`` was saved on the data ``meta`` describes: by content where both record it (a
    corpus touched and prepared again is the same data), else, for states and directories from before, by the
    preparation's fingerprint; a state that records neither matches."""
    saved, now = state.get("data_content"), meta.get("content_sha256")
    if saved is not None and now is not None:
        return saved == now
    return state.get("data_fingerprint") in (None, meta.get("fingerprint"))


def _cursors(loader: PackedLoader, cursor: tuple[int, int]):
    while not loader._pass_over(cursor):
        yield cursor
        cursor = loader._advance(cursor)
