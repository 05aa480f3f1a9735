"""Resolve ``prepare_data`` inputs into an ordered list of sources, each a file or a dataset.

Inputs may be files, directories (walked recursively), globs, named local data sets of the original
HYDRA project (``small_chat``, ``nemotron``, ``finefineweb``, found through ``HYDRA_*`` variables),
``hf:NAME[:CONFIG][:SPLIT]``, or nothing, which selects the embedded default corpus: the source
of the running interpreter's standard library, present on every machine without a download.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import readers

DEFAULT_CORPUS_BYTES = 20_000_000
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", "venv", ".tox",
                       ".mypy_cache", ".pytest_cache", ".ipynb_checkpoints", "site-packages", "dist-packages"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
# name -> (variable naming the directory itself, sub-directory of HYDRA_DATA_ROOT)
NAMED_SETS = {
    "small_chat": ("HYDRA_SMALL_CHAT_PT_DIR", "hydra_small_chat_pt"),
    "nemotron": ("HYDRA_NEMOTRON_PT_DIR", "hydra_nemotron_pt"),
    "finefineweb": (None, "hf_finefineweb"),
}
# The seed documents this mount point as the fallback location of its converted shards.
SEED_DEFAULT_ROOT = Path("/mnt/nvme0")


@dataclass(frozen=True)
class Source:
    fmt: str                 # text, jsonl, json, parquet, pt, npy or hf
    key: str                 # stable name: path relative to its input, or the hf: spec
    path: Path | None = None
    size: int = 0
    mtime_ns: int = 0
    explicit: bool = False   # named by the user rather than found in a directory

    @property
    def pretokenized(self) -> bool:
        return self.fmt in ("pt", "npy")

    def fingerprint(self) -> list:
        return [self.fmt, self.key, str(self.path) if self.path else None, self.size, self.mtime_ns]

    def documents(self, text_field: str, strict_text: bool = False, not_utf8: set[Path] | None = None,
                  records_as_text: set[Path] | None = None) -> Iterator[readers.Doc]:
        """``not_utf8`` collects the files whose bytes that are not UTF-8 were replaced by U+FFFD,
        ``records_as_text`` the JSON files of records without ``text_field`` read as text (``readers.iter_json``)."""
        if self.fmt == "hf":
            yield from readers.iter_hf(self.key, text_field)
        elif self.fmt == "hf_disk":
            yield from readers.iter_saved_dataset(self.path, self.key, text_field)
        elif self.fmt == "text":
            text = readers.read_text(self.path, strict=strict_text, not_utf8=not_utf8)
            if text is not None:
                yield self.key, text
        elif self.fmt == "jsonl":
            yield from readers.iter_jsonl(self.path, self.key, text_field, not_utf8)
        elif self.fmt == "json":
            yield from readers.iter_json(self.path, self.key, text_field, self.explicit, not_utf8, records_as_text)
        elif self.fmt == "parquet":
            yield from readers.iter_parquet(self.path, self.key, text_field, not_utf8)
        else:
            yield from readers.iter_token_docs(self.path, self.key, self.fmt)


@dataclass
class Corpus:
    sources: list[Source]
    description: str
    inputs: list[str] | None
    strict_text: bool = False
    notes: dict = field(default_factory=dict)
    skipped: set[Path] = field(default_factory=set)  # files found in directories that turned out binary
    not_utf8: set[Path] = field(default_factory=set)  # files read with U+FFFD in place of bytes that are not UTF-8
    records_as_text: set[Path] = field(default_factory=set)  # JSON records without the text field, read as text
    compressed: set[Path] = field(default_factory=set)  # files in directories compressed in a way that is not read

    @property
    def has_text(self) -> bool:
        return any(not s.pretokenized for s in self.sources)

    @property
    def has_tokens(self) -> bool:
        return any(s.pretokenized for s in self.sources)

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.sources)


def _file_source(path: Path, root: Path, explicit: bool) -> Source | None:
    if path.name.endswith(".idx.npy"):  # the document starts of prepared data, not token shards
        if not explicit:
            return None
        raise ValueError(f"{path} is the document index of prepared data, not token shards: pass the corpus it "
                         f"was prepared from, or train on its directory with --data")
    fmt = readers.detect_format(path)
    if fmt is None:
        if not explicit:
            return None
        if readers.looks_binary(path):
            raise ValueError(f"unknown input type: {path} is neither text nor a supported format; supported: "
                             f"{readers.FORMAT_HELP}")
        fmt = "text"
    st = path.stat()
    return Source(fmt, _source_key(path, root), path, st.st_size, st.st_mtime_ns, explicit)


def _source_key(path: Path, root: Path) -> str:
    """``path`` relative to ``root``, through symlinks; a file linked from outside ``root`` is keyed by its name,
    one reached through a linked directory by the path it has under ``root`` (same-named files stay apart)."""
    real_root = root.resolve()
    try:
        return path.resolve().relative_to(real_root).as_posix()
    except ValueError:
        pass
    parent = path.parent.resolve()
    if real_root != parent and real_root not in parent.parents:
        with contextlib.suppress(ValueError):
            return path.absolute().relative_to(root.absolute()).as_posix()
    return path.name


def _is_prepared(directory: Path) -> bool:
    # A prepared output inside an input tree would otherwise be read back as .npy token shards.
    return (directory / "meta.json").is_file() and (directory / "train.bin").is_file()


def _is_incomplete(directory: Path) -> bool:
    """Shards of a `hydra-lm prepare` that died before writing its ``meta.json``, the file written last."""
    return not (directory / "meta.json").is_file() and all(
        (directory / name).is_file() for name in ("train.bin", "train.idx.npy"))


def _walk(root: Path, skip_test_data: bool = False, saved: list[Path] | None = None) -> Iterator[Path]:
    """Files under ``root``, linked directories included; a directory reached twice (a link back up the tree,
    two links to one place) is read once. ``saved``: collects the Hugging Face datasets saved to disk found below
    ``root`` (``save_to_disk``), whose files are not walked (their metadata is not text, their data not files)."""
    visited = {os.path.realpath(root)}

    def first_visit(directory: Path) -> bool:
        real = os.path.realpath(directory)
        if real in visited:
            return False
        visited.add(real)
        return True

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        rel_parts = Path(dirpath).relative_to(root).parts
        in_tests = any(p in TEST_DIRS for p in rel_parts)
        dirnames[:] = [d for d in sorted(dirnames) if d not in SKIP_DIRS and not d.startswith(".")
                       and not (skip_test_data and in_tests and d.endswith("data"))
                       and not _is_prepared(Path(dirpath) / d) and not _is_incomplete(Path(dirpath) / d)
                       and not (saved is not None and _saved_dataset(Path(dirpath) / d, saved))
                       and first_visit(Path(dirpath) / d)]
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def _saved_dataset(directory: Path, saved: list[Path]) -> bool:
    if readers.is_saved_dataset(directory):
        saved.append(directory)
        return True
    return False


def _saved_dataset_source(root: Path) -> Source:
    files = [p for p in root.rglob("*") if p.is_file()]
    stamp = max((p.stat().st_mtime_ns for p in files), default=0)
    return Source("hf_disk", root.name, root, sum(p.stat().st_size for p in files), stamp)


# Compressed files of kinds that are not read (gzip is): skipped with a warning, not silently.
UNREAD_COMPRESSED = (".bz2", ".xz", ".zst", ".zstd", ".lz4", ".7z", ".zip", ".tar", ".tgz", ".br")


def _dir_sources(root: Path, required: bool = True, compressed: set[Path] | None = None) -> list[Source]:
    """The sources under ``root``; ``required``: none is an error (a directory a glob matched may hold none).
    ``compressed`` collects the files skipped for a compression that is not read."""
    if _is_prepared(root):
        raise ValueError(f"{root} is prepared data (a `hydra-lm prepare` output), not a corpus: train on it with "
                         f"--data {root}, or prepare from the files it was made of")
    if _is_incomplete(root):
        raise ValueError(f"{root} is incomplete `hydra-lm prepare` output (its meta.json is missing: the preparation "
                         f"was interrupted), not a corpus: prepare it again from its corpus")
    if readers.is_saved_dataset(root):
        return [_saved_dataset_source(root)]
    saved: list[Path] = []
    found = []
    for p in _walk(root, saved=saved):
        if not p.is_file():
            continue
        if (s := _file_source(p, root, explicit=False)) is not None:
            found.append(s)
        elif compressed is not None and p.name.lower().endswith(UNREAD_COMPRESSED):
            compressed.add(p)
    found += [_saved_dataset_source(d) for d in saved]
    if not found and required:
        raise ValueError(f"found no supported files under {root}: supported are {readers.FORMAT_HELP}")
    return found


def named_data_dir(name: str) -> Path:
    """Directory of a named data set, from its variable, ``HYDRA_DATA_ROOT``, or the original project's mount."""
    variable, sub = NAMED_SETS[name]
    if variable and os.environ.get(variable):
        path = Path(os.environ[variable]).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{variable}={path} is not a directory: point it at the {sub}/ shards")
        return path
    looked = []
    if os.environ.get("HYDRA_DATA_ROOT"):
        looked.append(Path(os.environ["HYDRA_DATA_ROOT"]).expanduser() / sub)
    looked.append(SEED_DEFAULT_ROOT / sub)
    for path in looked:
        if path.is_dir():
            return path
    how = f"set {variable} to its directory or" if variable else "set"
    raise FileNotFoundError(f"named data set {name!r} not found (looked in {', '.join(map(str, looked))}): {how} "
                            f"HYDRA_DATA_ROOT to the directory that contains {sub}/")


