"""Tokenizers behind one small interface: a trained byte-level BPE, a ``tokenizer.json``, or tiktoken.

Byte-level BPE is the default because it round-trips any text exactly (no unknown token, no
normalisation) and trains in seconds with the Rust ``tokenizers`` library (long runs of one character class cut first).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from .shards import META_FILE, atomic_path

EOS, BOS, PAD = "<|endoftext|>", "<|bos|>", "<|pad|>"
SPECIAL_TOKENS = (EOS, BOS, PAD)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tokenizer_tiktoken.json"
_EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_BOS_NAMES = (BOS, "<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|padding|>")
# Long texts are encoded in pieces cut at line ends: encode_arrays parallelises across pieces and
# a piece bounds the memory of one Encoding; only the token boundary at each cut can differ.
_PIECE_CHARS = 1 << 20
# BPE training's time grows with the square of its longest pre-token, so one run of thousands of letters, digits or
# spaces (an unwrapped sequence dump, padding) stalls it for minutes to hours. Such runs reach the trainer cut into
# pieces of _RUN_CHARS; text without one passes whole, so ordinary corpora train the same tokenizer as before.
_RUN_CHARS = 4096
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{_RUN_CHARS},}}|(?<!\s)\s{{{_RUN_CHARS},}}")


def _long_runs_cut(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        start = 0
        for run in _LONG_RUN.finditer(text):
            if run.start() > start:
                yield text[start:run.start()]
            yield from (text[i:min(i + _RUN_CHARS, run.end())] for i in range(run.start(), run.end(), _RUN_CHARS))
            start = run.end()
        if start < len(text):
            yield text[start:]


def _split_long(text: str) -> list[str]:
    if len(text) <= _PIECE_CHARS:
        return [text]
    pieces, start = [], 0
    while start < len(text):
        end = min(start + _PIECE_CHARS, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


class HydraTokenizer:
    """``encode``/``decode`` plus the special ids the data pipeline needs, whatever the backend.

    Special-token strings inside the text are encoded as plain text, so a document that quotes
    ``<|endoftext|>`` cannot forge a document boundary.
    """

    def __init__(self, backend, kind: str, name: str, eos_id: int, bos_id: int, pad_id: int):
        self.backend, self.kind, self.name = backend, kind, name
        self.eos_id, self.bos_id, self.pad_id = int(eos_id), int(bos_id), int(pad_id)

    # construction ---------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8192, progress: bool = False,
              length: int | None = None) -> "HydraTokenizer":
        """Train a byte-level BPE with ``<|endoftext|>`` (id 0), ``<|bos|>`` (1), ``<|pad|>`` (2)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        check_vocab_size(vocab_size)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
        tok.train_from_iterator(_long_runs_cut(texts), trainer, length=length)
        return cls._from_hf(tok, "bpe", f"byte-level BPE {tok.get_vocab_size()}")

    @classmethod
    def from_file(cls, path: str | Path) -> "HydraTokenizer":
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side reports parse errors as a generic Exception
            raise ValueError(f"could not load tokenizer file {path}: {err}") from None
        return cls._from_hf(tok, "tokenizers", str(path))

    @classmethod
    def _from_hf(cls, tok, kind: str, name: str) -> "HydraTokenizer":
        from tokenizers import AddedToken

        def find(names):
            return next((i for n in names if (i := tok.token_to_id(n)) is not None), None)

        eos = find(_EOS_NAMES)
        if eos is None:
            # Documents need a separator; adding one keeps every existing id unchanged.
            tok.add_special_tokens([AddedToken(EOS, special=True)])
            eos = tok.token_to_id(EOS)
        bos, pad = find(_BOS_NAMES), find(_PAD_NAMES)
        tok.encode_special_tokens = True
        return cls(tok, kind, name, eos, eos if bos is None else bos, eos if pad is None else pad)

    @classmethod
    def from_tiktoken(cls, encoding: str) -> "HydraTokenizer":
        try:
            import tiktoken
        except ImportError:
            raise ValueError(f"tokenizer tiktoken:{encoding} needs the optional package tiktoken: pip install "
                             f"tiktoken (or pip install 'hydra-lm[data]'), or train a BPE (tokenizer=None)") from None
        try:
            enc = tiktoken.get_encoding(encoding)
        except Exception as err:  # unknown names and failed downloads of the rank file alike
            raise ValueError(f"could not load tiktoken encoding {encoding!r} ({type(err).__name__}: {err}); its "
                             f"rank file must be in the tiktoken cache (TIKTOKEN_CACHE_DIR) when offline") from None
        eos = enc.eot_token
        return cls(enc, "tiktoken", encoding, eos, eos, eos)

    # use ------------------------------------------------------------------------------------
    @functools.cached_property
    def vocab_size(self) -> int:
        """Ids run from 0 to ``vocab_size - 1``: a vocabulary with holes counts up to its largest id."""
        if self.kind == "tiktoken":
            return self.backend.n_vocab
        entries = self.backend.get_vocab(with_added_tokens=True)
        return max(len(entries), max(entries.values(), default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        if self.kind == "tiktoken":
            return self.backend.encode_ordinary(text)
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_arrays(self, texts: list[str], dtype=np.int64) -> list[np.ndarray]:
        """Encode many texts at once (in parallel in the Rust backend) into numpy arrays."""
        pieces, owner = [], []
        for i, text in enumerate(texts):
            for piece in _split_long(text):
                pieces.append(piece)
                owner.append(i)
        if self.kind == "tiktoken":
            encoded = self.backend.encode_ordinary_batch(pieces)
        else:
            fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            encoded = [e.ids for e in fast(pieces, add_special_tokens=False)]
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for i, ids in zip(owner, encoded):
            out[i].append(np.array(ids, dtype=dtype))
        return [parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype)
                for parts in out]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; an id with no token (a model's vocabulary padded past the tokenizer's, tiktoken's
        unused ids) reads as U+FFFD, where Hugging Face's tokenizers drop it silently and tiktoken raises."""
        ids = [int(i) for i in ids]
        known = [self._has(i) for i in ids]
        if all(known):
            return self._decode(ids)
        parts, run = [], []
        for i, has in zip(ids, known):
            if has:
                run.append(i)
            else:
                parts += [self._decode(run), "\ufffd"]
                run = []
        return "".join(parts) + self._decode(run)

    def _decode(self, ids: list[int]) -> str:
        if self.kind == "tiktoken":
            return self.backend.decode(ids)
        return self.backend.decode(ids, skip_special_tokens=False)

    def _has(self, i: int) -> bool:
        if self.kind != "tiktoken":
            return self.backend.id_to_token(i) is not None
        try:
            self.backend.decode_single_token_bytes(i)
        except KeyError:
            return False
        return True

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` (or a record of the tiktoken encoding) into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.kind == "tiktoken":
            target, text = directory / TIKTOKEN_FILE, json.dumps({"tiktoken": self.name}) + "\n"
        else:
            target, text = directory / TOKENIZER_FILE, self.backend.to_str(pretty=True)
        with atomic_path(target) as tmp:
            tmp.write_text(text, encoding="utf-8")
        return target

    def fingerprint(self) -> str:
        """The same for a tokenizer just trained and for its file loaded back (kinds "bpe" and "tokenizers")."""
        backend = "tiktoken" if self.kind == "tiktoken" else "tokenizers"
        body = self.name if self.kind == "tiktoken" else self.backend.to_str()
        return hashlib.sha256(f"{backend}\0{body}".encode()).hexdigest()

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.name, "vocab_size": self.vocab_size,
                "file": TIKTOKEN_FILE if self.kind == "tiktoken" else TOKENIZER_FILE}

    def __repr__(self) -> str:
        return f"HydraTokenizer({self.kind}, {self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size!r} is too small: a byte-level BPE needs at least {MIN_VOCAB} "
                         f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens); 8192 to 50257 is usual")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size={vocab_size} is too large for uint32 token files")


def _hf_cache_dirs() -> Iterator[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        yield Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        yield Path(os.environ["HF_HOME"]) / "hub"
    yield Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface" / "hub"


def find_cached_hf_tokenizer(name: str) -> Path | None:
    """``tokenizer.json`` of a Hugging Face model already in the local hub cache (never downloads)."""
    for cache in _hf_cache_dirs():
        repo = cache / f"models--{name.replace('/', '--')}"
        ref = repo / "refs" / "main"
        if ref.is_file():
            candidate = repo / "snapshots" / ref.read_text().strip() / TOKENIZER_FILE
            if candidate.is_file():
                return candidate
        snapshots = sorted(repo.glob(f"snapshots/*/{TOKENIZER_FILE}"), key=lambda p: p.stat().st_mtime)
        if snapshots:
            return snapshots[-1]
    return None


def load_tokenizer(spec: "str | Path | HydraTokenizer") -> HydraTokenizer:
    """Load a tokenizer from a prepared data directory, a ``tokenizer.json`` (or its directory),
    ``tiktoken:NAME``, or the name of a Hugging Face model already in the local cache."""
    if isinstance(spec, HydraTokenizer):
        return spec
    text = str(spec)
    if text.startswith("tiktoken:"):
        return HydraTokenizer.from_tiktoken(text[len("tiktoken:"):])
    path = Path(text).expanduser()
    if path.is_file():
        if path.name == TIKTOKEN_FILE:
            try:
                name = json.loads(path.read_text(encoding="utf-8"))["tiktoken"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path} is not a tiktoken record ({type(err).__name__}: {err}); expected "
                                 '{"tiktoken": "ENCODING"}: prepare the data again') from None
            return HydraTokenizer.from_tiktoken(name)
        return HydraTokenizer.from_file(path)
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return HydraTokenizer.from_file(path / TOKENIZER_FILE)
        if (path / TIKTOKEN_FILE).is_file():
            return load_tokenizer(path / TIKTOKEN_FILE)
        if (path / META_FILE).is_file():
            raise ValueError(f"{path} was prepared from pre-tokenized shards without a tokenizer, so it has none: "
                             f"prepare it again with tokenizer=... to be able to encode and decode text")
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}: pass a prepared data directory or a tokenizer file")
    cached = find_cached_hf_tokenizer(text)
    if cached is not None:
        return HydraTokenizer.from_file(cached)
    raise ValueError(f"tokenizer {text!r} is not a file, a directory with {TOKENIZER_FILE}, tiktoken:NAME, or a "
                     f"Hugging Face model in the local cache ({next(_hf_cache_dirs())}); downloads are off: fetch "
                     f"it once where there is network (huggingface-cli download {text} {TOKENIZER_FILE}) and pass "
                     f"the file's path")
