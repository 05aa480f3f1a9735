"""``prepare_data``: a corpus in, token shards + tokenizer + ``meta.json`` out (see ``shards.py``)."""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .readers import NotText
from .shards import (
    FORMAT_VERSION,
    META_FILE,
    PREPARE_LOCK,
    SPLITS,
    SplitWriter,
    bin_path,
    content_digest,
    exclusive_lock,
    idx_path,
    read_meta,
    remove_stale_temp_files,
    token_dtype,
    write_json_atomic,
)
from .sources import DEFAULT_CORPUS_BYTES, Corpus, resolve_inputs
from .tokenizer import TIKTOKEN_FILE, TOKENIZER_FILE, HydraTokenizer, check_vocab_size, load_tokenizer

# Enough text per encode_arrays call to keep the Rust thread pool busy, little enough to bound memory.
_BATCH_DOCS, _BATCH_CHARS = 512, 16 << 20
# BPE merges stop improving long before a large corpus is exhausted; training on a bounded sample
# keeps tokenizer training time and memory flat however big the corpus is.
DEFAULT_TOKENIZER_SAMPLE_BYTES = 200_000_000


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[hydra-lm prepare] {msg}", flush=True)


def in_val(key: str, seed: int, val_fraction: float) -> bool:
    """Hold-out decision from a hash of (seed, document key): stable across machines and runs."""
    if val_fraction <= 0:
        return False
    h = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < val_fraction


def _documents(corpus: Corpus, text_field: str, max_bytes: int | None) -> Iterator[tuple[int, str, object]]:
    """``(source index, key, payload)`` in corpus order, stopping once ``max_bytes`` were read.

    Text counts its UTF-8 bytes, token arrays 4 bytes per token; the document that would cross
    the cap is left out, except a first one, so a tiny cap still yields data. A binary file found
    in a directory is skipped (and noted in ``corpus.skipped``); one named explicitly is an error.
    """
    used = 0
    for si, source in enumerate(corpus.sources):
        try:
            for key, payload in source.documents(text_field, corpus.strict_text, corpus.not_utf8,
                                                 corpus.records_as_text):
                if max_bytes is not None:
                    size = len(payload.encode("utf-8")) if isinstance(payload, str) else 4 * len(payload)
                    if used and used + size > max_bytes:
                        return
                    used += size
                yield si, key, payload
        except NotText:
            if source.explicit:
                raise
            corpus.skipped.add(source.path)


def _check_options(vocab_size, val_fraction, seed, max_bytes, text_field) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1); 0.01 to 0.05 is usual")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive integer (or None for no cap)")
    if not text_field:
        raise ValueError("text_field must name the field that holds the text, e.g. 'text'")
    check_vocab_size(vocab_size)


def run_files_in(out: Path) -> list[str]:
    """The files of a training run that ``out`` holds (names as train/run.py writes them): empty if none."""
    return [name for name, is_there in (("config.json", (out / "config.json").is_file()),
                                        ("checkpoints/", (out / "checkpoints").is_dir())) if is_there]


def _check_not_a_run(out: Path) -> None:
    """A run directory keeps a copy of its data's tokenizer, which generation decodes with: preparing into it would
    replace that copy with another tokenizer."""
    found = run_files_in(out)
    if found:
        raise ValueError(f"{out} holds a training run ({', '.join(found)}): preparing data there would replace the "
                         "run's tokenizer.json; choose another --out")


def _fingerprint(corpus: Corpus, options: dict, tokenizer_id: str) -> str:
    body = {"format": FORMAT_VERSION, "options": options, "tokenizer": tokenizer_id,
            "inputs": [s.fingerprint() for s in corpus.sources], "notes": corpus.notes}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _up_to_date(out: Path, fingerprint: str) -> bool:
    try:
        meta = read_meta(out)
    except (FileNotFoundError, ValueError):
        return False
    if meta.get("fingerprint") != fingerprint:
        return False
    itemsize = np.dtype(meta["dtype"]).itemsize
    if meta.get("tokenizer") and not (out / meta["tokenizer"]["file"]).is_file():
        return False
    return all(bin_path(out, s).is_file() and idx_path(out, s).is_file()
               and bin_path(out, s).stat().st_size == info["tokens"] * itemsize
               for s, info in meta["splits"].items())


def _cut(n: int, val_fraction: float) -> int:
    """Where a corpus of one document, ``n`` characters or tokens long, is cut: its head trains, its last
    ``val_fraction`` validates; a document too short to cut trains whole."""
    return n - max(1, int(n * val_fraction)) if n >= 2 else n


