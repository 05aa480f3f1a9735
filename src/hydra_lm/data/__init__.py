"""Data pipeline: corpus -> tokenizer + token shards (``prepare_data``), and a resumable loader."""

from __future__ import annotations

from .loader import IGNORE_INDEX, PackedLoader
from .prepare import prepare_data
from .shards import open_split, read_meta
from .sources import DEFAULT_CORPUS_BYTES
from .tokenizer import SPECIAL_TOKENS, HydraTokenizer, load_tokenizer

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "HydraTokenizer",
    "IGNORE_INDEX",
    "PackedLoader",
    "SPECIAL_TOKENS",
    "load_tokenizer",
    "open_split",
    "prepare_data",
    "read_meta",
]
