"""Checkpoints: atomic, verifiable, loadable without unpickling arbitrary objects.

Layout of ``RUN_DIR/checkpoints/``::

    hydra_{model_size}_step{N}/model.safetensors   weights (safetensors)
                              /trainer.pt          optimizer state (keyed by parameter name) + torch RNG
                                                   (torch.load weights_only)
                              /state.json          step, configs, curriculum, loader position, Python/NumPy
                                                   RNG, the size + SHA-256 of every other file, and the
                                                   SHA-256 of its own content (``state_digest``)
    latest                                         name of the newest checkpoint (a text file)

A multi-process run writes ``layout: "dcp"`` checkpoints instead (see ``sharded_checkpoint``):
``dcp/`` holds model and optimizer as torch.distributed.checkpoint shards, ``rank{R}.pt`` each
rank's RNG state; ``state.json`` is the same.

A checkpoint is written into a temporary directory that is renamed into place only once every
file is on disk, so a crash mid-save leaves the previous checkpoints untouched. Older ones are
deleted only after a new one is complete and its rename is on disk (the directory synced). A
checkpoint that fails verification on resume is renamed ``*.corrupt`` (kept for inspection) and the
previous one is used.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from ..model.routing import THRESHOLD_BUFFERS
from ..version import __version__


FORMAT_VERSION = 1  # a checkpoint of a newer format is refused (``verify``), not read as this one
STATE_HASH = "state_sha256"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
STATE_FILE = "state.json"
DCP_DIR = "dcp"
LATEST = "latest"
EXPORT_FORMAT = "hydra-lm-export"
_NAME = re.compile(r"^hydra_(?P<size>.+)_step(?P<step>\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the offending file."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(directory: Path) -> int | None:
    """Free space on ``directory``'s filesystem; None where it cannot be read."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def disk_full_error(directory: Path, err: OSError, needed_bytes: int) -> ValueError:
    """One line for a checkpoint that did not fit: where, how much is free, how much it needs."""
    free = free_bytes(directory)
    free = "free space unknown" if free is None else f"{free / 2**20:.1f} MiB free"
    return ValueError(f"no space left on the device while writing a checkpoint to {directory} ({free}, a checkpoint "
                      f"needs about {needed_bytes / 2**20:.1f} MiB): free some space and run again to resume; the "
                      f"earlier checkpoints are intact")


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]

    @property
    def model_file(self) -> Path:
        return self.path if self.layout == "file" else self.path / MODEL_FILE

    @property
    def layout(self) -> str:
        """"single" (one process wrote model.safetensors + trainer.pt), "dcp" (sharded) or "file" (an
        exported model: weights and config only)."""
        return self.state.get("layout", "single")

    @property
    def world_size(self) -> int:
        return int(self.state.get("world_size", 1))

    def load_model(self, model: torch.nn.Module) -> None:
        """Load the weights of a "single" or "file" checkpoint into an ordinary (unsharded) model
        ("dcp" checkpoints: ``sharded_checkpoint.load_dcp``)."""
        if self.layout == "dcp":
            raise CheckpointError(f"checkpoint {self.path} is sharded: load it with sharded_checkpoint.load_dcp")
        try:
            missing, unexpected = load_model(model, str(self.model_file), strict=False)
        except Exception as err:  # safetensors raises its own error types on a damaged header
            raise CheckpointError(f"checkpoint file {self.model_file} cannot be read: {err}") from None
        missing = [k for k in missing if not k.endswith(THRESHOLD_BUFFERS)]
        if missing or unexpected:
            raise CheckpointError(f"checkpoint file {self.model_file} does not match the model: missing "
                                  f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")

    def load_trainer(self, map_location: str | torch.device = "cpu", name: str = TRAINER_FILE) -> dict[str, Any]:
        path = self.path / name
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as err:
            raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's state as JSON reads it back, its own hash left out, keys sorted: of the content,
    whatever the file's formatting."""
    body = {k: v for k, v in state.items() if k != STATE_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Put the renames and new entries of ``directory`` on disk: a rename is durable only then (a crash could
    otherwise undo it after the older checkpoint it replaced was deleted)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a directory cannot be opened on Windows, where a rename is durable by itself
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno != errno.EINVAL:  # EINVAL: a file system that cannot sync a directory
            raise
    finally:
        os.close(fd)


def save_weights(model: torch.nn.Module, filename: Path, metadata: dict[str, str]) -> None:
    """``save_model``, then the file's mode as the process's umask gives every other file: safetensors (0.8) creates
    its files 0600 whatever the umask, which on a shared filesystem keeps an exported model from its readers."""
    save_model(model, str(filename), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(filename, 0o666 & ~umask)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def verify(path: Path) -> Checkpoint:
    """Read ``state.json`` and check it (format version, its own SHA-256, the step against the directory's name) and
    every file it lists (size and SHA-256)."""
    path = Path(path)
    in_checkpoint = path.name == MODEL_FILE and _NAME.match(path.parent.name)  # its state.json lost, not an export
    if path.is_file() and path.suffix == ".safetensors" and not (path.parent / STATE_FILE).is_file() \
            and not in_checkpoint:
        return _exported(path)
    if path.is_file() and path.name in (MODEL_FILE, STATE_FILE, TRAINER_FILE):
        path = path.parent
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a file that is neither a checkpoint directory's file nor an "
                              f"exported .safetensors model: pass a checkpoint directory (a run's "
                              f"checkpoints/hydra_<size>_step<N>)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    state_path = path / STATE_FILE
    if not state_path.is_file():
        if (path / "checkpoints").is_dir() or any(p.is_dir() and _NAME.match(p.name) for p in path.iterdir()):
            raise CheckpointError(f"{path} is a run's directory or its checkpoints directory, not a checkpoint: pass "
                                  "one of its checkpoints (checkpoints/hydra_<size>_step<N>)")
        raise CheckpointError(f"checkpoint file {state_path} is missing (incomplete checkpoint)")
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        step = int(state["step"])
        files = state["files"]
        version = state.get("format", FORMAT_VERSION)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: {err}") from None
    if type(version) is not int:
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: format {version!r} is not a version number")
    if version > FORMAT_VERSION:  # not a CheckpointError: it is not corrupt, and must not be set aside as such
        raise ValueError(f"checkpoint {path} has format {version}, newer than hydra-lm {__version__} reads (up to "
                         f"{FORMAT_VERSION}): upgrade hydra-lm to load it")
    # Checkpoints written before the state's hash have none: their state is not checked.
    digest = state.pop(STATE_HASH, None)
    if digest is not None and digest != state_digest(state):
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: its content does not match its SHA-256")
    named = _NAME.match(_set_aside(path) or path.name)
    if named and int(named["step"]) != step:
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: it records step {step}, its directory's "
                              f"name step {named['step']}")
    if not isinstance(files, dict) or any(".." in Path(n).parts or Path(n).is_absolute() for n in files) or \
            not all(isinstance(i, dict) and isinstance(i.get("bytes"), int) and isinstance(i.get("sha256"), str)
                    for i in files.values()):
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: its file list is malformed")
    # Only listed (hashed) files are read, by name, so anything else beside them (a file manager's .DS_Store, a
    # user's notes) is left alone: refusing it would set a good checkpoint aside. The sharded layout's directory is
    # the exception: its reader takes shards by the names its metadata gives, so a shard slipped in is refused.
    unlisted = sorted(p.relative_to(path).as_posix() for p in (path / DCP_DIR).rglob("*")
                      if not p.is_dir() and p.relative_to(path).as_posix() not in files)
    if unlisted:
        raise CheckpointError(f"checkpoint {path} holds files that {STATE_FILE} does not list: {unlisted[:5]}")
    if state.get("layout") == "dcp" and f"{DCP_DIR}/.metadata" not in files:
        raise CheckpointError(f"checkpoint {path} is sharded but {STATE_FILE} does not list {DCP_DIR}/.metadata")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupt: {size} bytes, "
                                  f"expected {info['bytes']}")
        if _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupt: its SHA-256 does not match state.json")
    return Checkpoint(path, step, state)


def _exported(path: Path) -> Checkpoint:
    """A file written by ``hydra-lm export``: weights plus the configs in the safetensors metadata."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != EXPORT_FORMAT:
            raise CheckpointError(f"{path} is not a hydra-lm export (metadata format {meta.get('format')!r})")
        state = {"layout": "file", "model_config": json.loads(meta["model_config"]),
                 "train_config": json.loads(meta.get("train_config", "{}")), "data": json.loads(meta.get("data", "{}")),
                 "curriculum": json.loads(meta.get("curriculum", "null"))}
        return Checkpoint(path, int(meta["step"]), state)
    except CheckpointError:
        raise
    except Exception as err:  # a damaged header or metadata
        raise CheckpointError(f"exported model {path} cannot be read: {err}") from None


def _set_aside(path: Path) -> str | None:
    """The checkpoint name of ``path`` if it is a complete checkpoint that ``commit``'s swap of a step saved again
    set aside (``.old-NAME-PID``) and a crash kept from coming back (no ``NAME`` beside it), else None."""
    if not path.name.startswith(".old-"):
        return None
    name = path.name[len(".old-"):].rsplit("-", 1)[0]
    return name if _NAME.match(name) and not (path.parent / name).exists() else None


class CheckpointManager:
    def __init__(self, directory: str | Path, model_size: str, keep: int = 3,
                 warn: Callable[[str], None] | None = None):
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():  # else the run would fail at its first save
            raise ValueError(f"{self.dir} is not a directory, so checkpoints cannot be saved there: move it away or "
                             "use another run directory (--out)")
        self.model_size = model_size
        self.keep = keep
        self.warn = warn or (lambda msg: None)

    def name(self, step: int) -> str:
        return f"hydra_{self.model_size}_step{step}"

    def list(self) -> list[tuple[int, Path]]:
        """Complete-looking checkpoints, oldest first (one that a crash left set aside, ``_set_aside``, under the
        set-aside name that ``cleanup_temp`` undoes)."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _NAME.match(_set_aside(p) or p.name)
            if m and p.is_dir():
                found.append((int(m["step"]), p))
        return sorted(found)

    def save(self, step: int, model: torch.nn.Module, trainer_tensors: dict[str, Any], state: dict[str, Any],
             write_extra: Callable[[Path], None] | None = None) -> Path:
        """One process: weights as safetensors, ``trainer_tensors`` (optimizer, RNG) as trainer.pt;
        ``write_extra`` adds files of its own to the directory (listed and hashed like the rest)."""
        tmp = self.begin(step, f"{os.getpid()}")
        try:
            save_weights(model, tmp / MODEL_FILE, metadata={"format": "hydra-lm", "step": str(step)})
            torch.save(trainer_tensors, tmp / TRAINER_FILE)
            if write_extra is not None:
                write_extra(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.commit(tmp, step, state)

    def begin(self, step: int, tag: str) -> Path:
        """A fresh temporary directory for checkpoint ``step`` (renamed into place by ``commit``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".tmp-{self.name(step)}-{tag}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, state: dict[str, Any]) -> Path:
        """Record size + SHA-256 of every file in ``tmp``, write state.json, rename into place."""
        final = self.dir / self.name(step)
        try:
            files = {}
            paths = sorted(p for p in tmp.rglob("*") if p.is_file())
            for f in paths:
                _fsync(f)
                files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for d in sorted({f.parent for f in paths} - {tmp}):  # dcp/ (tmp itself: with state.json below)
                _fsync_dir(d)
            full = {"format": FORMAT_VERSION, "step": step, "files": files, "saved_at": time.time(), **state}
            full = json.loads(json.dumps(full))  # as verify reads it back: tuples as lists, keys as strings
            full[STATE_HASH] = state_digest(full)
            write_text_atomic(tmp / STATE_FILE, json.dumps(full, indent=1))
            old = None
            if final.exists():  # same step saved again (e.g. interrupted right after a periodic save)
                old = self.dir / f".old-{final.name}-{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(self.dir)  # on disk before anything older is deleted
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_text_atomic(self.dir / LATEST, final.name + "\n")
        self._rotate(keep_path=final)
        return final

    def _rotate(self, keep_path: Path) -> None:
        ckpts = [p for _, p in self.list() if p != keep_path]
        excess = len(ckpts) + 1 - self.keep
        for p in ckpts[:max(0, excess)]:
            shutil.rmtree(p, ignore_errors=True)

    def latest_good(self, before: int | None = None) -> Checkpoint | None:
        """Newest checkpoint that verifies (of a step below ``before``, where given); broken newer ones are reported
        (and renamed *.corrupt)."""
        errors = []
        candidates = [path for step, path in reversed(self.list()) if before is None or step < before]
        for i, path in enumerate(candidates):
            try:
                ckpt = verify(path)
            except CheckpointError as err:
                errors.append(str(err))
                self.warn(f"{err}; " + ("falling back to the previous checkpoint" if i + 1 < len(candidates) else
                                        "set aside as corrupt, and no earlier checkpoint is left"))
                # A name of its own: left in place beside an earlier one of its step, it would stay in list(),
                # counted by the rotation and warned about at every resume.
                bad, n = path.with_name(f"{path.name}.corrupt"), 2
                while bad.exists():
                    bad, n = path.with_name(f"{path.name}.corrupt{n}"), n + 1
                os.replace(path, bad)
                continue
            if errors:
                write_text_atomic(self.dir / LATEST, path.name + "\n")
            return ckpt
        if errors:
            raise CheckpointError(f"no readable checkpoint in {self.dir}: " + "; ".join(errors))
        return None

    def quarantined(self) -> list[Path]:
        """Checkpoints ``latest_good`` set aside as ``*.corrupt``."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("hydra_*.corrupt*") if p.is_dir())

    def cleanup_temp(self) -> None:
        """Remove half-written checkpoints left by a crash (never complete ones), and put back a complete one
        that a crash left set aside in the middle of ``commit``'s swap of a step saved again."""
        if not self.dir.is_dir():
            return
        for p in self.dir.glob(".tmp-hydra_*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob(f".{LATEST}.tmp-*"):  # write_text_atomic's, cut short before its rename
            p.unlink(missing_ok=True)
        for old in self.dir.glob(".old-hydra_*"):
            name = _set_aside(old)
            if name is not None:
                os.replace(old, self.dir / name)
                _fsync_dir(self.dir)
            else:  # the swap finished; only its removal was cut short
                shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(run_dir: str | Path, checkpoint: str | Path | None = None,
                       warn: Callable[[str], None] | None = None) -> Checkpoint:
    """The checkpoint to evaluate or sample from: an explicit path (or, where none is there, a name in the run's
    checkpoints directory), else the run's newest good one (``warn`` hears about every newer one skipped, and why)."""
    ckdir = Path(run_dir) / "checkpoints"
    if checkpoint is not None:
        path = Path(checkpoint).expanduser()
        if not path.exists() and not path.is_absolute():
            if not (ckdir / path).exists():
                raise CheckpointError(f"checkpoint {path} does not exist, here or in {ckdir}")
            path = ckdir / path
        return verify(path)
    found = CheckpointManager(ckdir, "").list()
    errors = []
    for _, path in reversed(found):
        try:
            ckpt = verify(path)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if errors and warn is not None:
            warn(f"using the older checkpoint {path} (step {ckpt.step}): newer ones are unusable: " + "; ".join(errors))
        return ckpt
    if errors:
        raise CheckpointError(f"no readable checkpoint in {ckdir}: " + "; ".join(errors))
    raise CheckpointError(f"run {run_dir} has no checkpoint in {ckdir}")


# ---------------------------------------------------------------------- RNG state
def capture_rng() -> tuple[dict[str, Any], dict[str, Any]]:
    """(JSON-able Python/NumPy state, tensors for torch.save) of every RNG the run uses."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    json_part = {"python": [version, list(internal), gauss],
                 "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    return json_part, tensors


def restore_rng(json_part: dict[str, Any], tensors: dict[str, Any]) -> None:
    version, internal, gauss = json_part["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json_part["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        states = tensors["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