def _training_texts(corpus, text_field, max_bytes, seed, val_fraction, sample_bytes) -> Iterator[str]:
    """Up to ``sample_bytes`` of the text that ends up in the train split, ``_fill_an_empty_split`` included,
    so that no validation text shapes the tokenizer.

    The latest train document is held back until a later document shows that it stays in train: where the
    hash split leaves validation empty, the last train document moves there."""
    used, n_train, n_val = 0, 0, 0
    held = last = None
    for _, key, text in _documents(corpus, text_field, max_bytes):
        if not text.strip():
            continue
        if held is not None:
            yield held
            used += len(held.encode("utf-8"))  # bytes, as max_bytes counts them (a CJK character is 3)
            if used >= sample_bytes:
                return
            held = None
        last = text
        if in_val(key, seed, val_fraction):
            n_val += 1
        else:
            n_train, held = n_train + 1, text
    if n_train + n_val == 1 and val_fraction > 0:  # one document: its head trains
        yield last[:_cut(len(last), val_fraction)]
    elif n_train == 0 and n_val:  # every document hashed into validation: the last one trains
        yield last
    elif held is not None and (n_val or val_fraction <= 0):
        yield held


def _skipped_hint(corpus: Corpus) -> str:
    if not corpus.skipped:
        return ""
    return (f" ({len(corpus.skipped)} file(s) were skipped as binary or UTF-16, e.g. {min(corpus.skipped)}: convert "
            f"them to UTF-8)")


def _train_tokenizer(corpus, text_field, max_bytes, seed, val_fraction, vocab_size, sample_bytes, progress):
    stream = _training_texts(corpus, text_field, max_bytes, seed, val_fraction, sample_bytes)
    first = next(stream, None)
    if first is None:
        raise ValueError(f"no training text in {corpus.description}: the inputs are empty{_skipped_hint(corpus)}; "
                         f"add text")
    _log(progress, f"training a byte-level BPE tokenizer (vocab {vocab_size})")
    return HydraTokenizer.train(_chain(first, stream), vocab_size, progress)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _scan_token_vocab(corpus: Corpus) -> int:
    """Vocabulary of tokenizer-less shards: what they declare, or else their largest id + 1."""
    from .readers import load_token_docs

    size = 0
    for s in corpus.sources:
        docs, declared = load_token_docs(s.path, s.fmt)
        top = max((int(d.max()) + 1 for d in docs if len(d)), default=0)
        size = max(size, top, declared or 0)
    return size


def prepare_data(inputs: Sequence[str | Path] | str | Path | None, out_dir: str | Path, vocab_size: int = 8192,
                 tokenizer: "str | Path | HydraTokenizer | None" = None, val_fraction: float = 0.02, seed: int = 0,
                 text_field: str = "text", max_bytes: int | None = None, progress: bool = True, *,
                 force: bool = False, tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES) -> Path:
    """Turn a corpus into ``train``/``val`` token shards, a tokenizer and ``meta.json`` in ``out_dir``.

    ``inputs``: files, directories, globs, ``small_chat``/``nemotron`` (via ``HYDRA_DATA_ROOT``),
    ``hf:NAME[:CONFIG][:SPLIT]``, or None for the Python standard library source (capped at
    ``max_bytes``, default 20 MB). ``tokenizer``: None trains a byte-level BPE of ``vocab_size``;
    otherwise a ``tokenizer.json`` or its directory, ``tiktoken:NAME``, or a cached HF model name.
    Pre-tokenized ``.pt``/``.npy`` inputs without a tokenizer are stored as-is, with a separator id
    appended after their vocabulary. The validation split holds out whole documents by a hash of
    ``(seed, key)``, where a key is a path relative to its input (``path#n`` for records).
    Re-running with the same inputs and options does nothing unless ``force``. Of several processes
    preparing one directory at once, one prepares it while the others wait for it.
    """
    start = time.perf_counter()
    out = Path(out_dir).expanduser()
    _check_options(vocab_size, val_fraction, seed, max_bytes, text_field)
    corpus = resolve_inputs(inputs, default_cap=max_bytes or DEFAULT_CORPUS_BYTES, exclude=out)
    if inputs is None:
        max_bytes = None  # the default corpus applied the cap when choosing its files
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is None and corpus.has_text and corpus.has_tokens:
        raise ValueError("inputs mix text and pre-tokenized shards: pass tokenizer=... (the one the shards were "
                         "made with) so both end up in the same vocabulary")
    options = {"vocab_size": vocab_size, "val_fraction": val_fraction, "seed": seed, "text_field": text_field,
               "max_bytes": max_bytes, "tokenizer_sample_bytes": tokenizer_sample_bytes}
    fingerprint = _fingerprint(corpus, options, tok.fingerprint() if tok else "train" if corpus.has_text else "as-is")

    def prepared() -> bool:
        if force or not _up_to_date(out, fingerprint):
            return False
        _log(progress, f"{out} is already prepared from the same inputs and options (fingerprint "
                       f"{fingerprint[:12]}): skipped")
        return True

    if prepared():  # without the lock, which a read-only directory could not hold
        return out
    _check_not_a_run(out)
    out.mkdir(parents=True, exist_ok=True)
    # Every rank of a torchrun given --dataset prepares the same directory: the first to take the lock prepares
    # it, the others wait, then find it prepared.
    with exclusive_lock(out / PREPARE_LOCK, lambda: _log(progress, f"waiting for another process preparing {out}")):
        if not prepared():
            _warn_replacing(out)
            remove_stale_temp_files(out)  # of a preparation that was killed
            _build(out, corpus, tok, options, fingerprint, start, progress)
    return out


