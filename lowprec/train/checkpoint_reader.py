"""A checkpoint's data files read as data: tensors only, from files inside the folder, of the dtype and shape the
model has, with no pickle anywhere in the path.

The format. DCP (``torch.distributed.checkpoint``) stores every non-tensor item of a state dict as a record of
pickled bytes and reads it back with torch's full unpickler (``torch.load`` with weights-only off), which runs
whatever a sender put there, and it does so for any key the received ``.metadata`` declares a byte record, whatever
the loading state dict holds. So a lowprec checkpoint gives DCP tensors only: ``split_state`` takes the non-tensor
items (the optimizer's ``param_groups``: learning rates, betas, eps, weight decay, flags and parameter names; 26 in
a one-process AdamW checkpoint) out of the state dict, and they are written as JSON to ``values.json`` beside DCP's
files (covered by the sha256 manifest like every file of the folder). Keys are DCP's own flattened names
(``optim.param_groups.0.lr``); values are JSON numbers, strings, booleans, null and lists (a tuple is written as a
list and read back as a tuple where the model's state holds one).

The load (``load_state``), before a byte of a data file is read:

- ``.metadata`` goes through ``checkpoint_metadata.load_metadata``: caps, allow-list, no byte records, plain
  file names, no stream transforms;
- ``CheckpointReader.set_up_storage_reader``: every data file it names is a regular file in the folder (a symlink
  is refused) and each record lies within its file;
- ``SafeLoadPlanner.set_up_planner``: every tensor to load has a record, stored with the loading tensor's dtype
  and shape (an int8 record where the model holds float32 is refused, not converted).

Then ``CheckpointReader.read_data`` reads each record (``O_NOFOLLOW``): a torch zip whose entries must be stored
uncompressed (so it builds no more than its bytes on disk), loaded with ``torch.load(weights_only=True)``, and
refused unless it is a tensor of the declared dtype. A byte read request is refused there too, and
``SafeLoadPlanner.load_bytes`` refuses again, should DCP ever route one.

``trainer_state.pt`` (step, schedule, loss scaler, RNG, health, EMA) stays a ``torch.save`` zip, read with
``weights_only=True`` after ``check_torch_zip``: its entries are stored uncompressed and weigh at most
``TRAINER_STATE_BASE`` (64 MiB) plus twice the checkpoint's tensor data files (the weight EMA can hold an FP32
copy of the model), checked in the zip's central directory before loading. ``check_trainer_state`` checks the
types of what it holds (``step`` an int in [0, 2**62], ``rng_cpu`` a 1-D uint8 tensor, ...).

Every refusal is a one-line ``CheckpointError``.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lowprec.errors import CheckpointError
from lowprec.train.checkpoint_metadata import SafeFileSystemReader, byte_record_refusal

#: The JSON file of a checkpoint's non-tensor state (module docstring).
VALUES = "values.json"
#: Cap on ``values.json`` (a one-process checkpoint's is about 1 KiB per parameter group).
MAX_VALUES_BYTES = 16 << 20
#: The trainer state's allowance beside twice the tensor data files (RNG states, schedule, health histories).
TRAINER_STATE_BASE = 64 << 20
_MAX_STEP = 1 << 62

_Path = tuple[str | int, ...]


# ---- the split: tensors for DCP, everything else as JSON ------------------------------------------------------


def _leaves(tree: Any, path: _Path = ()) -> list[tuple[_Path, Any]]:
    """The leaves of ``tree`` as DCP flattens them (``torch.distributed.checkpoint._traverse``): mappings are
    walked by ``str(key)``; a list is walked by index when it holds a tensor, a mapping or such a list; anything
    else (tuples included) is a leaf."""
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, (*path, str(k)))]
    if isinstance(tree, list) and not _terminal(tree):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, (*path, i))]
    return [(path, tree)]


def _terminal(values: list) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor) or isinstance(v, dict):
            return False
        if isinstance(v, list) and not _terminal(v):
            return False
    return True


def _fqn(path: _Path) -> str:
    return ".".join(str(p) for p in path)


def _json_value(value: Any, fqn: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # JSON has no inf or nan: stored as a tagged string
    if isinstance(value, (list, tuple)):
        return [_json_value(v, fqn) for v in value]
    raise CheckpointError(
        f"checkpoint state item {fqn!r} is a {type(value).__name__}: a checkpoint stores non-tensor state only as "
        "JSON numbers, strings, booleans, null and lists"
    )


def split_state(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state`` (nested dicts and lists, as ``get_state_dict`` returns) as ``(tensors, values)``: the tensors by
    DCP's flattened name (the same tensor objects: loading into them loads into ``state``), and every other leaf
    by the same name as a JSON-ready value. Raises ``CheckpointError`` for a leaf JSON cannot hold, or two
    leaves of one name."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for path, leaf in _leaves(state):
        fqn = _fqn(path)
        if fqn in tensors or fqn in values:
            raise CheckpointError(f"checkpoint state has two items named {fqn!r}")
        if isinstance(leaf, torch.Tensor):
            tensors[fqn] = leaf
        else:
            values[fqn] = _json_value(leaf, fqn)
    return tensors, values


def write_values(folder: Path, values: dict[str, Any]) -> None:
    """Write ``values`` (``split_state``'s second part) to ``folder / VALUES``."""
    (Path(folder) / VALUES).write_text(json.dumps({"format": 1, "values": values}, indent=1, sort_keys=True))


def read_values(folder: Path) -> dict[str, Any]:
    """The values ``write_values`` wrote to ``folder``. Raises ``CheckpointError`` (one line) when the file is
    missing, a symlink, over ``MAX_VALUES_BYTES``, not JSON of that form, or nested beyond Python's limit."""
    p = Path(folder) / VALUES
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(folder)!r} has no {VALUES}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {VALUES} cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_VALUES_BYTES + 1)
    if len(data) > MAX_VALUES_BYTES:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {VALUES} is over {MAX_VALUES_BYTES} bytes (the cap)")
    try:
        doc = json.loads(data)
        values = doc["values"]
        if doc.get("format") != 1 or not isinstance(values, dict):
            raise ValueError("not a lowprec values file")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"checkpoint {str(folder)!r}: {VALUES} is corrupt ({first})") from None
    return values


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _restore(saved: Any, like: Any, fqn: str, where: str) -> Any:
    """``saved`` (from JSON) in the form of ``like`` (the loading state's value): floats stored as tagged strings
    back to floats, lists back to tuples where ``like`` is one. Raises ``CheckpointError`` when their kinds
    differ (a null on either side takes any kind: an optimizer flag may be unset in one of them)."""
    if isinstance(like, float) and saved in ("inf", "-inf", "nan"):
        return float(saved)
    if isinstance(saved, list):
        inner = list(like) if isinstance(like, (list, tuple)) and len(like) == len(saved) else [None] * len(saved)
        out = [_restore(s, i, fqn, where) for s, i in zip(saved, inner, strict=True)]
        return tuple(out) if isinstance(like, tuple) else out
    if like is not None and saved is not None and _kind(saved) != _kind(like):
        raise CheckpointError(
            f"checkpoint {where!r}: {fqn} is a {_kind(saved)} in {VALUES}, this run's state holds a {_kind(like)}"
        )
    if isinstance(like, float) and isinstance(saved, int):
        return float(saved)
    return saved


