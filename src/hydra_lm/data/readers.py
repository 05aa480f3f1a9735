"""Readers that turn one input (a file, or a Hugging Face dataset) into documents.

A document is ``(key, payload)``. ``key`` names it stably across machines (the path relative to
its input, ``path#n`` for the n-th record of a multi-record file) and decides its train/val
split. ``payload`` is text (``str``) or, for pre-tokenized inputs, a 1-D integer numpy array.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import json
import os
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .py .pyi .pyx .c .h .cc .cpp .hpp .cxx .cu .cuh .java .kt .scala .go "
    ".rs .js .jsx .ts .tsx .rb .php .pl .lua .r .jl .swift .m .sh .bash .zsh .fish .bat .ps1 .sql .html .htm "
    ".css .scss .xml .yaml .yml .toml .ini .cfg .conf .org .adoc".split())
FORMAT_HELP = ("text files (" + " ".join(sorted(TEXT_SUFFIXES)[:12]) + " ...), .jsonl/.ndjson and .json records, "
               ".parquet (needs pyarrow), .pt/.npy token shards, each optionally gzipped (.gz)")
TOKEN_KEYS = ("input_ids", "tokens", "token_ids", "ids")
Doc = tuple[str, "str | np.ndarray"]


def detect_format(path: Path) -> str | None:
    """The reader for ``path`` by its name: text, jsonl, json, parquet, pt, npy, or None if unknown."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = os.path.splitext(name)[1]
    special = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pt": "pt",
               ".npy": "npy"}
    if suffix in special:
        return special[suffix]
    return "text" if suffix in TEXT_SUFFIXES else None


