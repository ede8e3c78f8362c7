"""Checkpoint folders that cannot be half-written: staged writes, a sha256 manifest, fallback and pruning.

A checkpoint ``<dir>/step_<N>`` is written into ``<dir>/.step_<N>.partial`` and renamed into place only once every
file is complete and ``manifest.json`` (each file's size and sha256) is written beside them, so a process killed
in the middle of a save leaves a ``.partial`` folder that no loader looks at, never a ``step_<N>`` that looks
whole. Loading verifies the manifest first: a truncated or altered file is refused with its name, and a resume
falls back to the newest earlier checkpoint that verifies, with a warning naming both. A folder written before
manifests existed loads with a warning that it cannot be verified.

(Orbax and torchtitan's checkpointer stage the same way: write to a temporary location, then commit by rename.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import NamedTuple

from lowprec.errors import CheckpointError
from lowprec.storage import is_plain_name
from lowprec.train.fault_points import reached

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d+)$")


class CheckpointDamagedError(CheckpointError):
    """A checkpoint file is missing, truncated or altered (its size or sha256 differs from the manifest)."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without a manifest (written by an older lowprec) was loaded unverified."""


class CheckpointFallbackWarning(UserWarning):
    """The checkpoint asked for was damaged; an earlier complete one was loaded instead."""


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> dict:
    """Write ``folder/manifest.json``: ``{"files": {relative path: {"bytes": n, "sha256": hex}}}``; returns it."""
    folder = Path(folder)
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in _files(folder)
    }
    manifest = {"format": 1, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


#: Cap on ``manifest.json`` (a checkpoint's is a few hundred bytes per file).
MAX_MANIFEST_BYTES = 1 << 20


def verify(folder: Path) -> bool:
    """Check every file of the checkpoint ``folder`` against its manifest; True when verified, False (with an
    ``UnverifiedCheckpointWarning``) for a folder without a manifest.

    Raises ``CheckpointDamagedError`` naming the first file that is missing, of another size (truncated) or with
    another sha256 (altered), or a corrupt manifest.
    """
    folder = Path(folder)
    mpath = folder / MANIFEST
    if not mpath.exists():
        warnings.warn(
            f"checkpoint {str(folder)!r} has no {MANIFEST} (written by an older lowprec): it cannot be verified",
            UnverifiedCheckpointWarning,
            stacklevel=2,
        )
        return False
    if mpath.is_symlink() or not mpath.is_file() or mpath.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointDamagedError(f"checkpoint {str(folder)!r}: {MANIFEST} is not a regular file under its cap")
    try:
        files = json.loads(mpath.read_text())["files"]
        entries = sorted(files.items())
        for rel, want in entries:
            if not (isinstance(rel, str) and isinstance(want["bytes"], int) and isinstance(want["sha256"], str)):
                raise TypeError(f"entry {str(rel)[:80]!r} is not a file name with bytes and sha256")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointDamagedError(f"checkpoint {str(folder)!r}: {MANIFEST} is corrupt ({e})") from None
    for rel, want in entries:
        # A manifest is written by whoever sent the checkpoint: a name is a plain file of this folder, never a path
        # out of it or a link, so verifying reads nothing outside the folder.
        if not is_plain_name(rel):
            raise CheckpointDamagedError(
                f"checkpoint {str(folder)!r}: {MANIFEST} names {rel[:200]!r}, which is not a plain file name inside "
                "the checkpoint folder: refusing to read it"
            )
        p = folder / rel
        if p.is_symlink():
            raise CheckpointDamagedError(f"checkpoint {str(folder)!r}: {rel} is a symlink: refusing to read it")
        if not p.is_file():
            raise CheckpointDamagedError(f"checkpoint {str(folder)!r}: {rel} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointDamagedError(
                f"checkpoint {str(folder)!r}: {rel} has {size} bytes, the manifest says {want['bytes']} (truncated)"
            )
        if sha256_of(p) != want["sha256"]:
            raise CheckpointDamagedError(f"checkpoint {str(folder)!r}: {rel} differs from its sha256 in {MANIFEST}")
    return True


def staging_folder(final: Path) -> Path:
    """Where ``final`` is written before it is complete: ``<parent>/.<name>.partial`` (same file system, so the
    commit is one rename)."""
    final = Path(final)
    return final.parent / f".{final.name}.partial"


def start_staging(final: Path) -> Path:
    """An empty staging folder for ``final`` (a leftover of a save that was killed is removed)."""
    staging = staging_folder(final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


def commit(staging: Path, final: Path) -> None:
    """Write the manifest of the complete ``staging`` folder, then rename it to ``final`` (replacing an older
    ``final`` of the same step)."""
    reached("save.manifest")
    write_manifest(staging)
    reached("save.rename")
    if Path(final).exists():
        shutil.rmtree(final)
    os.replace(staging, final)


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    """The committed ``step_<N>`` folders of ``directory``, oldest first (``.partial`` folders are not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``step_<N>`` folders of ``directory`` (``keep`` 0: keep all); returns
    the deleted folders."""
    if keep <= 0:
        return []
    old = [p for _, p in step_folders(directory)[:-keep]]
    if old:
        reached("save.prune")
    for p in old:
        shutil.rmtree(p)
    return old


def _is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").exists() or (path / MANIFEST).exists()


def newest_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint folder, else the newest ``step_<N>`` in it (unverified).

    Raises ``CheckpointError`` when ``path`` holds no checkpoint.
    """
    path = Path(path)
    if _is_checkpoint(path):
        return path
    steps = step_folders(path)
    if not steps:
        raise CheckpointError(f"no checkpoint at {str(path)!r} (no .metadata, no step_<N> folders)")
    return steps[-1][1]


class Resolved(NamedTuple):
    """The checkpoint folder to load and, when it is not simply the one asked for, why: the fallback or the
    missing manifest (the run records it; empty when the asked-for checkpoint verified)."""

    path: Path
    note: str = ""


def resolve_resume(path: str | Path) -> Resolved:
    """The verified checkpoint folder to resume from, given ``resume=path``.

    ``path`` is a checkpoint folder (``.../step_<N>``) or a run's checkpoint directory holding ``step_<N>``
    folders (its newest complete one is taken). A damaged checkpoint is skipped for the newest earlier
    ``step_<M>`` beside it that verifies, with a ``CheckpointFallbackWarning`` naming both; a checkpoint without a
    manifest loads with an ``UnverifiedCheckpointWarning``. Both messages are also the returned ``note``.

    Raises ``CheckpointError`` when ``path`` holds no checkpoint, ``CheckpointDamagedError`` when the checkpoint
    is damaged and no earlier one verifies.
    """
    target = newest_checkpoint(path)
    candidates = [p for n, p in step_folders(target.parent) if n < _step_of(target)]
    try:
        with warnings.catch_warnings(record=True) as unverified:
            warnings.simplefilter("always", UnverifiedCheckpointWarning)
            verified = verify(target)
        for w in unverified:
            warnings.warn(w.message, w.category, stacklevel=2)
        return Resolved(target, "" if verified else str(unverified[0].message))
    except CheckpointDamagedError as damaged:
        for older in reversed(candidates):
            try:
                verify(older)
            except CheckpointDamagedError:
                continue
            note = f"{damaged}; resuming from the previous complete checkpoint {str(older)!r} instead"
            warnings.warn(note, CheckpointFallbackWarning, stacklevel=2)
            return Resolved(older, note)
        raise CheckpointDamagedError(f"{damaged}; and no earlier complete checkpoint beside it") from None


def _step_of(path: Path) -> int:
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else 1 << 62  # a folder not named step_<N>: every step_<N> beside it is earlier
