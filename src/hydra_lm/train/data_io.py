"""The trainer's view of a prepared data directory: vocabulary, tokenizer identity, loaders."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import data as data_pkg


@dataclass
class DataInfo:
    path: Path
    vocab_size: int
    eos_id: int
    tokenizer_fingerprint: str | None
    token_counts: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "tokenizer_fingerprint": self.tokenizer_fingerprint, "token_counts": self.token_counts}


def tokenized_alike(recorded: dict[str, Any], info: DataInfo) -> bool:
    """Whether ``info``'s data was tokenized like the data a run recorded (``DataInfo.to_dict``) was."""
    was = recorded.get("tokenizer_fingerprint")
    return recorded.get("vocab_size", info.vocab_size) == info.vocab_size and \
        (None in (was, info.tokenizer_fingerprint) or was == info.tokenizer_fingerprint)


def open_data(path: str | Path) -> DataInfo:
    """Check that ``path`` is a prepared data directory with training tokens; clear errors otherwise. The path is
    made absolute: a run records it, and its evaluation may start from another directory."""
    path = Path(path).expanduser().resolve()
    try:
        meta = data_pkg.read_meta(path)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    counts = dict(meta.get("token_counts", {}))
    if not counts.get("train"):
        raise ValueError(f"data directory {path} has no training tokens: prepare it from a non-empty corpus")
    fingerprint = None
    try:
        fingerprint = data_pkg.load_tokenizer(path).fingerprint()
    except (ValueError, FileNotFoundError):
        pass  # pre-tokenized data without a tokenizer: training works, text generation does not
    return DataInfo(path, int(meta["vocab_size"]), int(meta["eos_id"]), fingerprint, counts)


def dataset_dir(name: str) -> Path:
    """``--dataset``: a prepared directory as is, else a corpus spec prepared once into a cache."""
    as_path = Path(name).expanduser()
    if (as_path / "meta.json").is_file():
        return as_path
    root = Path(os.environ.get("HYDRA_CACHE_DIR", Path.home() / ".cache" / "hydra_lm")).expanduser()
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "default"
    out = root / "prepared" / safe
    inputs = None if name.lower() in ("default", "stdlib") else [name]
    try:
        return Path(data_pkg.prepare_data(inputs, out))
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None


def train_loader(info: DataInfo, batch_size: int, seq_len: int, seed: int, prefetch_threads: int = 0,
                 prefetch_buffer_size: int = 8, rank: int = 0, world_size: int = 1):
    return data_pkg.PackedLoader(info.path, "train", batch_size, seq_len, seed=seed, rank=rank, world_size=world_size,
                                 prefetch_threads=prefetch_threads, prefetch_buffer_size=prefetch_buffer_size)


class ValSet:
    """One deterministic pass over the validation split per iteration, however early the last one stopped
    (with several ranks: each rank's share of it; every rank gets the same number of batches).

    The rows come in a fixed shuffled order, so the first N batches (``--eval_batches N``) are a sample of
    the whole split: the split keeps its documents in corpus order, and a corpus gathered from several
    sources (e.g. Python files first, C headers after) made its first batches a sample of one source."""

    def __init__(self, info: DataInfo, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1):
        if not info.token_counts.get("val"):
            raise ValueError(f"data directory {info.path} has no validation tokens: prepare it with a validation "
                             "fraction above 0")
        self.loader = data_pkg.PackedLoader(info.path, "val", batch_size, seq_len, seed=0, rank=rank,
                                            world_size=world_size, loop=False, shuffle=True)
        self._start = self.loader.state_dict()

    def __iter__(self):
        self.loader.load_state_dict(self._start)
        return iter(self.loader)
