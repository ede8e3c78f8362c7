"""Checkpoints: model (parameters and buffers, so FP8 amax histories and scales), optimizer state (master
copies and quantized moments included) through ``torch.distributed.checkpoint`` (DCP), and the trainer
state (step, LR schedule, loss scaler, RNG states, the health monitor's state: data position, rollback count, FP8
fallback) in ``trainer_state.pt`` beside it.

A checkpoint folder holds: DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files (tensors only), ``values.json``
(every non-tensor item of the model and optimizer state, e.g. the optimizer's ``param_groups``, as JSON),
``trainer_state.pt`` (a ``torch.save`` zip, read with ``weights_only=True``) and ``manifest.json`` (sha256 of each
file). Nothing in it is read with pickle: a checkpoint someone sent is data (``lowprec.train.checkpoint_reader``
says what each load checks and refuses; a checkpoint of an older lowprec, whose optimizer values DCP stored as
pickled byte records, is refused in one line).

DCP works without a process group (one process) and with FSDP2/TP (each rank writes its shards, and a
checkpoint loads into any other layout: DCP reshards DTensors on load). A checkpoint is written whole or not at
all, with a sha256 manifest that is checked before a resume (``lowprec.train.checkpoint_files``). A run resumed
from a checkpoint continues bit for bit: data order is a function of (seed, step), and every piece of state that
the next step reads is in here. Under torchrun, rank 0 writes ``trainer_state.pt`` (the same on every rank).
"""

from __future__ import annotations

import io
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lowprec.errors import CheckpointError
from lowprec.parallel.fp8_all_gather import register_safe_globals
from lowprec.storage import disk_error
from lowprec.train import fault_points
from lowprec.train.checkpoint_files import commit, staging_folder, start_staging
from lowprec.train.checkpoint_metadata import load_metadata
from lowprec.train.checkpoint_reader import (
    check_state_keys,
    check_torch_zip,
    check_trainer_state,
    load_state,
    split_state,
    trainer_state_cap,
    write_values,
)
from lowprec.train.fault_points import reached

