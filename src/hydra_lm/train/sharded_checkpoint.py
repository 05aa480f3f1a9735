"""Multi-process checkpoints through torch.distributed.checkpoint (DCP), and loading any layout into
a sharded or ordinary model.

Saving (every rank): model and optimizer state go to ``dcp/`` as shards (each rank writes its own;
replicated DDP tensors once), each rank's RNG to ``rank{R}.pt``; rank 0 then hashes the files,
writes ``state.json`` and renames the directory into place, exactly like a single-process save, so
an interrupted save never damages the previous checkpoint. ``async_save`` stages the tensors to
host memory and writes in a background thread; the checkpoint is committed at the next save or at
the end of the run.

Loading goes through ``get_state_dict`` / ``set_state_dict``, which reshard: a checkpoint written
by W ranks loads on any number of ranks (or one process), FSDP2 or DDP.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..model.routing import THRESHOLD_BUFFERS
from .checkpoint import DCP_DIR, MODEL_FILE, TRAINER_FILE, Checkpoint, CheckpointError, CheckpointManager
from .distributed import DistInfo, barrier
from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner


RANK_FILE = "rank{}.pt"


class ShardedSaver:
    def __init__(self, manager: CheckpointManager, info: DistInfo, use_async: bool = False,
                 log: Callable[[str], None] = lambda message: None):
        self.manager, self.info, self.use_async, self.log = manager, info, use_async, log
        self._pending: tuple[Any, Path, int, dict] | None = None
        # An asynchronous save's collectives run in DCP's background thread while the main thread's agreement
        # collectives (stop signals, barriers) go on: on one group the two interleave, which hung or mismatched
        # under torchrun. So it gets a gloo group of its own (created on every rank, as every rank builds a saver).
        self._async_group = torch.distributed.new_group(backend="gloo") \
            if use_async and torch.distributed.is_initialized() else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, rank_tensors: dict[str, Any],
             state: dict[str, Any]) -> Path:
        """Collective: every rank calls it at the same step. Returns the (future) checkpoint path."""
        self.finish()
        info = self.info
        tmp = self.manager.dir / f".tmp-{self.manager.name(step)}-dist"
        if info.is_main:
            tmp = self.manager.begin(step, "dist")
        barrier(info)
        torch.save(rank_tensors, tmp / RANK_FILE.format(info.rank))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        payload = {"model": model_sd, "optim": optim_sd}
        state = {**state, "layout": "dcp", "world_size": info.world_size, "parallel": info.parallel}
        with self._removed_on_failure(tmp):
            if self.use_async:
                future = dcp.async_save(payload, checkpoint_id=str(tmp / DCP_DIR), process_group=self._async_group)
                self._pending = (future, tmp, step, state)
            else:
                dcp.save(payload, checkpoint_id=str(tmp / DCP_DIR))
                self._commit(tmp, step, state)
        return self.manager.dir / self.manager.name(step)

    def finish(self) -> None:
        """Commit a pending asynchronous save (collective; a no-op when none is pending)."""
        if self._pending is None:
            return
        future, tmp, step, state = self._pending
        self._pending = None
        with self._removed_on_failure(tmp):
            # Newer torch returns a response object whose upload future is the one to wait for.
            (getattr(future, "upload_completion", None) or future).result()
            self._commit(tmp, step, state)
        self.log(f"saved checkpoint {self.manager.dir / self.manager.name(step)}")  # on disk only now

    @contextlib.contextmanager
    def _removed_on_failure(self, tmp: Path):
        """A failed save's partial files go at once (on a full disk they hold the space the next save needs)."""
        try:
            yield
        except BaseException:  # DCP's CheckpointException is one
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _commit(self, tmp: Path, step: int, state: dict[str, Any]) -> None:
        barrier(self.info)  # every rank's files are on disk
        if self.info.is_main:
            self.manager.commit(tmp, step, state)
        barrier(self.info)  # nobody starts the next save (or exits) before the rename


