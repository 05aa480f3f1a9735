"""On-disk layout of a prepared data directory, and the atomic writers that produce it.

A prepared directory holds, per split (``train``, ``val``):

- ``<split>.bin``: one flat array of token ids (``uint16`` when the vocabulary fits, else
  ``uint32``), memory-mappable with ``numpy.memmap``. Every document is stored as
  ``[eos] + tokens`` and the stream ends with one more ``eos``: the separator opens each document,
  so under document-masked attention every target except a document's closing ``eos`` is
  predictable from its own document, and the closing ``eos`` teaches the model to stop.
- ``<split>.idx.npy``: ``int64`` start offset of every document (the position of its ``eos``).

plus ``tokenizer.json`` (or ``tokenizer_tiktoken.json``) and ``meta.json``, written last: a
directory without ``meta.json`` is incomplete. ``.prepare.lock`` lets one process at a time prepare it.

``meta.json`` holds two identities: ``fingerprint`` (the inputs' names, sizes and mtimes and the options:
what ``prepare`` compares to skip a build) and ``content_sha256`` (the token and index files and the
tokenizer: what a resumed loader compares, so touching a corpus and preparing it again keeps a run resumable).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
SPLITS = ("train", "val")
META_FILE = "meta.json"
PREPARE_LOCK = ".prepare.lock"
PREPARE_HINT = ("run `hydra-lm prepare --input PATH... --out DIR` (no --input: the built-in corpus), or "
                "hydra_lm.data.prepare_data, first")

# Tokens are buffered before writing so a corpus of many tiny documents is not one syscall each.
_FLUSH_TOKENS = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    if vocab_size <= 2**16:  # ids 0 .. vocab_size - 1
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token files")


def bin_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.bin"


def idx_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.idx.npy"


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it onto ``path`` only if the block succeeds.

    Readers therefore see either the old file or the complete new one, never a torn write.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_TEMP_NAME = re.compile(r"\..+\.tmp-(\d+)")


def remove_stale_temp_files(directory: Path) -> None:
    """Delete the temporary files (``atomic_path``, ``SplitWriter``) of writers killed before they renamed them."""
    for path in directory.iterdir():
        match = _TEMP_NAME.fullmatch(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no pid reaches
        pass
    return True


@contextlib.contextmanager
def exclusive_lock(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold an advisory ``flock`` on ``path`` for the block; if another process holds it, call ``on_wait`` and
    wait for it. The kernel drops the lock when its holder dies (even by SIGKILL); the file stays, as a lock
    file must (see ``train/run_lock.py``)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def content_digest(data_dir: str | Path, tokenizer_id: str | None, vocab_size: int, eos_id: int) -> str:
    """sha256 of what a loader reads: every split's token and index files, the tokenizer and the ids around them."""
    h = hashlib.sha256(json.dumps([tokenizer_id, vocab_size, eos_id]).encode("utf-8"))
    for split in SPLITS:
        for path in (bin_path(data_dir, split), idx_path(data_dir, split)):
            h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as f:  # streamed: a split can be many GB
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_meta(data_dir: str | Path) -> dict:
    """Return the ``meta.json`` of a prepared directory, or raise a clear error if there is none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist: {PREPARE_HINT}")
    meta_file = data_dir / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"{data_dir} holds no prepared data ({META_FILE} is missing, or a preparation was "
                                f"interrupted): {PREPARE_HINT}")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_file} is not valid JSON ({err}): delete {data_dir} and prepare it again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file} is not a JSON object: delete {data_dir} and prepare it again")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_file} has format version {meta.get('format_version')!r}, this hydra-lm reads "
                         f"version {FORMAT_VERSION}: prepare the data again")
    for key, kind in (("vocab_size", int), ("eos_id", int), ("dtype", str), ("splits", dict),
                      ("token_counts", dict)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise ValueError(f"{meta_file} lacks a valid {key!r} (a {kind.__name__}): delete {data_dir} and prepare "
                             "it again")
    return meta


def open_split(data_dir: str | Path, split: str, meta: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map one split: ``(tokens, doc_starts)``; checks the files against ``meta.json``."""
    meta = read_meta(data_dir) if meta is None else meta
    info = meta.get("splits", {}).get(split)
    if info is None:
        raise ValueError(f"unknown split {split!r} in {data_dir}: it has {sorted(meta.get('splits', {}))}")
    dtype = np.dtype(meta["dtype"])
    tokens_file, starts_file = bin_path(data_dir, split), idx_path(data_dir, split)
    for f in (tokens_file, starts_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing although {META_FILE} lists split {split!r}: {PREPARE_HINT}")
    expected = info["tokens"] * dtype.itemsize
    if tokens_file.stat().st_size != expected:
        raise ValueError(f"{tokens_file} has {tokens_file.stat().st_size} bytes, {META_FILE} expects {expected}: "
                         f"the directory is damaged or was modified; prepare it again")
    if info["tokens"] == 0:
        empty = np.zeros(0, dtype=dtype)
        return empty, np.zeros(0, dtype=np.int64)
    tokens = np.memmap(tokens_file, dtype=dtype, mode="r")
    try:  # never unpickle: the index is a plain integer array
        starts = np.load(starts_file, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as err:  # a truncated or empty file raises EOFError
        raise ValueError(f"{starts_file} is not a plain integer array ({err}): prepare the data again") from None
    if len(starts) != info["documents"] or (len(starts) and (starts[0] != 0 or starts[-1] >= len(tokens))):
        raise ValueError(f"{starts_file} does not match {tokens_file}: prepare the data again")
    return tokens, starts


class SplitWriter:
    """Streams the documents of one split to ``<split>.bin`` / ``<split>.idx.npy`` under temporary names.

    The most recent document is held back (``take_pending``) so that a corpus whose hash split left
    the validation set empty can still move one document there without rewriting the file.
    """

    def __init__(self, out_dir: str | Path, split: str, dtype: np.dtype, eos_id: int, vocab_size: int,
                 ids_from: str):
        self.out_dir, self.split, self.dtype, self.eos_id = Path(out_dir), split, np.dtype(dtype), int(eos_id)
        self.vocab_size, self.ids_from = min(int(vocab_size), np.iinfo(self.dtype).max + 1), ids_from
        self._tmp = self.out_dir / f".{split}.bin.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._starts = array("q")
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._pending: np.ndarray | None = None
        self.tokens = 0

    @property
    def documents(self) -> int:
        return len(self._starts) + (self._pending is not None)

    def add(self, ids: np.ndarray) -> None:
        # astype would wrap an id that does not fit the dtype into another, valid-looking token
        if len(ids) and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{self.ids_from} produced token id {int(ids.max())}, outside its vocabulary of "
                             f"{self.vocab_size} ids ({self.dtype.name} token files): use a tokenizer whose ids are "
                             f"all below the vocabulary size it reports")
        if self._pending is not None:
            self._write(self._pending)
        self._pending = ids

    def take_pending(self) -> np.ndarray | None:
        ids, self._pending = self._pending, None
        return ids

    def _write(self, ids: np.ndarray) -> None:
        self._starts.append(self.tokens)
        self._buffer.append(np.array([self.eos_id], dtype=self.dtype))
        self._buffer.append(np.asarray(ids).astype(self.dtype, copy=False))
        self.tokens += 1 + len(ids)
        self._buffered += 1 + len(ids)
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            np.concatenate(self._buffer).tofile(self._file)
            self._buffer, self._buffered = [], 0

    def finish(self) -> dict:
        """Write the held-back document and the closing ``eos``, then move both files into place."""
        if self._pending is not None:
            self._write(self.take_pending())
        if self._starts:
            self._buffer.append(np.array([self.eos_id], dtype=self.dtype))
            self.tokens += 1
        self._flush()
        self._file.close()
        os.replace(self._tmp, bin_path(self.out_dir, self.split))
        with atomic_path(idx_path(self.out_dir, self.split)) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, np.frombuffer(self._starts, dtype=np.int64) if self._starts else np.zeros(0, np.int64))
        return {"tokens": self.tokens, "documents": len(self._starts),
                "file": bin_path(".", self.split).name, "index": idx_path(".", self.split).name}

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)
