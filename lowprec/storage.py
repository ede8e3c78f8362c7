"""Disk failures told in one line: a full disk (``ENOSPC``), an exhausted quota (``EDQUOT``) or a read-only file
system (``EROFS``) found anywhere in an exception, as libraries wrap it (torch's ``CheckpointException`` per rank,
``__cause__``/``__context__`` chains, sqlite's ``database or disk is full``), turned into a ``DiskError`` that names
the folder, its mount point and the bytes free there."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from lowprec.errors import DiskError

#: The errnos that mean "this disk cannot take the write" (not a bug, not a bad path): the user frees space or
#: points the run elsewhere, and the run can resume.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
#: How libraries that drop the errno say it: C stdio/strerror, sqlite (``SQLITE_FULL``), torch's stream writer.
_FULL_TEXTS = ("no space left on device", "database or disk is full", "disk quota exceeded")
#: How sqlite says that its file became read-only under an open store (``SQLITE_READONLY``: the file system was
#: remounted read-only, or the file's permissions changed): the errno is gone.
_READ_ONLY_TEXTS = ("attempt to write a readonly database", "read-only file system")


def _chain(e: BaseException):
    """``e`` and every exception inside it: causes, contexts and the per-rank failures of a DCP
    ``CheckpointException`` (its ``failures``: rank -> (exception, stack summary))."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())
        todo.extend((x.__cause__, x.__context__))


def disk_errno(e: BaseException) -> int | None:
    """The errno of the disk failure inside ``e`` (one of ``DISK_ERRNOS``; ``ENOSPC`` for a library's text that
    says the disk is full, ``EROFS`` for one that says the file is read-only), or None when ``e`` is no disk
    failure."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in DISK_ERRNOS:
            return x.errno
    for x in _chain(e):
        text = str(x).lower()
        if any(t in text for t in _FULL_TEXTS):
            return errno.ENOSPC
        if any(t in text for t in _READ_ONLY_TEXTS):
            return errno.EROFS
    return None


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system that holds ``path`` (its nearest existing ancestor)."""
    p = Path(os.path.abspath(path))
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


def describe(path: str | Path) -> str:
    """``disk <mount point> (<N> MiB free)`` for the file system of ``path``; without the free space if it
    cannot be read."""
    mount = mount_point(path)
    try:
        free = shutil.disk_usage(mount).free
    except OSError:
        return f"disk {str(mount)!r}"
    return f"disk {str(mount)!r} ({free / 2**20:.0f} MiB free)"


def disk_error(what: str, path: str | Path, e: BaseException) -> DiskError | None:
    """A one-line ``DiskError`` for ``e`` raised while ``what`` (e.g. ``"writing checkpoint 'runs/.../step_4'"``)
    under ``path``, or None when ``e`` is not a disk failure (a bug keeps its own exception and traceback)."""
    code = disk_errno(e)
    if code is None:
        return None
    name = errno.errorcode.get(code, str(code))
    err = DiskError(f"{os.strerror(code)} ({name}) {what}: {describe(path)}")
    err.errno = code  # the message alone, without OSError's "[Errno N]" prefix
    return err


def is_plain_name(name) -> bool:
    """True for a name read from a file that stays inside the folder it is listed in: a non-empty string with no
    path separator (``/`` or ``\\``), not ``.`` or ``..``, no NUL. (Symlinks are the caller's to refuse: this looks
    at the name only.)"""
    return isinstance(name, str) and bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