def load_dcp(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             distributed: bool = False) -> None:
    """Load a ``dcp`` checkpoint into ``model`` (and ``optimizer``), resharding as needed."""
    path = str(ckpt.path / DCP_DIR)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        payload = {"model": model_sd, "optim": optim_sd}
    else:
        payload = {"model": get_model_state_dict(model)}
    reader = SafeFileSystemReader(path)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as err:  # unpickling errors of every kind, or an entry outside the allowlist
        raise CheckpointError(f"checkpoint file {path}/.metadata is not safe to load or corrupt: {err}") from None
    try:
        # Parameters that never had a gradient (routers the curriculum kept off) have no optimizer
        # state in the checkpoint: load what exists, and drop the rest below.
        with warnings.catch_warnings():  # one process reading a sharded checkpoint is intended here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=True),
                     no_dist=not distributed)
    except (Exception, CheckpointException) as err:  # DCP's own error (a BaseException) wraps each rank's
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {_reason(err)}") from None
    missing = [f"model.{k}" for k in payload["model"]
               if f"model.{k}" not in saved and not k.endswith(THRESHOLD_BUFFERS)]
    if missing:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:5]}")
    set_model_state_dict(model, payload["model"])
    if optimizer is not None:
        prefix = "optim.state."
        with_state = {k[len(prefix):].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)}
        set_optimizer_state_dict(model, optimizer, payload["optim"])
        _drop_state_not_in(model, optimizer, with_state)


def _rank_errors(err: BaseException) -> list[BaseException]:
    """Each failed rank's exception inside DCP's error (a CheckpointException, which pairs each with its traceback);
    none for another error."""
    return [f[0] if isinstance(f, tuple) else f for f in (getattr(err, "failures", None) or {}).values()]


def os_error(err: BaseException) -> OSError | None:
    """``err`` if an OSError, else the first failed rank's OSError inside DCP's error; None if neither."""
    return next((e for e in (err, *_rank_errors(err)) if isinstance(e, OSError)), None)


def _reason(err: Exception) -> str:
    """One line out of DCP's error, which wraps each rank's exception with its traceback."""
    err = next(iter(_rank_errors(err)), err)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # A refused weights-only pickle explains itself on the line naming the global.
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(err).__name__)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                   full: bool = False) -> None:
    """A name-keyed optimizer state dict (``get_optimizer_state_dict``) into ``optimizer``; ``full``:
    unsharded tensors into an FSDP2 model."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=full, strict=False))
    _drop_state_not_in(model, optimizer, set(state.get("state", {})))


def _drop_state_not_in(model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str]) -> None:
    """Loading initialises every parameter's state; a parameter with none saved must start fresh
    at its first gradient, as it would have in the uninterrupted run."""
    for name, p in model.named_parameters():
        if name not in names:
            optimizer.state.pop(p, None)


def load_single_into_sharded(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer,
                             trainer: dict[str, Any]) -> None:
    """A one-process checkpoint (full tensors) into an FSDP2-sharded model and its optimizer."""
    try:
        full = load_file(str(ckpt.path / MODEL_FILE))
    except Exception as err:
        raise CheckpointError(f"checkpoint file {ckpt.path / MODEL_FILE} cannot be read: {err}") from None
    for name in get_model_state_dict(model):  # safetensors stores a tied weight once, under one of its names
        if name not in full:
            alias = _tied_alias(model, name)
            if alias in full:
                full[name] = full[alias]
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    if "optimizer" not in trainer:
        raise CheckpointError(f"checkpoint file {ckpt.path / TRAINER_FILE} has no optimizer state")
    load_optimizer(model, optimizer, trainer["optimizer"], full=True)


def _tied_alias(model: nn.Module, name: str) -> str | None:
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    if target is None:
        return None
    return next((n for n, p in params.items() if p is target and n != name), None)
