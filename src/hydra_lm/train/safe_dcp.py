"""Reading torch.distributed.checkpoint (DCP) shards without running code from the files.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle`` and the
default load planner reads non-tensor entries (optimizer hyper-parameters) with
``torch.load(weights_only=False)``: a crafted checkpoint would run arbitrary code on load. DCP
offers no restricted reader, so ``.metadata`` goes through an unpickler that resolves only the
metadata classes DCP writes (plus dtypes, layouts, ``torch.Size`` and paths), and byte entries
through ``torch.load(weights_only=True)``. Every shard the metadata points at must be a plain file
name inside the checkpoint directory.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

# (module, name) -> object: everything a DCP .metadata file of torch 2.x refers to, and nothing
# that can run code beyond building these plain records.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
       for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): dict,
}


class UnsafeMetadataError(ValueError):
    """The metadata names something outside the allowlist (never resolved, never called)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"refers to {module}.{name}, which a checkpoint's metadata never holds")


def read_metadata_safely(path: str | pathlib.Path) -> dcp_metadata.Metadata:
    """The ``Metadata`` of a DCP directory's ``.metadata`` file, through the allowlisted unpickler."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeMetadataError(f"holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeMetadataError(f"points at {name!r}, outside the checkpoint directory")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata_safely(self._get_metadata_path(rank))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Byte entries (optimizer hyper-parameters and steps) load as weights-only pickles."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