def _gzipped(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


@contextlib.contextmanager
def _gzip_errors(path: Path):
    """A damaged .gz input is bad input: one line naming the file instead of zlib's traceback."""
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ValueError(f"{path}: corrupt or truncated gzip file ({err}); compress or download it again") from None


def _read_bytes(path: Path) -> bytes:
    if _gzipped(path):
        with _gzip_errors(path), gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


def _binary_source(path: Path) -> Path | io.BytesIO:
    """What a binary reader (numpy, torch, pyarrow) opens: the file, or a gzipped one's decompressed bytes."""
    return io.BytesIO(_read_bytes(path)) if _gzipped(path) else path


def looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(8192)
    if _gzipped(path) or head[:2] == b"\x1f\x8b":
        return False
    return b"\0" in head


class NotText(ValueError):
    """A text input holding NUL bytes: binary data, or text in UTF-16 or UTF-32."""


class TextFieldError(ValueError):
    """Records without a usable text field; ``problem`` is the message without the advice, for callers whose
    users name the field another way."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; pass text_field=NAME (--text_field NAME) to name the field that holds the text")
        self.problem = problem


def _check_not_binary(path: Path, head: bytes) -> None:
    if b"\0" in head[:8192]:
        raise NotText(f"{path} looks binary or UTF-16: convert it to UTF-8 (e.g. iconv -f UTF-16 -t UTF-8), or "
                      f"leave it out of the inputs")


def _decode(data: bytes, path: Path, not_utf8: set[Path] | None) -> str:
    """UTF-8 without a byte order mark; bytes that are not UTF-8 become U+FFFD, and ``path`` is noted in
    ``not_utf8`` so that the loss is reported."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        if not_utf8 is not None:
            not_utf8.add(path)
    return text.removeprefix("\ufeff")


def read_text(path: Path, strict: bool = False, not_utf8: set[Path] | None = None) -> str | None:
    """The file's text; None with ``strict`` for files that are not UTF-8; ``NotText`` for binary files."""
    data = _read_bytes(path)
    _check_not_binary(path, data)
    if strict:
        try:
            return data.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError:
            return None
    # Most "text" that fails UTF-8 is mostly ASCII: keeping it with replacement characters
    # loses less than dropping the file, unless the caller asked for clean input.
    return _decode(data, path, not_utf8)


def _record_text(rec: object, field: str, where: str) -> str:
    if isinstance(rec, str):
        return rec
    if isinstance(rec, dict):
        if field not in rec:
            raise TextFieldError(f"{where}: record has no field {field!r} (it has {sorted(rec)[:12]})")
        return _field_text(rec[field], f"field {field!r}", where)
    raise TextFieldError(f"{where}: expected a JSON object with a {field!r} field (or a string), "
                         f"got {type(rec).__name__}")


def _field_text(value: object, name: str, where: str, not_utf8: set[Path] | None = None,
                path: Path | None = None) -> str:
    """The text of one record's ``name`` (its field or column): None is empty, bytes (from ``path``) are UTF-8,
    anything else is refused."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bytes) and path is not None:
        return _decode(value, path, not_utf8)
    raise TextFieldError(f"{where}: {name} holds {type(value).__name__}, not text")


def iter_jsonl(path: Path, key: str, text_field: str, not_utf8: set[Path] | None = None) -> Iterator[Doc]:
    opener = gzip.open if _gzipped(path) else open
    with _gzip_errors(path), opener(path, "rb") as f:
        _check_not_binary(path, f.read(8192))  # UTF-16 records would otherwise read as "not valid JSON"
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, not_utf8)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); JSONL input needs one JSON "
                                 f"object per line") from None
            yield f"{key}#{lineno}", _record_text(rec, text_field, f"{path}:{lineno}")


def _json_lines(raw: str) -> tuple[list[tuple[int, dict | str]], int | None]:
    """``(line number, record)`` of every non-empty line, each a JSON object or string, and None; or the number
    of the first line that is not one."""
    records = []
    for lineno, line in enumerate(raw.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028 as is
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                return [], lineno
            if not isinstance(rec, (dict, str)):
                return [], lineno
            records.append((lineno, rec))
    return records, None


def iter_json(path: Path, key: str, text_field: str, explicit: bool = False,
              not_utf8: set[Path] | None = None, records_as_text: set[Path] | None = None) -> Iterator[Doc]:
    """A list of records (or strings), or JSON Lines (what ``datasets``' ``to_json`` writes under a ``.json``
    name), gives one document each; any other JSON is one text document.

    The fallback keeps directories of code or docs usable: their ``.json`` files are configs and
    data that read best as text. A file named explicitly is meant as data, so records without
    the text field, or content that is not JSON at all, are an error there rather than text. Records read as
    text (a list or lines of objects, or one object, without the field) are added to ``records_as_text``: a
    directory of data files whose field has another name would otherwise train on their JSON syntax unnoticed.
    """
    raw = read_text(path, not_utf8=not_utf8)
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        lines, bad = _json_lines(raw)
        if bad is None:  # JSON Lines (or nothing but blank lines)
            if explicit or all(isinstance(r, str) or text_field in r for _, r in lines):
                for lineno, rec in lines:
                    yield f"{key}#{lineno}", _record_text(rec, text_field, f"{path}:{lineno}")
                return
            _note(records_as_text, path)
        elif explicit:
            raise ValueError(f"{path} is neither JSON ({err.msg}: line {err.lineno} column {err.colno}) nor JSON Lines "
                             f"(line {bad} is not a JSON object): fix the file, or give it a text suffix such as .txt "
                             f"to read it as plain text") from None
        obj = None
    if isinstance(obj, list) and obj and all(isinstance(r, (dict, str)) for r in obj):
        if all(isinstance(r, str) or text_field in r for r in obj):
            for i, rec in enumerate(obj):
                yield f"{key}#{i}", _record_text(rec, text_field, f"{path}[{i}]")
            return
        if explicit:
            bad = next(i for i, r in enumerate(obj) if not isinstance(r, str) and text_field not in r)
            _record_text(obj[bad], text_field, f"{path}[{bad}]")
        _note(records_as_text, path)
    if isinstance(obj, dict) and isinstance(obj.get(text_field), str):
        yield key, obj[text_field]
        return
    if isinstance(obj, dict):
        if explicit:
            _record_text(obj, text_field, str(path))
        _note(records_as_text, path)
    yield key, raw


def _note(paths: set[Path] | None, path: Path) -> None:
    if paths is not None:
        paths.add(path)


@contextlib.contextmanager
def _parquet_errors(path: Path):
    """A damaged or foreign file is bad input: one line naming it instead of pyarrow's traceback."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"could not read {path} as Parquet ({type(err).__name__}: {err}); it is damaged or not "
                         f"Parquet: write or download it again") from None


def iter_parquet(path: Path, key: str, text_field: str, not_utf8: set[Path] | None = None) -> Iterator[Doc]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs the optional package pyarrow: pip install pyarrow (or "
                         f"pip install 'hydra-lm[data]'), or convert the file to JSONL") from None
    with _parquet_errors(path):
        pf = pq.ParquetFile(_binary_source(path))
        names = pf.schema_arrow.names
    if text_field not in names:
        raise TextFieldError(f"{path}: no column {text_field!r} (columns: {names[:12]})")
    n = 0
    batches = pf.iter_batches(columns=[text_field], batch_size=1024)
    while True:
        with _parquet_errors(path):
            batch = next(batches, None)
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            yield f"{key}#{n}", _field_text(value, f"column {text_field!r}", f"{path} row {n}", not_utf8, path)
            n += 1


def _as_token_docs(obj: object, where: str) -> list[np.ndarray]:
    import torch

    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(x, int) for x in obj):
            obj = [obj]
        return [d for item in obj for d in _as_token_docs(np.asarray(item) if isinstance(item, list) else item,
                                                          where)]
    if isinstance(obj, torch.Tensor):
        obj = obj.numpy()
    if not isinstance(obj, np.ndarray):
        raise ValueError(f"{where}: expected token ids (a tensor, array or list), got {type(obj).__name__}")
    if obj.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got dtype {obj.dtype}")
    if obj.ndim not in (1, 2):
        raise ValueError(f"{where}: token ids must be 1-D (one document) or 2-D (one document per row), "
                         f"got shape {tuple(obj.shape)}")
    if obj.size and int(obj.min()) < 0:
        raise ValueError(f"{where}: negative token id {int(obj.min())}")
    rows = [obj] if obj.ndim == 1 else list(obj)
    return [np.asarray(r) for r in rows]