TRAINER_STATE = "trainer_state.pt"


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    scheduler=None,
    loss_scaler=None,
    recipe=None,
    health: dict | None = None,
    ema: dict | None = None,
) -> None:
    """Write everything the next step needs to the folder ``path``, all or nothing: into a staging folder, then
    committed by rename with its sha256 manifest (``lowprec.train.checkpoint_files``); a save killed midway
    leaves no ``path``.

    ``step``: the number of optimizer steps taken (the resumed run starts at this step index).
    ``recipe``: the run's ``Recipe``; its name and hash are stored so a resume under another recipe is
    noticed (``check_resume_recipe``). ``health``: the health monitor's state (``HealthMonitor.state_dict``: spike
    histories, skipped batches, rollback count, FP8 streaks and switched layers), stored as ``trainer_state.pt``'s
    ``health``. ``ema``: the weight EMA's state (``WeightEma.state_dict``, ``train.eval_ema``), stored as its ``ema``.

    Raises ``DiskError`` (one line: the errno, the folder, its disk and the bytes free) when the disk is full or
    read-only, ``RuntimeError`` for any other failure; either way the staging folder is removed (or, where the disk
    refuses that, named in the message as left) and the checkpoints committed before are untouched.
    """
    final = Path(path)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    staging = start_staging(final) if rank0 else staging_folder(final)
    if dist.is_initialized():
        dist.barrier()  # a killed save's leftover staging folder is gone before any rank writes
    reached("save.start")
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # DCP would pickle every non-tensor item into a byte record; those go to values.json instead
        tensors, values = split_state({"model": model_sd, "optim": optim_sd})
        with warnings.catch_warnings():
            # without a process group DCP warns that it assumes a single-process save: that is this run's intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(tensors, storage_writer=_writer(staging))
    except (Exception, CheckpointException) as e:  # DCP raises collectively: every rank is here
        raise _save_failed(final, staging, rank0, e) from e
    if dist.is_initialized():
        dist.barrier()  # every rank's shards are written before rank 0 hashes and commits them
    failure: BaseException | None = None
    if rank0:
        trainer = {
            "step": step,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "loss_scaler": loss_scaler.state_dict() if loss_scaler is not None else None,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "recipe_name": recipe.name if recipe is not None else None,
            "recipe_hash": recipe.hash() if recipe is not None else None,
            "health": health,
            "ema": ema,
        }
        try:
            reached("save.trainer_state")
            write_values(staging, values)  # the same on every rank
            # Serialized in memory and written by Python: torch's file writer reports a full disk as "file write
            # failed", without the errno that makes it a one-line DiskError.
            buf = io.BytesIO()
            torch.save(trainer, buf)  # identical on every rank: step, schedule, scaler
            (staging / TRAINER_STATE).write_bytes(buf.getvalue())
            commit(staging, final)
        except Exception as e:
            failure = _save_failed(final, staging, rank0, e)
            failure.__cause__ = e
    if dist.is_initialized():  # the other ranks learn of rank 0's failure instead of waiting at a barrier
        box = [None if failure is None else str(failure)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and failure is None:
            failure = RuntimeError(box[0])
    if failure is not None:
        raise failure


def _writer(staging: Path) -> dcp.FileSystemWriter:
    """DCP's file-system writer for ``staging``; with the fault point ``save.shards`` armed, one whose first shard
    file reaches that point after its first item is written (``_PointFileSystem``)."""
    writer = dcp.FileSystemWriter(staging)
    if fault_points.is_armed("save.shards"):
        writer.fs = _PointFileSystem()
    return writer


class _PointFileSystem(FileSystem):
    """DCP's ``FileSystem`` whose first written ``.distcp`` file reaches the fault point ``save.shards`` after its
    first write: the shard file is part written when the fault lands."""

    def __init__(self) -> None:
        super().__init__()
        self.hit = False

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if self.hit or "w" not in mode or not str(path).endswith(".distcp"):
                yield stream
                return
            self.hit = True
            real = stream.write

            def write(data):
                n = real(data)
                stream.write = real
                stream.flush()  # the part written is on the disk when the fault lands
                reached("save.shards")
                return n

            stream.write = write
            yield stream


def _save_failed(final: Path, staging: Path, rank0: bool, e: BaseException) -> Exception:
    """The exception a failed save raises, after rank 0 removed the staging folder (the checkpoints committed
    before stay as they are; a folder that cannot be removed, on a read-only disk, is named as left, and the next
    save to that step clears it): a one-line ``DiskError`` for a full or read-only disk, else a ``RuntimeError`` with
    the first line of the cause (torch's ``CheckpointException`` is a ``BaseException``, which ``except Exception``
    in the runner would let through with the run left RUNNING)."""
    left = None  # why the staging folder could not be removed
    if rank0:
        try:
            shutil.rmtree(staging)
        except FileNotFoundError:  # the failure came before the staging folder existed
            pass
        except OSError as err:  # a read-only disk: the message says what is left (the next save clears it)
            left = f"partial save {str(staging)!r} left: it could not be removed: {err.strerror or err}"
    removal = left or ("partial save removed" if rank0 else "partial save removed by rank 0")
    disk = disk_error(f"writing checkpoint {str(final)!r} ({removal})", final.parent, e)
    if disk is not None:
        return disk
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = lines[-1] if lines else type(e).__name__
    return RuntimeError(f"checkpoint save to {str(final)!r} failed: {cause}" + (f" ({left})" if left else ""))


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, loss_scaler=None
) -> int:
    """Load the folder ``path`` into the given objects in place; returns the saved step. It does not check the
    manifest: a resume verifies first (``checkpoint_files.resolve_resume``).

    Raises ``CheckpointError`` for a missing folder or file, metadata that would run code or is corrupt
    (``checkpoint_metadata.load_metadata``), a corrupt trainer state, or a checkpoint that does not load into this
    model/optimizer.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (missing .metadata)")

    # DCP unpickles .metadata with plain pickle: read it with caps and an allow-list first, so a foreign
    # checkpoint's payload (or byte records, or a file outside the folder) is refused here in one line.
    load_metadata((path / ".metadata").read_bytes(), str(path / ".metadata"))
    # a resume reads the trainer state (its types checked) before any tensor is loaded into the model
    trainer = read_trainer_state(path) if (path / TRAINER_STATE).exists() else None
    if trainer is None and scheduler is not None:
        _missing(path / TRAINER_STATE)
    if trainer is not None:
        where = str(path / TRAINER_STATE)
        if scheduler is not None:
            check_state_keys(trainer.get("scheduler"), scheduler.state_dict(), "scheduler", where)
        if loss_scaler is not None:
            check_state_keys(trainer.get("loss_scaler"), loss_scaler.state_dict(), "loss scaler", where)
    register_safe_globals()  # checkpoints of FP8-all-gather runs hold that weight subclass
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_state(path, state)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if trainer is None:
        return 0
    if scheduler is not None and trainer.get("scheduler") is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if loss_scaler is not None and trainer.get("loss_scaler") is not None:
        loss_scaler.load_state_dict(trainer["loss_scaler"])
    try:
        torch.set_rng_state(trainer["rng_cpu"])
        if trainer.get("rng_cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(trainer["rng_cuda"])
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{str(path / TRAINER_STATE)!r}: its RNG state is invalid ({str(e).splitlines()[0]})"
        ) from e
    return int(trainer["step"])


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load the model part of the checkpoint folder ``path`` into ``model`` in place (its optimizer state and
    trainer state are not read), with every check of a full load (``checkpoint_reader.load_state``).

    Raises ``CheckpointError`` (one line) for a missing or refused checkpoint, or one that does not fit ``model``.
    """
    path = Path(path)
    if not (path / ".metadata").exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (missing .metadata)")
    load_metadata((path / ".metadata").read_bytes(), str(path / ".metadata"))
    register_safe_globals()
    state = {"model": model.state_dict()}
    load_state(path, state, partial=True)
    model.load_state_dict(state["model"])


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state (step, schedule, scaler, RNG, recipe name and hash, health, EMA) of the checkpoint folder
    ``path``, with its types checked (``checkpoint_reader.check_trainer_state``). The preflight of a resume calls
    it (through ``check_resume_recipe``), so a bad trainer state is refused before a run is created.

    Before loading, the zip's central directory is checked (``checkpoint_reader.check_torch_zip``): entries
    stored uncompressed, at most ``checkpoint_reader.trainer_state_cap(path)`` bytes in all (64 MiB plus twice
    the checkpoint's tensor data files). Then ``torch.load(weights_only=True)``.

    Raises ``CheckpointError`` (one line) when the folder or its ``trainer_state.pt`` is missing, a symlink, over
    the cap, compressed, corrupt, or of the wrong types.
    """
    p = Path(path) / TRAINER_STATE
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (missing {TRAINER_STATE})")
    if p.is_symlink() or not p.is_file():
        raise CheckpointError(f"{str(p)!r} is not a regular file (a symlink?): refusing to read it")
    cap = trainer_state_cap(Path(path))
    try:
        with open(p, "rb") as f:
            data = f.read(cap + 1)  # the file's entries are stored: no more than the cap is ever needed
    except OSError as e:
        raise CheckpointError(f"{str(p)!r} cannot be read ({e.strerror})") from None
    if len(data) > cap:
        raise CheckpointError(f"{str(p)!r} is over its cap of {cap} bytes: refusing to load it")
    check_torch_zip(data, cap, repr(str(p)))
    try:
        trainer = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{str(p)!r} is corrupt: {str(e).splitlines()[0]}") from e
    return check_trainer_state(trainer, repr(str(p)))


def check_resume_recipe(path: str | Path, recipe, allow_change: bool) -> dict:
    """Compare the recipe a checkpoint was written under with ``recipe`` (by ``Recipe.hash``).

    Returns ``{}`` when they are the same, and ``{"resume_recipe_change": {...}}`` (from/to names and
    hashes, the step) when they differ and ``allow_change`` is set (``train.resume_recipe_change=true``:
    e.g. switching FP8 to BF16 late in training), to be recorded in the effective recipe. Raises
    ``CheckpointError`` when they differ and ``allow_change`` is not set. A checkpoint written before
    recipe hashes were stored cannot be verified: a warning says so and ``{}`` is returned.
    """
    trainer = read_trainer_state(path)
    saved = trainer.get("recipe_hash")
    if saved is None:
        warnings.warn(
            f"checkpoint {str(path)!r} records no recipe hash (written by an older lowprec); "
            "cannot verify that it was trained with this recipe",
            stacklevel=2,
        )
        return {}
    if saved == recipe.hash():
        return {}
    change = {
        "from": trainer.get("recipe_name"),
        "from_hash": saved,
        "to": recipe.name,
        "to_hash": recipe.hash(),
        "at_step": int(trainer["step"]),
    }
    if not allow_change:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written under recipe {change['from']} (hash {saved}); this run is "
            f"{recipe.name} (hash {recipe.hash()}): resume with the same recipe, or set "
            "train.resume_recipe_change=true to switch recipes at this step"
        )
    return {"resume_recipe_change": change}


def _missing(p: Path) -> int:
    raise CheckpointError(f"checkpoint has no {p.name} at {str(p)!r}")