def _named_set(spec: str) -> str | None:
    bare = spec.lower().removeprefix("hydra_").removeprefix("hf_").removesuffix("_pt")
    return bare if bare in NAMED_SETS else None


def _glob_base(pattern: str) -> Path:
    parts = Path(pattern).parts
    stop = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    return Path(*parts[:stop]) if stop else Path(".")


def resolve_inputs(inputs: Sequence[str | Path] | str | Path | None, default_cap: int = DEFAULT_CORPUS_BYTES,
                   exclude: Path | None = None) -> Corpus:
    """Sources of ``inputs`` in a deterministic order; files under ``exclude`` (the output) are left out."""
    if inputs is None:
        return default_corpus(default_cap)
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    inputs = [str(i) for i in inputs]
    if not inputs:
        raise ValueError("inputs is an empty list (--input without paths: an unset shell variable?): pass files, "
                         "directories, globs or hf:NAME, or None (no --input) for the default corpus (the Python "
                         "standard library source)")
    sources: list[Source] = []
    notes: dict = {}
    compressed: set[Path] = set()
    skip = exclude.resolve() if exclude is not None else None
    for spec in inputs:
        path = Path(spec).expanduser()
        # Walking an input that holds the output skips the output; an input named inside it is a mistake.
        if skip is not None and path.exists() and skip in (path.resolve(), *path.resolve().parents):
            raise ValueError(f"input {spec!r} is inside the output directory {exclude}, which is never read as "
                             f"input: move it out, or choose an --out outside the inputs")
        if spec.startswith("hf:"):
            readers.parse_hf_spec(spec)
            sources.append(Source("hf", spec))
            continue
        if glob.has_magic(spec) and not path.exists():
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise FileNotFoundError(f"input pattern {spec!r} matches no files")
            base = _glob_base(str(path))
            for m in map(Path, matches):
                if any(_is_prepared(d) or _is_incomplete(d) for d in (m, *m.parents)):  # an earlier output
                    continue
                below = m.parents[:len(m.relative_to(base).parts) - 1] if m.is_relative_to(base) else ()
                if any(readers.is_saved_dataset(d) for d in below):  # read whole, as its directory's match
                    continue
                if m.is_dir():
                    sources += _dir_sources(m, required=False, compressed=compressed)
                elif (s := _file_source(m, base, explicit=False)) is not None:
                    sources.append(s)
                elif m.name.lower().endswith(UNREAD_COMPRESSED):
                    compressed.add(m)
        elif path.is_dir():
            sources += _dir_sources(path, compressed=compressed)
        elif path.is_file():
            sources.append(_file_source(path, path.parent, explicit=True))
        elif (name := _named_set(spec)) is not None:
            directory = named_data_dir(name)
            notes.setdefault("named_sets", {})[name] = str(directory)
            sources += _dir_sources(directory)
        else:
            raise FileNotFoundError(f"input {spec!r} does not exist: inputs are files, directories, globs, "
                                    f"hf:NAME[:CONFIG][:SPLIT], or a named set ({', '.join(NAMED_SETS)}) found "
                                    f"through HYDRA_DATA_ROOT")
    unique, seen = [], set()
    for s in sources:
        ident = str(s.path.resolve()) if s.path else s.key
        if skip is not None and s.path is not None and skip in s.path.resolve().parents:
            continue
        if ident not in seen:
            seen.add(ident)
            unique.append(s)
    if not unique and sources:
        raise ValueError(f"every input file of {inputs} is inside the output directory {exclude}, which is never "
                         f"read as input: choose an --out outside the inputs")
    if not unique:
        raise ValueError(f"no supported input files in {inputs}: supported are {readers.FORMAT_HELP}")
    return Corpus(unique, f"{len(unique)} source(s) from {', '.join(inputs)}", inputs, notes=notes,
                  compressed=compressed)


