"""``lowprec sync PATH``: replay the tracking writes a run spooled while its server did not answer
(``lowprec_lab/tracking/spool.py``), in order, to the store the user configures (``tracking.uri=...``, else the
default).

A spool file may come from someone else: it is data. It replays only to the configured store (a spool whose header
names another store is refused, unless that store is given with ``tracking.uri=``), and only files inside its own
``<run id>.files/`` folder are uploaded. That folder must be a real folder of the user's (not a symbolic link), a
``file`` record must name a path inside it without ``..`` and without a symbolic link anywhere along it (checked
before anything is replayed), and each file is opened once, by ``openat`` with ``O_NOFOLLOW`` from the folder's
own descriptor, component by component (``open_spooled``); what is uploaded is a private copy read from that
descriptor (``upload_spooled``), so a file or folder swapped for a link after the checks is never followed."""

from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import stat
import sys
import tempfile
from pathlib import Path, PurePosixPath

from mlflow.tracking import MlflowClient

from lowprec.errors import UserError
from lowprec.storage import disk_errno
from lowprec_lab.tracking.spool import (
    ReplayInterrupted,
    SpoolError,
    is_transient,
    read_header,
    read_spool,
    replay,
    short_reason,
)
from lowprec_lab.tracking.tracker import TrackingError, check_reachable, quiet_disk_full_logs, resolve_uri

USAGE = "usage: lowprec sync PATH [tracking.uri=URI]   (PATH: a spool file, a folder of them, or a runs folder)"


def spool_files(path: Path) -> list[Path]:
    """The spool files ``path`` names: itself, the ``*.jsonl`` files in it, or those of its ``spool/`` subfolder
    (``paths.runs``). Raises ``SpoolError`` for a missing path or a file that is not a spool."""
    if not path.exists():
        raise SpoolError(f"no spool file or folder at '{path}'")
    if path.is_dir():
        folder = path / "spool" if (path / "spool").is_dir() else path
        files = sorted(folder.glob("*.jsonl"))
    else:
        files = [path]
    for f in files:
        read_header(f)  # every file is a spool before anything is replayed
    return files


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: ``O_NONBLOCK``: a FIFO put in the folder must not hang the open; it is then refused as not a regular file.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _why(e: OSError, name: str, dir_fd: int) -> str:
    """Why ``name`` (in the folder ``dir_fd``) could not be opened: ``O_NOFOLLOW`` on a link fails with ``ELOOP``,
    or with ``ENOTDIR`` when ``O_DIRECTORY`` is asked too, as for a file."""
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if link or e.errno in (errno.ELOOP, errno.EMLINK):
        return "is a symbolic link"
    if e.errno == errno.ENOTDIR:
        return "is not a folder"
    if e.errno == errno.ENOENT:
        return "does not exist"
    return f"cannot be opened ({os.strerror(e.errno or 0)})"