def _set(tree: Any, path: _Path, value: Any) -> None:
    node = tree
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, dict):
            real = next(k for k in node if str(k) == key)
            if last:
                node[real] = value
            else:
                node = node[real]
        else:
            if last:
                node[key] = value
            else:
                node = node[key]


def apply_values(state: dict, values: dict[str, Any], where: str) -> None:
    """Set every non-tensor leaf of ``state`` from ``values`` (``read_values``), in place. Raises
    ``CheckpointError`` (one line naming ``where``) when a leaf has no value or a value of another kind, or when
    ``values`` holds a name that is not such a leaf of ``state``."""
    leaves = {_fqn(p): (p, v) for p, v in _leaves(state) if not isinstance(v, torch.Tensor)}
    for fqn, (path, like) in leaves.items():
        if fqn not in values:
            raise CheckpointError(f"checkpoint {where!r} has no value for {fqn} in {VALUES}")
        _set(state, path, _restore(values[fqn], like, fqn, where))
    extra = sorted(set(values) - set(leaves))
    if extra and not where.endswith("(partial)"):
        raise CheckpointError(f"checkpoint {where!r}: {VALUES} holds {extra[0]!r}, which this run's state has not")


# ---- DCP: a planner and a reader that read tensors only -------------------------------------------------------


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that loads tensors only: ``set_up_planner`` refuses, before any data file is
    read, metadata holding a byte record, a tensor of the loading state without a record, and a record of another
    dtype or shape than the loading tensor; ``load_bytes`` refuses any byte record DCP would route to it.
    ``where``: the checkpoint folder, for the messages."""

    def __init__(self, where: str):
        super().__init__(allow_partial_load=False)
        self.where = where

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            raise CheckpointError(f"checkpoint {self.where!r} has no metadata")
        records = metadata.state_dict_metadata
        byte_keys = [k for k, md in records.items() if isinstance(md, BytesStorageMetadata)]
        if byte_keys:
            raise byte_record_refusal(self.where, byte_keys)
        for fqn, obj in self.state_dict.items():
            md = records.get(fqn)
            if not isinstance(obj, torch.Tensor):
                raise CheckpointError(f"checkpoint load of {self.where!r}: {fqn} is not a tensor in the loading state")
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {self.where!r} has no tensor record for {fqn}")
            if md.properties.dtype != obj.dtype:
                raise CheckpointError(
                    f"checkpoint {self.where!r}: {fqn} is stored as {md.properties.dtype}, this model holds "
                    f"{obj.dtype}: refusing to load it"
                )
            if tuple(md.size) != tuple(obj.size()):
                raise CheckpointError(
                    f"checkpoint {self.where!r}: {fqn} is stored with shape {list(md.size)}, this model's is "
                    f"{list(obj.size())}: refusing to load it"
                )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"checkpoint {self.where!r}: {read_item.dest_index.fqn} is a byte record: refused")


class CheckpointReader(SafeFileSystemReader):
    """DCP's file-system reader for a checkpoint someone may have sent (module docstring): metadata through
    ``load_metadata``; every data file named checked to be a regular file in the folder, each record within it,
    before any is read; records read with ``O_NOFOLLOW`` as uncompressed torch zips of one tensor of the declared
    dtype; byte records refused."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        folder = Path(self.path)
        sizes: dict[str, int] = {}
        for index, info in self.storage_data.items():
            name = info.relative_path
            if name not in sizes:
                sizes[name] = _data_file_size(folder, name)
            if info.offset + info.length > sizes[name]:
                raise CheckpointError(
                    f"checkpoint {str(folder)!r}: record {getattr(index, 'fqn', '?')!r} lies beyond the end of "
                    f"{name} ({info.offset} + {info.length} > {sizes[name]} bytes)"
                )
        self.dtypes = {
            k: md.properties.dtype
            for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        folder = Path(self.path)
        for item in plan.items:  # all refused before a byte of any data file is read
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(f"checkpoint {str(folder)!r}: {item.storage_index.fqn} is a byte record: refused")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                for req in items:
                    info = self.storage_data[req.storage_index]
                    f.seek(info.offset)
                    record = f.read(info.length)
                    fqn = req.storage_index.fqn
                    tensor = load_tensor_record(record, f"{folder / name}: {fqn}", self.dtypes.get(fqn))
                    tensor = _narrow(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CheckpointError(
                            f"checkpoint {str(folder)!r}: record {fqn!r} has shape {list(tensor.size())}, "
                            f"its place in the model {list(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of ``tensor`` at ``offsets`` of ``lengths`` (per dimension), as DCP's reader takes it."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _data_file_size(folder: Path, name: str) -> int:
    try:
        st = os.lstat(folder / name)
    except OSError as e:
        raise CheckpointError(f"checkpoint {str(folder)!r}: data file {name!r} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"checkpoint {str(folder)!r}: data file {name!r} is not a regular file (a symlink?): refusing to read it"
        )
    return st.st_size


def check_torch_zip(data_or_path: bytes | Path, cap: int, where: str) -> None:
    """Refuse (``CheckpointError``, one line naming ``where``) a ``torch.save`` zip whose entries are compressed
    (``torch.save`` never compresses: a compressed entry can inflate a thousandfold on load) or whose entries
    together exceed ``cap`` bytes, from the zip's central directory, before anything is loaded."""
    src = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    try:
        with zipfile.ZipFile(src) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{where} is not a torch file ({str(e).splitlines()[0] if str(e) else e!r})") from None
    packed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise CheckpointError(f"{where} holds compressed entries ({packed[0]!r}), which torch.save never writes")
    total = sum(i.file_size for i in infos)
    if total > cap:
        raise CheckpointError(f"{where} would load {total} bytes, over its cap of {cap} bytes: refusing to load it")


def load_tensor_record(record: bytes, where: str, dtype: torch.dtype | None) -> torch.Tensor:
    """One DCP tensor record (a ``torch.save`` zip of one tensor), checked by ``check_torch_zip`` against its own
    length and loaded with ``weights_only=True``. Raises ``CheckpointError`` unless it holds a tensor of ``dtype``
    (the metadata's)."""
    check_torch_zip(record, len(record), where)
    try:
        t = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{where} is corrupt: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if not isinstance(t, torch.Tensor) or (dtype is not None and t.dtype != dtype):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise CheckpointError(f"{where} holds {got}, its metadata says {dtype}: refusing to load it")
    return t


def load_state(folder: Path, state: dict, partial: bool = False) -> None:
    """Load the checkpoint ``folder`` into ``state`` (nested dicts and lists of tensors and values, as
    ``get_state_dict`` returns) in place: its tensors through DCP with ``SafeLoadPlanner`` and ``CheckpointReader``,
    its other leaves from ``values.json``. ``partial``: ``state`` is part of the saved state (the model alone), so
    values the checkpoint holds beyond it are ignored.

    Raises ``CheckpointError`` (one line) for any refusal of the module docstring, or when the checkpoint does not
    fit ``state``."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    where = str(folder)
    tensors, _ = split_state(state)
    try:
        load(tensors, storage_reader=CheckpointReader(folder), planner=SafeLoadPlanner(where))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps a rank's exception: ours is in it, first line
        cause = _inner(e)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from e
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise CheckpointError(
            f"checkpoint {where!r} does not load into this model: {lines[-1] if lines else type(e).__name__}"
        ) from e
    apply_values(state, read_values(folder), where + (" (partial)" if partial else ""))


def _inner(e: BaseException) -> BaseException | None:
    """The first rank's exception inside torch's ``CheckpointException`` (``failures``: rank -> exception)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for f in failures.values():
            inner = f[0] if isinstance(f, tuple) else f
            if isinstance(inner, BaseException):
                return inner
    return e


# ---- the trainer state -------------------------------------------------------------------------------------------


def trainer_state_cap(folder: Path) -> int:
    """The most bytes ``trainer_state.pt`` of checkpoint ``folder`` may load: ``TRAINER_STATE_BASE`` plus twice
    the size of its DCP data files (``*.distcp``; the weight EMA holds an FP32 copy of the model)."""
    data = sum(p.lstat().st_size for p in Path(folder).glob("*.distcp") if p.is_file() and not p.is_symlink())
    return TRAINER_STATE_BASE + 2 * data


def check_trainer_state(trainer: Any, where: str) -> dict:
    """Return ``trainer`` (a loaded ``trainer_state.pt``) when its items have the types ``save_checkpoint``
    writes; raise ``CheckpointError`` (one line naming ``where``) otherwise: ``step`` an int in [0, 2**62];
    ``rng_cpu`` a 1-D uint8 tensor; ``rng_cuda`` a list of such tensors; ``scheduler``, ``loss_scaler``,
    ``health`` and ``ema`` a dict with string keys or None; ``recipe_name`` and ``recipe_hash`` a string or
    None. Keys a checkpoint of an older lowprec lacks may be missing (except ``step`` and ``rng_cpu``)."""

    def bad(key: str, want: str) -> CheckpointError:
        got = trainer.get(key)
        shown = f"of type {type(got).__name__}" if not isinstance(got, torch.Tensor) else f"a {got.dtype} tensor"
        return CheckpointError(f"{where}: trainer state {key!r} is {shown}, not {want}: refusing it")

    def rng(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and t.layout == torch.strided

    if not isinstance(trainer, dict) or not all(isinstance(k, str) for k in trainer):
        raise CheckpointError(f"{where}: the trainer state is a {type(trainer).__name__}, not a dict of names")
    if "step" not in trainer or "rng_cpu" not in trainer:
        raise CheckpointError(f"{where}: the trainer state has no {'step' if 'step' not in trainer else 'rng_cpu'}")
    step = trainer["step"]
    if type(step) is not int:
        raise bad("step", "an int")
    if not 0 <= step <= _MAX_STEP:
        raise CheckpointError(f"{where}: trainer state 'step' is {step}, outside [0, 2**62]: refusing it")
    if not rng(trainer["rng_cpu"]):
        raise bad("rng_cpu", "a 1-D uint8 tensor")
    cuda = trainer.get("rng_cuda", [])
    if not isinstance(cuda, list) or not all(rng(t) for t in cuda):
        raise bad("rng_cuda", "a list of 1-D uint8 tensors")
    for key in ("scheduler", "loss_scaler", "health", "ema"):
        v = trainer.get(key)
        if v is not None and not (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
            raise bad(key, "a dict of names or None")
    for key in ("recipe_name", "recipe_hash"):
        if trainer.get(key) is not None and not isinstance(trainer[key], str):
            raise bad(key, "a string or None")
    return trainer


def check_state_keys(saved: dict | None, current: dict, what: str, where: str) -> None:
    """Refuse (``CheckpointError``) a saved ``scheduler``/``loss_scaler`` state whose keys are not among the
    live object's own (``current``: its ``state_dict()``), or whose values differ from them in kind:
    ``load_state_dict`` copies them onto the object's attributes."""
    if saved is None:
        return
    extra = sorted(set(saved) - set(current))
    if extra:
        raise CheckpointError(f"{where}: the saved {what} state holds {extra[0]!r}, which a {what} has not")
    for k, v in saved.items():
        like = current[k]
        if (
            like is not None
            and v is not None
            and _kind(v) != _kind(like)
            and not (isinstance(like, torch.Tensor) and isinstance(v, torch.Tensor))
        ):
            raise CheckpointError(f"{where}: the saved {what} state's {k!r} is a {_kind(v)}, not a {_kind(like)}")