def _warn_replacing(out: Path) -> None:
    """Data already prepared in ``out`` from other inputs or options is about to be replaced: runs trained on it go on
    only if the new tokens come out the same, so say so, whatever the progress setting."""
    try:
        meta = read_meta(out)
    except (OSError, ValueError):
        return
    print(f"[hydra-lm prepare] warning: replacing the data prepared in {out} (vocabulary {meta.get('vocab_size')}) "
          "from other inputs or options; runs trained on it resume only if its tokens come out the same (a touched "
          "corpus does; another corpus or --vocab_size does not): use another --out to keep it", file=sys.stderr,
          flush=True)


def _build(out: Path, corpus: Corpus, tok: HydraTokenizer | None, options: dict, fingerprint: str, start: float,
           progress: bool) -> None:
    _log(progress, f"preparing {out} from {corpus.description}")
    text_field, max_bytes, seed, val_fraction = (options[k] for k in ("text_field", "max_bytes", "seed",
                                                                      "val_fraction"))
    if tok is None and corpus.has_text:
        tok = _train_tokenizer(corpus, text_field, max_bytes, seed, val_fraction, options["vocab_size"],
                               options["tokenizer_sample_bytes"], progress)
    if tok is not None:
        vocab, eos_id, bos_id, pad_id = tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id
    else:
        eos_id = _scan_token_vocab(corpus)  # the separator takes the first id after the shards' own
        vocab, bos_id, pad_id = eos_id + 1, eos_id, eos_id
    dtype = token_dtype(vocab)
    ids_from = f"tokenizer {tok.name}" if tok is not None else "the token shards"
    writers = {s: SplitWriter(out, s, dtype, eos_id, vocab, ids_from) for s in SPLITS}
    try:
        filled = _encode_all(corpus, tok, writers, text_field, max_bytes, seed, val_fraction, vocab, progress)
        if writers["train"].documents == 0:
            raise ValueError(f"no training documents in {corpus.description}: the inputs hold no text"
                             f"{_skipped_hint(corpus)}; add data")
        # Only now does the old output start to be replaced: drop its meta.json first so that, if
        # this run dies halfway, no stale meta.json vouches for half-replaced shards.
        (out / META_FILE).unlink(missing_ok=True)
        splits = {s: w.finish() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if corpus.skipped:
        print(f"[hydra-lm prepare] warning: skipped {len(corpus.skipped)} file(s) that look binary or UTF-16, e.g. "
              f"{min(corpus.skipped)}: convert them to UTF-8 to include them", file=sys.stderr, flush=True)
    if corpus.not_utf8:
        print(f"[hydra-lm prepare] warning: {len(corpus.not_utf8)} file(s) are not valid UTF-8, e.g. "
              f"{min(corpus.not_utf8)}: their undecodable bytes became U+FFFD replacement characters; convert them "
              f"to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8) to keep their text exact", file=sys.stderr, flush=True)
    if corpus.compressed:
        print(f"[hydra-lm prepare] warning: skipped {len(corpus.compressed)} compressed file(s) of a kind that is "
              f"not read, e.g. {min(corpus.compressed)}: decompress them, or recompress them with gzip (.gz), to "
              "include them", file=sys.stderr, flush=True)
    if corpus.records_as_text:
        print(f"[hydra-lm prepare] warning: {len(corpus.records_as_text)} .json file(s) hold records without a "
              f"{text_field!r} field, e.g. {min(corpus.records_as_text)}: each was read whole as text, JSON syntax and "
              "all; if they are data, pass --text_field NAME (the field that holds the text)", file=sys.stderr,
              flush=True)
    for stale in (TOKENIZER_FILE, TIKTOKEN_FILE):
        (out / stale).unlink(missing_ok=True)
    if tok is not None:
        tok.save(out)
    from ..version import __version__

    meta = {
        "format_version": FORMAT_VERSION, "hydra_lm_version": __version__, "fingerprint": fingerprint,
        "content_sha256": content_digest(out, tok.fingerprint() if tok is not None else None, vocab, eos_id),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "vocab_size": vocab,
        "vocab_size_requested": options["vocab_size"] if tok is not None and tok.kind == "bpe" else None,
        "dtype": dtype.name, "eos_id": eos_id, "bos_id": bos_id, "pad_id": pad_id,
        "tokenizer": tok.describe() if tok is not None else None,
        "splits": splits, "num_documents": sum(v["documents"] for v in splits.values()),
        "token_counts": {s: v["tokens"] for s, v in splits.items()},
        "source": {"description": corpus.description, "inputs": corpus.inputs, **corpus.notes},
        "options": options,
        "val_holdout": ("documents whose blake2b hash of (seed, key) falls below val_fraction; key = path relative "
                        "to its input, path#n for the n-th record" + filled),
        "layout": "each document is [eos] + tokens; the stream ends with one extra eos; idx = document starts",
        "seconds": round(time.perf_counter() - start, 2),
    }
    write_json_atomic(out / META_FILE, meta)
    _log(progress, f"done in {meta['seconds']:.1f}s: vocab {vocab} ({dtype.name}), train {splits['train']['tokens']:,} "
                   f"tokens / {splits['train']['documents']:,} docs, val {splits['val']['tokens']:,} tokens / "
                   f"{splits['val']['documents']:,} docs")


def _encode_all(corpus, tok, writers, text_field, max_bytes, seed, val_fraction, vocab, progress) -> str:
    """Stream every document into its split's writer; returns what filled an empty split ("" if nothing)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=corpus.total_bytes or None, unit="B", unit_scale=True, desc="encode", disable=not progress)
    try:  # closed on an error too: a bar left open redraws over the error line
        pending: list[tuple[bool, str]] = []
        pending_chars = 0
        done_source = 0
        last_text = None  # the latest document if it is text: a corpus of one text document is cut in characters

        def flush() -> None:
            nonlocal pending, pending_chars
            if pending:
                for (is_val, _), ids in zip(pending, tok.encode_arrays([t for _, t in pending])):
                    writers["val" if is_val else "train"].add(ids)
                pending, pending_chars = [], 0

        for si, key, payload in _documents(corpus, text_field, max_bytes):
            while done_source < si:
                bar.update(corpus.sources[done_source].size)
                done_source += 1
            is_val = in_val(key, seed, val_fraction)
            if isinstance(payload, str):
                if payload.strip():
                    pending.append((is_val, payload))
                    pending_chars += len(payload)
                    last_text = payload
                    if len(pending) >= _BATCH_DOCS or pending_chars >= _BATCH_CHARS:
                        flush()
                continue
            flush()  # keep corpus order when text and token documents interleave
            if len(payload) == 0:
                continue
            top = int(payload.max())
            if top >= vocab:
                raise ValueError(f"{corpus.sources[si].path}: token id {top} >= vocab size {vocab} of the tokenizer: "
                                 f"these shards were made with another tokenizer; pass the matching one")
            writers["val" if is_val else "train"].add(payload)
            last_text = None
        flush()
        bar.update(sum(s.size for s in corpus.sources[done_source:]))
    finally:
        bar.close()
    return _fill_an_empty_split(writers, val_fraction, tok, last_text)


def _fill_an_empty_split(writers, val_fraction: float, tok, last_text: str | None) -> str:
    """Where the hash split left a split empty, give it a document: the other split's last one, or, of a corpus of
    one document (a single text file or token stream), its last ``val_fraction`` for validation. Returns what was
    done, for meta.json ("" if nothing). ``_training_texts`` follows the same rules."""
    train, val = writers["train"], writers["val"]
    if val_fraction <= 0 or bool(train.documents) == bool(val.documents):  # both hold documents, or neither
        return ""
    full, empty = (train, val) if train.documents else (val, train)
    if full.documents >= 2:
        empty.add(full.take_pending())
        return f"; none fell into {empty.split}, so the last document was moved there"
    ids = full.take_pending()
    if last_text is not None:  # cut where the tokenizer's training text ended
        cut = _cut(len(last_text), val_fraction)
        head, tail = tok.encode_arrays([last_text[:cut], last_text[cut:]])
    else:
        cut = _cut(len(ids), val_fraction)
        head, tail = ids[:cut], ids[cut:]
    train.add(head)
    if not len(tail):
        return "; the corpus is one document, too short to cut, so all of it is in train"
    val.add(tail)
    return f"; the corpus is one document, so its last {len(tail)} tokens are the validation split"
