"""Convert a checkpoint of an older lowprec (non-tensor state in DCP byte records) to the current format, without
running any code from it.

An older lowprec gave DCP the whole state dict, so DCP stored every non-tensor item (the optimizer's
``param_groups``: learning rates, betas, eps, weight decay, flags, parameter names) as a byte record: a
``torch.save`` zip that DCP reads back with torch's full unpickler (``torch.load`` with weights-only off), which
runs whatever a sender put there. The current format gives DCP tensors only and writes those values to
``values.json`` (``lowprec.train.checkpoint_reader``), and every loader refuses a checkpoint with byte records.

``convert_checkpoint(src, dst)`` reads such a checkpoint as data:

- ``.metadata`` (opened with ``O_NOFOLLOW``) through ``checkpoint_metadata.load_metadata`` with byte records let
  through: the caps, the allow-list unpickler, every record's file a plain name inside ``src``, no stream
  transforms;
- ``manifest.json``, when there is one, names plain files of ``src`` (regular files, no symlink) and every file
  matches its size and sha256 (``checkpoint_files.verify``): a damaged checkpoint is refused, not re-hashed clean;
- each byte record is read by this module (``O_NOFOLLOW``, within its regular file, at most ``MAX_VALUES_BYTES``),
  checked as a ``torch.save`` zip of stored entries (``check_torch_zip``) and decoded with
  ``torch.load(weights_only=True)``: torch's restricted unpickler, which builds no object of a class outside its
  allow-list and calls nothing else. The result must be a plain value: ``None``, a bool, an int, a float, a string
  or a list or tuple of those (exact types: a ``torch.Size``, a tensor or a dict is refused);
- the tensor records are loaded through DCP with ``CheckpointReader`` and ``SafeLoadPlanner`` (every data file a
  regular file in ``src``, each record within it, an uncompressed torch zip of one tensor of the declared dtype and
  shape) into tensors allocated from the metadata (``TensorStorageMetadata``: size and dtype) on one process. A
  checkpoint whose tensors were sharded across ranks loads into full tensors of the global shape (DCP reads each
  rank's chunk into its place); the chunks must cover each tensor exactly, and the tensors together may not
  declare more bytes than the data files hold (so a forged size cannot allocate more than the folder weighs);
- ``trainer_state.pt``, when there is one, is read once (``O_NOFOLLOW``) and checked like a resume checks it
  (``check_torch_zip`` against ``trainer_state_cap``, ``torch.load(weights_only=True)``, ``check_trainer_state``);
  the bytes checked are the bytes written.

``dst`` is then written like ``save_checkpoint`` writes a checkpoint, all or nothing: into a staging folder
(``checkpoint_files.start_staging``) with ``dcp.save`` of the tensors alone, ``values.json`` (``write_values``) and
``trainer_state.pt``, committed by rename with a fresh sha256 manifest (``checkpoint_files.commit``). ``dst`` must
not exist. Every refusal is a one-line ``CheckpointError``; nothing is written to ``dst`` then.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from lowprec.errors import CheckpointError
from lowprec.parallel.fp8_all_gather import register_safe_globals
from lowprec.storage import is_plain_name
from lowprec.train.checkpoint import TRAINER_STATE, _save_failed
from lowprec.train.checkpoint_files import (
    MANIFEST,
    UnverifiedCheckpointWarning,
    commit,
    start_staging,
    verify,
)
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec.train.checkpoint_reader import (
    MAX_VALUES_BYTES,
    VALUES,
    CheckpointReader,
    SafeLoadPlanner,
    _data_file_size,
    _inner,
    _json_value,
    check_torch_zip,
    check_trainer_state,
    trainer_state_cap,
    write_values,
)

#: Cap on ``.metadata`` (a sharded checkpoint of a large model holds a few MiB of chunk records).
MAX_METADATA_BYTES = 256 << 20
#: Cap on ``manifest.json`` (one line per file).
MAX_MANIFEST_BYTES = 16 << 20
#: How deep a plain value may nest (a param group's values are flat or one list deep).
MAX_VALUE_DEPTH = 16
_PLAIN_SCALARS = (type(None), bool, int, float, str)


class Converted(NamedTuple):
    """What ``convert_checkpoint`` wrote: the folder, its tensor and value counts, whether it holds a trainer state,
    and whether the source had a manifest that verified (False: it had none, and could not be verified)."""

    dst: Path
    tensors: int
    values: int
    trainer_state: bool
    verified: bool


def convert_checkpoint(src: str | Path, dst: str | Path) -> Converted:
    """Convert the old-format checkpoint folder ``src`` (non-tensor state in DCP byte records) to a new-format
    checkpoint folder ``dst`` (tensors through DCP, values in ``values.json``), reading ``src`` as data (module
    docstring). ``src`` is not changed.

    Raises ``CheckpointError`` (one line) when ``dst`` exists, ``src`` is not a checkpoint, holds no byte records
    (nothing to convert), fails any check of the module docstring, or holds a byte record that is not a plain
    value; ``DiskError`` when ``dst``'s disk is full or read-only. On any failure ``dst`` is not created.
    """
    src, dst = Path(src), Path(dst)
    if os.path.lexists(dst):
        raise CheckpointError(f"{str(dst)!r} already exists: convert into a new folder (it is never overwritten)")
    if not src.is_dir():
        raise CheckpointError(f"no checkpoint at {str(src)!r} (not a folder)")
    where = str(src)
    meta = load_metadata(_read_regular(src, ".metadata", MAX_METADATA_BYTES), str(src / ".metadata"), True)
    records = meta.state_dict_metadata
    byte_keys = [k for k, md in records.items() if isinstance(md, BytesStorageMetadata)]
    if not byte_keys:
        raise CheckpointError(
            f"checkpoint {where!r} holds no records stored as pickled bytes: it is in lowprec's current format "
            "already (nothing to convert)"
        )
    verified = _verify_manifest(src)
    values = {key: _byte_record_value(src, meta, key) for key in byte_keys}
    tensors = _load_tensors(src, meta)
    trainer = _trainer_state_bytes(src)
    _write(dst, tensors, values, trainer)
    return Converted(dst, len(tensors), len(values), trainer is not None, verified)


# ---- reading src -------------------------------------------------------------------------------------------------


def _read_regular(folder: Path, name: str, cap: int) -> bytes:
    """The bytes of the regular file ``folder / name`` (opened with ``O_NOFOLLOW``: a symlink is refused), at most
    ``cap``."""
    p = folder / name
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {str(folder)!r} (missing {name})") from None
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: {name} cannot be opened ({e.strerror}; a symlink?): refusing to read it"
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"checkpoint {str(folder)!r}: {name} is not a regular file: refusing to read it")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {name} is over {cap} bytes (the cap): refusing to read it")
    return data


def _verify_manifest(src: Path) -> bool:
    """Verify ``src``'s manifest when it has one (True), after checking that it names regular files of ``src``
    only; False, with an ``UnverifiedCheckpointWarning``, when it has none."""
    import json

    if not os.path.lexists(src / MANIFEST):
        warnings.warn(
            f"checkpoint {str(src)!r} has no {MANIFEST}: it cannot be verified before it is converted",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
        return False
    try:
        files = json.loads(_read_regular(src, MANIFEST, MAX_MANIFEST_BYTES))["files"]
        names = list(files)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {str(src)!r}: {MANIFEST} is corrupt ({type(e).__name__})") from None
    for name in names:
        if not is_plain_name(name):
            raise CheckpointError(
                f"checkpoint {str(src)!r}: {MANIFEST} names {name!r}, which is not a plain file name inside the "
                "checkpoint folder: refusing to read it"
            )
        _data_file_size(src, name)  # lstat: a symlink is refused before verify opens it
    verify(src)
    return True


def _byte_record_value(src: Path, meta: Metadata, key: str) -> Any:
    """The JSON-ready plain value of the byte record ``key``: its bytes read from its file within ``src`` and
    decoded with torch's weights-only unpickler (module docstring)."""
    where = f"checkpoint {str(src)!r}: byte record {key!r}"
    infos = [info for index, info in meta.storage_data.items() if getattr(index, "fqn", None) == key]
    if len(infos) != 1:
        raise CheckpointError(f"{where} has {len(infos)} storage entries in the metadata, not one")
    info = infos[0]
    if info.length > MAX_VALUES_BYTES:
        raise CheckpointError(f"{where} is {info.length} bytes, over the cap of {MAX_VALUES_BYTES}")
    size = _data_file_size(src, info.relative_path)
    if info.offset + info.length > size:
        raise CheckpointError(
            f"{where} lies beyond the end of {info.relative_path} ({info.offset} + {info.length} > {size} bytes)"
        )
    try:
        fd = os.open(src / info.relative_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CheckpointError(
            f"{where}: {info.relative_path} cannot be opened ({e.strerror}; a symlink?): refusing to read it"
        ) from None
    with os.fdopen(fd, "rb") as f:
        f.seek(info.offset)
        record = f.read(info.length)
    check_torch_zip(record, len(record), where)
    try:
        value = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{where} is refused by torch's weights-only unpickler ({_unpickler_reason(e)}): lowprec never runs code "
            "from a checkpoint"
        ) from None
    _check_plain(value, where, 0)
    return _json_value(value, key)


