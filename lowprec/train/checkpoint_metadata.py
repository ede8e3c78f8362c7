"""Read a DCP checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` calls ``pickle.load`` on the ``.metadata``
file: a checkpoint someone sent could run anything on ``lowprec train resume=<folder>`` (a ``__reduce__`` that
calls ``os.system``), and the sha256 manifest cannot stop it (the sender writes it). This reader unpickles with an
allow-list, the way ``torch.load(weights_only=True)`` does for tensor files (``torch/_weights_only_unpickler.py``;
the default since torch 2.6): the dataclasses and enums of DCP's own metadata and storage layout, ``torch.Size``,
torch dtypes and layouts, and paths. Any other global is refused with ``CheckpointError`` before it is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lowprec.errors import CheckpointError

#: Modules whose dataclasses and enums DCP's ``.metadata`` pickles (torch 2.8 - 2.13).
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
#: Value-like globals that are safe to build from a file: they hold data and run nothing on construction.
_PLAIN = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided and friends pickle through it
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
}


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _PLAIN:
        return True
    if module == "torch":  # dtypes pickle as a global of the torch module (torch.float8_e4m3fn, ...)
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module in _DCP_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise CheckpointError(
                f"checkpoint metadata {self.where!r} refers to {module}.{name}, which DCP metadata never holds: "
                "refusing to load it (a checkpoint is data; it never runs code)"
            )
        return super().find_class(module, name)


def load_metadata(data: bytes, where: str = ".metadata") -> Metadata:
    """Unpickle DCP ``Metadata`` from ``data`` with the allow-list above.

    Raises ``CheckpointError`` naming ``where`` for a global outside the allow-list, for bytes that are not a
    pickle, and when the result is not a ``torch.distributed.checkpoint.metadata.Metadata``."""
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint metadata {where!r} is corrupt: {type(e).__name__}: {e}") from e
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"checkpoint metadata {where!r} holds a {type(meta).__name__}, not DCP Metadata")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` goes through ``load_metadata`` (everything else, including
    the tensor data files, is torch's: those are read as raw bytes, or with ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(rank)
        else:  # older torch: one metadata file per checkpoint
            path = Path(self.path) / ".metadata"
        with self.fs.create_stream(path, "rb") as f:
            meta = load_metadata(f.read(), str(path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