def load_token_docs(path: Path, fmt: str) -> tuple[list[np.ndarray], int | None]:
    """Documents of a pre-tokenized shard, and the vocabulary size it declares (if any)."""
    if fmt == "npy":
        try:
            source = _binary_source(path)
            arr = np.load(source, mmap_mode=None if isinstance(source, io.BytesIO) else "r", allow_pickle=False)
        except ValueError as err:
            raise ValueError(f"could not load {path} as a token array ({err})") from None
        return _as_token_docs(np.asarray(arr), str(path)), None
    import torch

    try:
        obj = torch.load(_binary_source(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for foreign or unsafe pickles
        raise ValueError(f"could not load {path} as a token shard ({type(err).__name__}: {err}); .pt inputs must "
                         f"hold a tensor of token ids or a dict with an {' / '.join(TOKEN_KEYS)} entry") from None
    declared = None
    if isinstance(obj, dict):
        if isinstance(obj.get("vocab_size"), int):
            declared = obj["vocab_size"]
        found = next((k for k in TOKEN_KEYS if k in obj), None)
        if found is None:
            raise ValueError(f"{path}: the dict has no token entry (keys: {sorted(map(str, obj))[:12]}); expected "
                             f"one of {TOKEN_KEYS}")
        obj = obj[found]
    docs = _as_token_docs(obj, str(path))
    top = max((int(d.max()) for d in docs if len(d)), default=-1)
    if declared is not None and top >= declared:
        raise ValueError(f"{path} declares vocab_size {declared} but holds token id {top}: the shard is damaged or "
                         f"its vocab_size is wrong; correct its vocab_size (at least {top + 1}) or its ids")
    return docs, declared


def iter_token_docs(path: Path, key: str, fmt: str) -> Iterator[Doc]:
    docs, _ = load_token_docs(path, fmt)
    if len(docs) == 1:
        yield key, docs[0]
    else:
        for i, d in enumerate(docs):
            yield f"{key}#{i}", d


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"bad Hugging Face input {spec!r}: write hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return name, config, split


def _hub_reachable(timeout: float = 3.0) -> bool:
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def iter_hf(spec: str, text_field: str) -> Iterator[Doc]:
    name, config, split = parse_hf_spec(spec)
    local_hint = "or pass local files (text, JSONL, Parquet, .pt shards) instead"
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"{spec} needs the optional package `datasets` (pip install datasets, or pip install "
                         f"'hydra-lm[data]'), {local_hint}")
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    offline = any(os.environ.get(f, "").lower() in ("1", "true", "yes") for f in flags)
    saved = {k: os.environ.get(k) for k in (*flags, "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")}
    # Without a reachable hub the libraries retry for minutes; going offline up front still
    # serves data sets already in the local cache, and fails fast otherwise.
    if not offline and not _hub_reachable():
        offline = True
        os.environ.update({f: "1" for f in flags})
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        import datasets

        try:
            ds = datasets.load_dataset(name, config, split=split)
        except Exception as err:  # the hub client raises many network and lookup error types
            where = "the hub is unreachable (offline) and it is not in the local cache" if offline else "loading failed"
            raise ValueError(f"could not load Hugging Face dataset {spec!r}: {where} ({type(err).__name__}: "
                             f"{str(err)[:300]}); download it where there is network, {local_hint}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield from _dataset_docs(ds, spec, text_field)


def is_saved_dataset(directory: Path) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (directory / "dataset_dict.json").is_file() or (
        (directory / "state.json").is_file() and (directory / "dataset_info.json").is_file())


def iter_saved_dataset(directory: Path, key: str, text_field: str) -> Iterator[Doc]:
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"{directory} is a saved Hugging Face dataset; reading it needs the optional package "
                         f"`datasets` (pip install datasets), or export it to JSONL/Parquet")
    import datasets

    ds = datasets.load_from_disk(str(directory))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{directory}: saved DatasetDict has no 'train' split (it has {list(ds)})")
        ds = ds["train"]
    yield from _dataset_docs(ds, key, text_field)


def _dataset_docs(ds, key: str, text_field: str) -> Iterator[Doc]:
    columns = list(ds.column_names or [])
    if columns and text_field not in columns:
        raise TextFieldError(f"{key}: no column {text_field!r} (columns: {columns[:12]})")
    n = 0
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        for value in batch[text_field]:
            yield f"{key}#{n}", _field_text(value, f"column {text_field!r}", f"{key} row {n}", None, Path(key))
            n += 1
