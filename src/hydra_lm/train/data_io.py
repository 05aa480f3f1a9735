"""The trainer's view of a prepared data directory: vocabulary, tokenizer identity, loaders."""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import data as data_pkg
from ..data.readers import TextFieldError


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
    if meta.get("tokenizer"):  # none: pre-tokenized data, which trains but cannot generate text
        try:
            fingerprint = data_pkg.load_tokenizer(path).fingerprint()
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"the tokenizer recorded for data directory {path} cannot be loaded ({err}); if its "
                             f"file is damaged or missing, prepare the data again") from None
    return DataInfo(path, int(meta["vocab_size"]), int(meta["eos_id"]), fingerprint, counts)


def dataset_dir(name: str) -> Path:
    """``--dataset``: a prepared directory as is, else a corpus spec prepared once into a cache."""
    as_path = Path(name).expanduser()
    if (as_path / "meta.json").is_file():
        return as_path
    root = Path(os.environ.get("HYDRA_CACHE_DIR", Path.home() / ".cache" / "hydra_lm")).expanduser()
    if name.lower() in ("default", "stdlib"):  # the built-in corpus: one per name, whatever the directory
        inputs, out = None, root / "prepared" / name.lower()
    else:
        spec, label = _resolved_spec(name)
        inputs = [spec]
        # A readable name alone gave two corpora named alike (`corpus` in two projects) one directory.
        digest = hashlib.sha256(spec.encode("utf-8")).hexdigest()[:10]
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")[:80]
        out = root / "prepared" / f"{safe}-{digest}".lstrip("-")
    try:
        return Path(data_pkg.prepare_data(inputs, out))
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    except TextFieldError as err:  # --dataset has no --text_field: its advice is for `prepare`
        raise ValueError(f"{err.problem}; --dataset reads the field 'text': run `hydra-lm prepare --input {name} "
                         f"--text_field NAME --out DIR` and train with --data DIR") from None


def _resolved_spec(spec: str) -> tuple[str, str]:
    """``(spec, label)``: a path or glob made absolute, labelled by its last plain component; hub specs (``hf:``)
    and named sets as given."""
    path = Path(spec).expanduser()
    if spec.startswith("hf:") or not (path.exists() or glob.has_magic(spec)):
        return spec, spec
    full = path.resolve() if path.exists() else Path(os.path.abspath(path))
    return str(full), next((p for p in reversed(full.parts) if not glob.has_magic(p)), "")


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