def _path_hash(rel: str) -> bytes:
    return hashlib.sha1(rel.encode("utf-8")).digest()


def default_corpus(cap: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """The ``.py`` files of the running interpreter's standard library, at most ``cap`` bytes.

    Files are picked in the order of a hash of their relative path until the cap is reached, so
    the subset covers the whole library rather than its alphabetical head and is identical on
    every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in _walk(root, skip_test_data=True) if p.suffix == ".py" and p.is_file()]
    if not files:
        raise ValueError(f"found no .py files under {root}, the standard library of this interpreter: pass "
                         f"inputs explicitly")
    rels = {p: p.relative_to(root).as_posix() for p in files}
    chosen, total = [], 0
    for p in sorted(files, key=lambda p: _path_hash(rels[p])):
        size = p.stat().st_size
        if total + size <= cap:
            chosen.append(p)
            total += size
    all_bytes = sum(p.stat().st_size for p in files)
    sources = [Source("text", rels[p], p, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(chosen)]
    version = ".".join(map(str, sys.version_info[:3]))
    capped = len(chosen) < len(files)
    description = (f"Python {version} standard library source: {len(chosen)} of {len(files)} .py files, "
                   f"{total:,} of {all_bytes:,} bytes" + (f" (capped at {cap:,} bytes, files chosen by a hash of "
                                                           f"their relative path)" if capped else "")
                   + "; site-packages and test data directories skipped, non-UTF-8 files dropped")
    notes = {"python_version": version, "stdlib": str(root), "files_total": len(files), "files_used": len(chosen),
             "bytes_total": all_bytes, "bytes_used": total, "cap_bytes": cap, "capped": capped}
    return Corpus(sources, description, None, strict_text=True, notes=notes)