def _walk(spool: Path, rec_path: object, open_file: bool) -> int | None:
    """Follow the ``file`` record path ``rec_path`` of ``spool`` from the spool's folder, one component at a time
    with ``O_NOFOLLOW``: ``<run id>.files`` (a real folder owned by this user), its subfolders, the file (a
    regular file). Returns the file's descriptor when ``open_file`` (the caller closes it), else None (checked
    with ``lstat`` only, never opened). Raises ``SpoolError`` (one line) for anything else."""

    def refuse(why: str):
        raise SpoolError(f"{spool}: a file record names {rec_path!r}, {why}; refused")

    files = spool.with_suffix(".files").name
    if not isinstance(rec_path, str) or not rec_path:
        refuse("which is not a path")
    path = PurePosixPath(rec_path)
    if path.is_absolute() or ".." in path.parts:
        refuse(f"outside its own folder {files}")
    if len(path.parts) < 2 or path.parts[0] != files:
        refuse(f"not a file inside its own folder {files}")
    fd = os.open(spool.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(path.parts[:-1]):
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                refuse(f"but {'/'.join(path.parts[: i + 1])} {_why(e, part, fd)}")
            os.close(fd)
            fd = nxt
            if i == 0 and os.fstat(fd).st_uid != os.getuid():
                refuse(f"but its folder {files} belongs to uid {os.fstat(fd).st_uid}, not to this user")
        if not open_file:
            try:
                st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
            except OSError as e:
                refuse(f"but it {_why(e, path.name, fd)}")
            if not stat.S_ISREG(st.st_mode):
                refuse("but it is a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file")
            return None
        try:
            out = os.open(path.name, _FILE, dir_fd=fd)
        except OSError as e:
            refuse(f"but it {_why(e, path.name, fd)}")
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        refuse("not a regular file")
    return out


def check_spooled(spool: Path, rec_path: object) -> None:
    """Raise ``SpoolError`` (one line) unless the ``file`` record path ``rec_path`` of ``spool`` names a regular
    file inside the spool's own ``<run id>.files/`` folder, a real folder owned by this user, through real
    subfolders: no absolute path, no ``..``, no symbolic link at any component. Opens no file."""
    _walk(spool, rec_path, open_file=False)


def open_spooled(spool: Path, rec_path: object) -> int:
    """A read-only descriptor of the file the ``file`` record path ``rec_path`` of ``spool`` names, opened once by
    ``openat(O_NOFOLLOW)`` from the descriptor of ``<run id>.files/`` (itself opened ``O_NOFOLLOW``), component by
    component: whatever is swapped for a symbolic link after ``check_spooled`` is refused, never followed. The
    caller closes it. Raises ``SpoolError`` as ``check_spooled`` does."""
    fd = _walk(spool, rec_path, open_file=True)
    assert fd is not None
    return fd


def upload_spooled(client, run_id: str, spool: Path, rec_path: str, artifact_path: str | None) -> None:
    """Upload the file ``rec_path`` of ``spool`` as an artifact of ``run_id`` (under ``artifact_path``): copied
    from ``open_spooled``'s descriptor into a private temporary folder (mode 0700), and that copy uploaded with
    MLflow, which opens paths by name. Raises ``SpoolError`` as ``check_spooled``."""
    fd = open_spooled(spool, rec_path)
    with os.fdopen(fd, "rb") as src, tempfile.TemporaryDirectory(prefix="lowprec-sync-") as tmp:
        copy = Path(tmp) / PurePosixPath(rec_path).name  # the artifact keeps the file's name
        with open(copy, "xb") as dst:
            shutil.copyfileobj(src, dst)
        client.log_artifact(run_id, str(copy), artifact_path)


class _OpenOnce:
    """``client`` (an ``MlflowClient``) for the replay of ``spool``: every call goes to it, except ``log_artifact``,
    which uploads through ``upload_spooled`` the file of the spool's own folder that the path it is given names
    (the replay passes it by name, as ``spool.spooled_file`` resolved it)."""

    def __init__(self, client, spool: Path):
        self._client, self._spool = client, spool

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        target = Path(os.path.abspath(local_path))
        for base in (Path(os.path.abspath(self._spool.parent)), self._spool.parent.resolve()):
            if target.is_relative_to(base):
                rec_path = target.relative_to(base).as_posix()
                return upload_spooled(self._client, run_id, self._spool, rec_path, artifact_path)
        raise SpoolError(f"{self._spool}: a file record names {local_path!r}, outside its own folder; refused")


def _check_files(spool: Path) -> None:
    """``check_spooled`` for every ``file`` record of ``spool``, before any record is replayed."""
    for rec in read_spool(spool).records:
        if rec["op"] == "file":
            check_spooled(spool, rec.get("path"))


def _warn(msg: str) -> None:
    print(f"lowprec sync: warning: {msg}", file=sys.stderr)


_OVERRIDE = re.compile(r"^[+~]{0,2}[\w.]+=")


def sync_main(argv: list[str], tracking_of) -> int:
    """Run ``lowprec sync PATH [key=value ...]``; ``tracking_of(overrides)`` is the ``tracking`` node
    (``TrackingConfig``) of the ``ablate`` config with the overrides, a bad one a ``UserError``; the writes go to its
    ``uri``. Returns 0 when everything spooled under the path has been replayed (or there
    was nothing), 2 with one line for a missing path, a file that is not a spool or is malformed, a spool that names
    another store than the configured one (without ``tracking.uri=`` on the command line), a bad override, or a
    server that still fails."""
    paths = [a for a in argv if not _OVERRIDE.match(a)]
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    if len(paths) != 1 or paths[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        files = spool_files(Path(paths[0]))
        tracking = tracking_of(overrides)
        named = any(a.lstrip("+~").startswith("tracking.uri=") for a in overrides)
        if not files:
            print(f"sync: nothing spooled under {paths[0]}")
            return 0
        target = resolve_uri(tracking.uri)
        for f in files:
            written_for = read_header(f)["uri"]
            if not named and written_for != target:
                raise SpoolError(
                    f"{f} was written for the store {written_for}, not the configured {target}: a spool replays "
                    f"only to the store you name; if {written_for} is yours, run lowprec sync "
                    f"{shlex.quote(str(f))} {shlex.quote('tracking.uri=' + written_for)}"
                )
            _check_files(f)
            check_reachable(target)
            quiet_disk_full_logs()  # a store still full is told in one line below, not by MLflow's traceback log
            try:
                r = replay(_OpenOnce(MlflowClient(target), f), f, warn=_warn)
            except ReplayInterrupted as e:
                if disk_errno(e.cause) is not None:  # a local store whose disk is still full
                    raise TrackingError(
                        f"{target} still cannot take writes ({short_reason(e.cause)}) after {e.done} of {e.of} "
                        f"write(s) of {f}; the rest stays spooled: free space there and run lowprec sync again"
                    ) from None
                if not is_transient(e.cause):
                    raise TrackingError(
                        f"{target} refused write {e.done + 1} of {e.of} of {f} ({short_reason(e.cause)}); "
                        "the rest stays spooled"
                    ) from None
                raise TrackingError(
                    f"tracking server {target} failed after {e.done} of {e.of} write(s) of {f} "
                    f"({short_reason(e.cause)}); the rest stays spooled: run lowprec sync again"
                ) from None
            end = f", ended {r.end}" if r.end else ", no end status in the spool (its process did not end the run)"
            print(f"sync: run {r.run_id}: replayed {r.writes} write(s) ({r.metrics} metric values){end} to {target}")
    except UserError as e:
        line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        print(f"lowprec sync: error: {line}", file=sys.stderr)
        return 2
    return 0
