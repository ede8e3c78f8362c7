"""Checkpoint folders named by a run's tags, confined to this store's own folder of that run.

A tag is a record of the tracking store, which whoever can write the store's tags (a replayed spool, a shared server
without login) can set to any folder; a checkpoint folder is read only when it lies inside
``<paths.runs>/checkpoints/<run id>``, the folder this store's run writes (``lowprec_lab.runner.run.run_one``)."""

from __future__ import annotations

import re
from pathlib import Path

from lowprec.errors import CheckpointError

#: The form of an MLflow run id before it names a folder (MLflow writes 32 hex digits): no separator, no ``..``.
RUN_ID_FORM = re.compile(r"[A-Za-z0-9_-]{1,64}")


def own_checkpoint_dir(runs: str | Path, run_id: str) -> Path:
    """The checkpoint folder this store's run ``run_id`` writes (``<runs>/checkpoints/<run id>``, as
    ``lowprec_lab.runner.run.run_one`` sets its ``checkpoint_dir`` tag), resolved. ``runs``: ``paths.runs`` of this
    command. Raises ``CheckpointError`` for a run id that is not one (it would name another folder)."""
    if not RUN_ID_FORM.fullmatch(str(run_id)):
        raise CheckpointError(f"{str(run_id)[:80]!r} is not a run id: it names no checkpoint folder")
    return (Path(runs).resolve() / "checkpoints" / run_id).resolve()


def inside(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or lies below it (both resolved by the caller)."""
    return path == root or path.is_relative_to(root)


def tagged_checkpoint_dir(runs: str | Path, run_id: str, tagged: str | None) -> tuple[Path | None, str]:
    """The run's ``checkpoint_dir`` tag as a folder to read checkpoints from, or None and why not.

    A tag is a record of the store, which whoever can write the store's tags (a replayed spool, a shared server
    without login) can set to any folder: it is used only when it resolves (symlinks followed) inside this store's
    own checkpoint folder of that run (``own_checkpoint_dir``). Anything else is never read: None with a one-line
    note naming the tag and the folder it had to lie in."""
    if not tagged:
        return None, "no checkpoint_dir"
    try:
        root = own_checkpoint_dir(runs, run_id)
    except CheckpointError as e:
        return None, str(e)
    folder = Path(tagged).resolve()
    if not inside(folder, root):
        return None, f"its checkpoint_dir tag {str(tagged)[:200]!r} lies outside this store's folder {root}: not read"
    return folder, ""
