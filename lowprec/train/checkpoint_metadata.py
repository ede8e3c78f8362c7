"""Read a DCP checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` calls ``pickle.load`` on the ``.metadata``
file: a checkpoint someone sent could run anything on ``lowprec train resume=<folder>`` (a ``__reduce__`` that
calls ``os.system``), and the sha256 manifest cannot stop it (the sender writes it). This reader unpickles with an
allow-list, the way ``torch.load(weights_only=True)`` does for tensor files (``torch/_weights_only_unpickler.py``;
the default since torch 2.6): the dataclasses and enums of DCP's own metadata and storage layout, ``torch.Size``,
torch dtypes and layouts, and paths. Any other global is refused with ``CheckpointError`` before it is imported.

Before the unpickler runs, ``lowprec.train.pickle_limits.check_pickle`` walks the opcodes and refuses a pickle
that would build more than 16 objects and characters per byte of the file (plus 1 Mi) or nest deeper than 64: a
few hundred bytes of nested allow-listed paths would otherwise grow to gigabytes (``PurePosixPath`` re-joins its
arguments) before any check on the result could run. The caps are checked in milliseconds.

The metadata is then checked as data: a record stored as bytes (``BytesStorageMetadata``, which DCP reads back with
torch's full unpickler (``torch.load`` with weights-only off): a pickle) is refused, whatever the loading state dict
holds, and so is a record whose file (``relative_path``) is not a plain file name inside the checkpoint folder or
that names a stream transform (lowprec writes neither). lowprec checkpoints store their non-tensor state as JSON
(``lowprec.train.checkpoint_reader``); one written by an older lowprec, with byte records, is refused with one line
naming ``lowprec checkpoint convert SRC DST`` (``lowprec.train.checkpoint_convert``: it decodes the byte records
with torch's weights-only unpickler and keeps plain values only) or starting the run anew."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
import shlex
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from lowprec.errors import CheckpointError
from lowprec.storage import is_plain_name
from lowprec.train.pickle_limits import PickleLimitError, check_pickle

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


def load_metadata(data: bytes, where: str = ".metadata", byte_records: bool = False) -> Metadata:
    """Unpickle DCP ``Metadata`` from ``data`` with the caps and the allow-list above, and check it as data.

    ``byte_records``: let records stored as bytes through (for tests and tools that inspect such metadata without
    loading its records); every loader refuses them.

    Raises ``CheckpointError`` naming ``where`` (one line) for a pickle over the caps, a global outside the
    allow-list, bytes that are not a pickle, a result that is not a
    ``torch.distributed.checkpoint.metadata.Metadata``, a byte record, or a record whose file is not a plain name
    inside the checkpoint folder."""
    try:
        check_pickle(data)
    except PickleLimitError as e:
        verdict = "is corrupt" if str(e).startswith("malformed") else "is refused"
        raise CheckpointError(f"checkpoint metadata {where!r} {verdict}: {e}") from None
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint metadata {where!r} is corrupt: {type(e).__name__}: {e}") from e
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"checkpoint metadata {where!r} holds a {type(meta).__name__}, not DCP Metadata")
    check_records(meta, where, byte_records)
    return meta


def byte_record_refusal(where: str, keys: list[str]) -> CheckpointError:
    """The one-line refusal of a checkpoint holding records stored as bytes (``keys``)."""
    folder = str(Path(where).parent) if where.endswith(".metadata") else where
    shown = shlex.quote(folder) if folder.isprintable() else "SRC"  # the message stays one line
    return CheckpointError(
        f"checkpoint {folder!r} holds {len(keys)} records stored as pickled bytes (first: {keys[0]!r}), which "
        "lowprec does not read (a checkpoint is data; it never runs code): it was written by a lowprec older than "
        f"values.json or by another program; convert it with `lowprec checkpoint convert {shown} "
        "NEW_FOLDER` (it reads the byte records with torch's weights-only unpickler and keeps plain values only) "
        "or start the run anew"
    )


def check_records(meta: Metadata, where: str, byte_records: bool = False) -> None:
    """Refuse (``CheckpointError``, one line naming ``where``) metadata whose records are not all tensors (unless
    ``byte_records``), whose storage entries are not ``_StorageInfo`` with non-negative integer offsets and
    lengths, whose file names are not plain names inside the folder (no ``/``, ``\\``, ``..``, absolute or empty
    names), or that name a stream transform. Reads no file."""
    sdm = meta.state_dict_metadata
    if not isinstance(sdm, dict) or not all(isinstance(k, str) for k in sdm):
        raise CheckpointError(f"checkpoint metadata {where!r} is corrupt: its records are not a name -> record map")
    kinds = (TensorStorageMetadata, BytesStorageMetadata) if byte_records else (TensorStorageMetadata,)
    byte_keys = [k for k, md in sdm.items() if isinstance(md, BytesStorageMetadata)]
    if byte_keys and not byte_records:
        raise byte_record_refusal(where, byte_keys)
    for key, md in sdm.items():
        if not isinstance(md, kinds):
            raise CheckpointError(f"checkpoint metadata {where!r}: record {key!r} is a {type(md).__name__}")
    if not isinstance(meta.storage_data, dict):
        raise CheckpointError(f"checkpoint metadata {where!r} is corrupt: no storage map")
    for index, info in meta.storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointError(f"checkpoint metadata {where!r}: a record's storage is a {type(info).__name__}")
        name = info.relative_path
        if not is_plain_name(name):
            raise CheckpointError(
                f"checkpoint metadata {where!r}: record {getattr(index, 'fqn', '?')!r} is stored in {name!r}, "
                "which is not a plain file name inside the checkpoint folder: refusing to read it"
            )
        for n in (info.offset, info.length):
            if type(n) is not int or n < 0:
                raise CheckpointError(f"checkpoint metadata {where!r}: record offset or length {n!r} is invalid")
        if info.transform_descriptors:
            raise CheckpointError(
                f"checkpoint metadata {where!r}: record {getattr(index, 'fqn', '?')!r} names stream transforms "
                f"{list(info.transform_descriptors)!r}, which lowprec never writes: refusing to read it"
            )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` goes through ``load_metadata`` (caps, allow-list, no byte
    records, plain file names). ``lowprec.train.checkpoint_reader.CheckpointReader`` adds the checks of the data
    files themselves; load through that one."""

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