def _unpickler_reason(e: Exception) -> str:
    """The line of torch's weights-only error that says what it refused (``Trying to load unsupported GLOBAL
    posix.system ...``), without its boilerplate (the advice to retry with weights-only off)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
    line = (said or lines or [type(e).__name__])[0]
    return line.split("WeightsUnpickler error:")[-1].strip()[:300]


def _check_plain(value: Any, where: str, depth: int) -> None:
    """Refuse anything but ``None``, bool, int, float, str and lists or tuples of them (exact types, nested at most
    ``MAX_VALUE_DEPTH``)."""
    if depth > MAX_VALUE_DEPTH:
        raise CheckpointError(f"{where} nests deeper than {MAX_VALUE_DEPTH} lists: not a plain value")
    if type(value) in _PLAIN_SCALARS:
        return
    if type(value) in (list, tuple):
        for v in value:
            _check_plain(v, where, depth + 1)
        return
    raise CheckpointError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}: a converted checkpoint keeps only "
        "plain values (numbers, strings, booleans, None and lists of them)"
    )


def _allocate(src: Path, meta: Metadata) -> dict[str, torch.Tensor]:
    """A zeroed tensor per tensor record, of the record's global size and dtype, after checking that its chunks
    cover it exactly and that all of them together declare no more bytes than the data files they name hold."""
    where = f"checkpoint {str(src)!r}"
    records: dict[str, TensorStorageMetadata] = {}
    declared = 0
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        size = tuple(md.size)
        if not all(type(n) is int and n >= 0 for n in size) or not isinstance(md.properties.dtype, torch.dtype):
            raise CheckpointError(f"{where}: tensor record {key!r} has an invalid size or dtype")
        if md.properties.layout not in (None, torch.strided):
            raise CheckpointError(f"{where}: tensor record {key!r} has layout {md.properties.layout}, not strided")
        covered = 0
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or not all(
                    type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= d
                    for o, n, d in zip(offsets, sizes, size, strict=True)
                )
            ):
                raise CheckpointError(
                    f"{where}: tensor record {key!r} has a chunk at {list(offsets)} of {list(sizes)}, outside its "
                    f"shape {list(size)}"
                )
            covered += math.prod(sizes)
        if covered != math.prod(size):
            raise CheckpointError(
                f"{where}: the chunks of tensor record {key!r} hold {covered} elements, its shape {list(size)} "
                f"has {math.prod(size)}: refusing a tensor they do not cover exactly"
            )
        declared += math.prod(size) * md.properties.dtype.itemsize
        records[key] = md
    files = {info.relative_path for index, info in meta.storage_data.items() if getattr(index, "fqn", None) in records}
    held = sum(_data_file_size(src, name) for name in files)
    if declared > held:
        raise CheckpointError(
            f"{where}: its tensor records declare {declared} bytes, more than the {held} bytes of the data files "
            "they name: refusing to allocate them"
        )
    # zeros, not empty: no leftover of this process's memory can reach dst, whatever a load leaves unwritten
    return {key: torch.zeros(tuple(md.size), dtype=md.properties.dtype) for key, md in records.items()}


class _TensorRecordReader(CheckpointReader):
    """``CheckpointReader`` given the checked metadata with its byte records taken out: DCP never learns of them,
    so it neither plans nor reads one (this module reads them itself)."""

    def __init__(self, path: Path, meta: Metadata):
        super().__init__(path)
        self._meta = meta

    def read_metadata(self, *args, **kwargs) -> Metadata:
        meta = dataclasses.replace(self._meta, storage_meta=StorageMeta())
        meta.storage_meta.load_id = self.load_id
        return meta


def _load_tensors(src: Path, meta: Metadata) -> dict[str, torch.Tensor]:
    """The tensor records of ``src`` by DCP name, loaded into tensors allocated from ``meta`` (``_allocate``)."""
    keep = {k for k, md in meta.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    tensors_only = dataclasses.replace(
        meta,
        state_dict_metadata={k: md for k, md in meta.state_dict_metadata.items() if k in keep},
        storage_data={i: info for i, info in meta.storage_data.items() if getattr(i, "fqn", None) in keep},
    )
    tensors = _allocate(src, tensors_only)
    register_safe_globals()  # checkpoints of FP8-all-gather runs hold that weight subclass
    where = str(src)
    try:
        dcp.load(tensors, storage_reader=_TensorRecordReader(src, tensors_only), planner=SafeLoadPlanner(where))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps a rank's exception: ours is in it
        cause = _inner(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from e
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise CheckpointError(f"checkpoint {where!r}: its tensors do not load: {lines[-1] if lines else e!r}") from e
    return tensors


def _trainer_state_bytes(src: Path) -> bytes | None:
    """``src``'s ``trainer_state.pt`` as bytes once checked like a resume checks it; None when it has none."""
    if not os.path.lexists(src / TRAINER_STATE):
        return None
    cap = trainer_state_cap(src)
    data = _read_regular(src, TRAINER_STATE, cap)
    where = repr(str(src / TRAINER_STATE))
    check_torch_zip(data, cap, where)
    try:
        trainer = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{where} is corrupt: {_unpickler_reason(e)}") from None
    check_trainer_state(trainer, where)
    return data


# ---- writing dst -------------------------------------------------------------------------------------------------


def _write(dst: Path, tensors: dict[str, torch.Tensor], values: dict[str, Any], trainer: bytes | None) -> None:
    """Write ``dst`` all or nothing: a staging folder, committed by rename with its manifest."""
    staging = start_staging(dst)
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(staging))
        write_values(staging, values)
        if (staging / VALUES).stat().st_size > MAX_VALUES_BYTES:
            raise CheckpointError(
                f"the values of the checkpoint make a {VALUES} over {MAX_VALUES_BYTES} bytes, which no load reads"
            )
        if trainer is not None:
            (staging / TRAINER_STATE).write_bytes(trainer)
        load_metadata((staging / ".metadata").read_bytes(), str(staging / ".metadata"))  # tensors only
        if os.path.lexists(dst):  # made while this ran: it is never replaced
            raise CheckpointError(f"{str(dst)!r} already exists: convert into a new folder (it is never overwritten)")
        commit(staging, dst)
    except CheckpointError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except (Exception, CheckpointException) as e:
        raise _save_failed(dst, staging, True, e) from e
