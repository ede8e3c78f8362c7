"""The tracking spool: the writes a tracking server could not take, kept in order on local disk and replayed later.
A local sqlite store on a full disk spools the same way (``Tracker``): its writes wait in the spool until the store
takes them again (later in the run, or through ``lowprec sync``).

With ``tracking.uri=http://...`` each write of a run (metrics, params, tags, artifacts, the final status) is tried
once and fails fast (``fail_fast``: no retry, a ``WRITE_TIMEOUT_S`` timeout, instead of MLflow's minutes of
backoff). A write the server cannot take (unreachable, timed out, HTTP 5xx) is appended to
``<paths.runs>/spool/<run id>.jsonl``, and every later write of that run follows it there, so the order is kept. The
run's next write after a pause (``RETRY_FIRST_S``, doubling up to ``RETRY_MAX_S``) first replays the spool, and the
run's end always tries; what is still spooled when the process ends is replayed by ``lowprec sync``
(``experiments/tracking/sync.py``). A 4xx answer (a bad request) is not a server failure: it raises, as without a spool.

The file is JSON lines, appended with one ``write`` and an ``fsync`` per record::

    {"lowprec_spool": 1, "run_id": "...", "uri": "http://...", "earlier_writes": 0}      <- header
    {"op": "batch", "metrics": [[key, value, timestamp_ms, step], ...], "params": [[k, v], ...], "tags": [[k, v]]}
    {"op": "text", "name": "config.yaml", "text": "..."}
    {"op": "dict", "name": "effective_recipe.json", "obj": {...}}
    {"op": "file", "path": "<run id>.files/<token>/<name>", "folder": null}   <- a copy of the file, taken at once
    {"op": "input", "dataset": {"name": ..., "digest": ..., "source_type": ..., "source": ...}, "context": "training"}
    {"op": "end", "status": "FINISHED", "end_time": 1764000000000}

``<run id>.cursor`` holds how many records have been replayed; it is advanced after each one, so an interrupted
replay resumes after the last record the server took. The record in flight when a replay is interrupted may be sent
twice, which MLflow absorbs: the SQL store drops a metric identical in key, value, timestamp and step (metrics keep
the timestamp they were logged with), a param logged again with its value and a tag or artifact written again are
no-ops, and the end record carries its end time. Before the end record (or at the end of a replay without one) the
run gets the tag ``tracking_spooled_writes`` (all writes of the run that went through a spool), so a spooled run is
never silent. A file fully replayed is removed. A truncated last line (a process killed in the middle of a write) is
skipped with a warning; any other unreadable line stops the replay with one line naming it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests
from filelock import FileLock
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from lowprec.errors import UserError

#: The seconds one write may wait for the server (MLflow's ``MLFLOW_HTTP_REQUEST_TIMEOUT``, default 120 s, with
#: 7 retries: minutes of stalled training per write).
WRITE_TIMEOUT_S = 10
#: After a failed write, later writes go straight to the spool for this long before the server is tried again
#: (doubling up to ``RETRY_MAX_S``): a hung server costs at most one timeout per pause, not one per write.
RETRY_FIRST_S = 2.0
RETRY_MAX_S = 30.0
#: The run tag that says how many writes of the run went through a spool.
SPOOLED_TAG = "tracking_spooled_writes"
VERSION = 1
OPS = ("batch", "text", "dict", "file", "input", "end")


class SpoolError(UserError):
    """A path given to ``lowprec sync`` that is missing, not a spool file, or a spool with a corrupt record."""


# --- records -----------------------------------------------------------------------------------------------------


def batch_record(metrics: Iterable[Metric] = (), params: Iterable[Param] = (), tags: Iterable[RunTag] = ()) -> dict:
    """One ``log_batch`` call as a record; metrics keep their timestamp (ms) and step."""
    return {
        "op": "batch",
        "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
        "params": [[p.key, p.value] for p in params],
        "tags": [[t.key, t.value] for t in tags],
    }


def end_record(status: str) -> dict:
    """``set_terminated`` with this status and the end time now (ms), kept for a replay."""
    return {"op": "end", "status": status, "end_time": int(time.time() * 1000)}


def apply(client, run_id: str, rec: dict, base: Path | None = None) -> None:
    """Send one record to the store behind ``client``. A ``file`` record's relative path is under ``base``."""
    op = rec["op"]
    if op == "batch":
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in rec["metrics"]],
            params=[Param(k, v) for k, v in rec["params"]],
            tags=[RunTag(k, v) for k, v in rec["tags"]],
        )
    elif op == "text":
        client.log_text(run_id, rec["text"], rec["name"])
    elif op == "dict":
        client.log_dict(run_id, rec["obj"], rec["name"])
    elif op == "file":
        path = Path(rec["path"])
        client.log_artifact(run_id, str(path if path.is_absolute() or base is None else base / path), rec["folder"])
    elif op == "input":  # a dataset the run used (MLflow's Datasets column), as ``mlflow.log_input`` logs it
        tags = [InputTag("mlflow.data.context", rec["context"])]
        client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**rec["dataset"]), tags)])
    elif op == "end":
        client.set_terminated(run_id, rec["status"], end_time=rec["end_time"])
    else:
        raise ValueError(f"unknown spool record {op!r}")


def is_transient(e: BaseException) -> bool:
    """True for a failure of the server or the way to it (no connection, timeout, HTTP 5xx), which the spool
    absorbs; False for a request the server refused (4xx), which is a bug to report, not to retry."""
    if isinstance(e, MlflowException):  # MLflow wraps connection errors and timeouts as INTERNAL_ERROR (500)
        return e.get_http_status_code() >= 500
    if isinstance(e, requests.HTTPError):  # the artifact upload's raise_for_status
        return e.response is None or e.response.status_code >= 500
    return isinstance(e, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))


@contextmanager
def fail_fast(timeout_s: int = WRITE_TIMEOUT_S) -> Iterator[None]:
    """MLflow's HTTP client without retries and with a ``timeout_s`` timeout, for the calls inside.

    ``mlflow.utils.rest_utils.http_request`` reads ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and
    ``MLFLOW_HTTP_REQUEST_TIMEOUT`` at every call; the RestStore offers no per-call setting. The training loop is
    single-threaded, so setting them around the call changes nothing else.
    """
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout_s))}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def short_reason(e: BaseException) -> str:
    """The useful part of an MLflow connection error (``[Errno 111] Connection refused``, ``Read timed out``, an
    HTTP status) rather than its paragraph."""
    text = str(e)
    patterns = (
        r"database or disk is full",  # sqlite's SQLITE_FULL, inside MLflow's paragraph about it
        r"attempt to write a readonly database",  # SQLITE_READONLY: the store's file system turned read-only
        r"\[Errno -?\d+\] [^'\")]+",
        r"Read timed out",
        r"\d{3} Server Error[^\n]*",
        r"too many \d{3}",
    )
    for pattern in patterns:
        m = re.search(pattern, text)
        if m:
            return m.group(0).strip()
    inner = re.findall(r"(\w+)\('([^']+)'\)", text)  # urllib3's innermost cause: RemoteDisconnected('...')
    if inner:
        return f"{inner[-1][0]}: {inner[-1][1]}"
    return text.splitlines()[0][:200] if text else type(e).__name__


# --- files ---------------------------------------------------------------------------------------------------------


def spool_path(folder: Path, run_id: str) -> Path:
    """Where the writes of ``run_id`` are spooled: ``<folder>/<run id>.jsonl``."""
    return folder / f"{run_id}.jsonl"


def _cursor_path(path: Path) -> Path:
    return path.with_suffix(".cursor")


def _files_dir(path: Path) -> Path:
    return path.with_suffix(".files")


def _lock(path: Path) -> FileLock:
    # Per run: the run's process appends while a `lowprec sync` elsewhere may be replaying the same file.
    return FileLock(str(path.with_suffix(".lock")))


@dataclass
class Spool:
    """A spool file as read: its header, its records in order, and the warning about a truncated last line."""

    path: Path
    header: dict
    records: list[dict]
    warning: str | None = None

    @property
    def run_id(self) -> str:
        return self.header["run_id"]

    @property
    def uri(self) -> str:
        return self.header["uri"]


#: A run id as a file name may hold it (MLflow's are 32 hex digits); a spool is named after its run, so the header
#: must name the same run.
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def read_header(path: Path) -> dict:
    """The header of the spool file ``path``; raises ``SpoolError`` (one line) when it is not one: not JSON, another
    format version, a run id that is not an MLflow run id or not the file's name, a URI that is not a string."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        header = json.loads(first)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or "lowprec_spool" not in header:
        raise SpoolError(f"{path} is not a lowprec spool file (its first line is not a spool header)")
    if header["lowprec_spool"] != VERSION:
        raise SpoolError(f"{path}: spool format {header['lowprec_spool']!r} is not {VERSION} (a newer lowprec?)")
    run_id, uri = header.get("run_id"), header.get("uri")
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or path.suffix == ".jsonl" and path.stem != run_id:
        raise SpoolError(f"{path}: the spool header's run id {run_id!r} is not this file's run id")
    if not isinstance(uri, str) or not uri:
        raise SpoolError(f"{path}: the spool header's tracking URI {uri!r} is not a URI")
    if not isinstance(header.get("earlier_writes", 0), int):
        raise SpoolError(f"{path}: the spool header's earlier_writes {header['earlier_writes']!r} is not a count")
    return header


def spooled_file(path: Path, rec_path: object) -> Path:
    """The file a ``file`` record of the spool ``path`` names, checked to lie inside the spool's own
    ``<run id>.files/`` folder (symbolic links resolved): a spool is data someone may have sent, and must not make
    ``lowprec sync`` upload ``/etc/passwd`` or a home dotfile. Raises ``SpoolError`` otherwise."""
    files = _files_dir(path).resolve()
    if not isinstance(rec_path, str) or Path(rec_path).is_absolute():
        raise SpoolError(f"{path}: a file record names {rec_path!r}, outside its own folder {files}; refused")
    target = (path.parent / rec_path).resolve()
    if not target.is_relative_to(files) or not target.is_file():
        raise SpoolError(f"{path}: a file record names {rec_path!r}, not a file inside {files}; refused")
    return target


#: The fields of ``mlflow.entities.Dataset`` an ``input`` record may set.
_DATASET_FIELDS = {"name", "digest", "source_type", "source", "schema", "profile"}


def _check_record(path: Path, rec: dict) -> None:
    """Raise ``SpoolError`` for a record whose fields would not replay (checked for the whole file before any
    write, so a malformed spool is reported as such, never as a server failure)."""
    op = rec["op"]
    if op == "file":
        spooled_file(path, rec.get("path"))
        ok = rec.get("folder") is None or isinstance(rec.get("folder"), str)
    elif op == "batch":
        ok = all(isinstance(rec.get(k), list) for k in ("metrics", "params", "tags"))
        ok = ok and all(isinstance(m, list) and len(m) == 4 for m in rec["metrics"])
        ok = ok and all(isinstance(t, list) and len(t) == 2 for t in rec["params"] + rec["tags"])
    elif op == "text":
        ok = isinstance(rec.get("text"), str) and isinstance(rec.get("name"), str)
    elif op == "dict":
        ok = isinstance(rec.get("obj"), dict) and isinstance(rec.get("name"), str)
    elif op == "input":
        ds = rec.get("dataset")
        ok = isinstance(ds, dict) and {"name", "digest"} <= ds.keys() <= _DATASET_FIELDS
        ok = ok and all(isinstance(v, str) for v in ds.values())
        ok = ok and isinstance(rec.get("context", ""), str)
    else:
        ok = isinstance(rec.get("status"), str) and isinstance(rec.get("end_time"), int)
    if op in ("text", "dict") and ok:
        name = Path(rec["name"])
        ok = not name.is_absolute() and ".." not in name.parts
    if not ok:
        raise SpoolError(f"{path}: a {op!r} record is malformed; nothing was replayed")


def read_spool(path: Path) -> Spool:
    """Read every record of ``path``. A last line that does not parse (its writer was killed mid-write) is left
    out with ``Spool.warning``; any other such line raises ``SpoolError``: the records after it could not be
    replayed in order."""
    header = read_header(path)
    lines = path.read_bytes().split(b"\n")[1:]
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last record
    records, warning = [], None
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and rec.get("op") in OPS
        except (UnicodeDecodeError, json.JSONDecodeError):
            ok = False
        if ok:
            _check_record(path, rec)
            records.append(rec)
        elif i == len(lines) - 1:
            warning = (
                f"{path}: skipped its last line ({len(line)} bytes, not a complete record: the process writing it "
                "was stopped mid-write)"
            )
        else:
            raise SpoolError(f"{path}: line {i + 2} is not a spool record; the records after it cannot be replayed")
    return Spool(path, header, records, warning)


def _read_cursor(path: Path, records: int | None = None) -> int:
    """How many records of ``path`` were replayed; raises ``SpoolError`` for a cursor that is not a count of them."""
    try:
        text = _cursor_path(path).read_text().strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as e:
        raise SpoolError(f"{_cursor_path(path)} cannot be read ({e})") from None
    if not text:
        return 0
    if not text.isdigit() or (records is not None and int(text) > records):
        raise SpoolError(
            f"{_cursor_path(path)} holds {text[:40]!r}, not a count of the {records} record(s) of {path.name}"
        )
    return int(text)


def _write_cursor(path: Path, n: int) -> None:
    tmp = _cursor_path(path).with_suffix(".cursor.tmp")
    tmp.write_text(str(n))
    os.replace(tmp, _cursor_path(path))


def _append_line(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:  # a nearly full disk takes part of a write and returns its count; the next write raises ENOSPC
            view = view[os.write(fd, view) :]
        os.fsync(fd)  # the spool may be the only copy of a finished run's results
    finally:
        os.close(fd)


def append(path: Path, run_id: str, uri: str, rec: dict, earlier_writes: int = 0) -> None:
    """Append ``rec`` to the spool of ``run_id`` at ``path`` (created with its header if missing). A ``file``
    record's file is copied beside the spool now, since the original may change before the replay.

    All or nothing: when a write fails (the spool's disk is full too: ``OSError``, raised), the file is cut back to
    what it held (a spool it created is removed, with the copy of a ``file`` record), so no header without a record
    and no half line is left for the next command's sweep to refuse."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        size = path.stat().st_size if path.exists() else None
        copy = None
        try:
            if rec["op"] == "file":
                src = Path(rec["path"])
                dest = _files_dir(path) / secrets.token_hex(6) / src.name
                copy = dest.parent
                dest.parent.mkdir(parents=True)
                shutil.copyfile(src, dest)
                rec = {**rec, "path": str(dest.relative_to(path.parent))}
            if size is None:
                header = {"lowprec_spool": VERSION, "run_id": run_id, "uri": uri, "earlier_writes": earlier_writes}
                _append_line(path, (json.dumps(header) + "\n").encode())
            _append_line(path, (json.dumps(rec) + "\n").encode())
        except OSError:
            if size is None:
                path.unlink(missing_ok=True)
            else:
                os.truncate(path, size)
            if copy is not None:
                shutil.rmtree(copy, ignore_errors=True)
            raise


def remove(path: Path) -> None:
    """Remove a fully replayed spool: the file, its cursor, its copied artifacts and its lock file."""
    for p in (path, _cursor_path(path), path.with_suffix(".lock")):
        p.unlink(missing_ok=True)
    shutil.rmtree(_files_dir(path), ignore_errors=True)


# --- replay --------------------------------------------------------------------------------------------------------


@dataclass
class Replayed:
    """What one ``replay`` sent: ``writes`` records (``metrics`` metric values among them), and the final status if
    the spool ended with the run's end. ``total`` is the run's ``tracking_spooled_writes``."""

    run_id: str
    writes: int = 0
    metrics: int = 0
    end: str | None = None
    total: int = 0
    warnings: list[str] = field(default_factory=list)


class ReplayInterrupted(Exception):
    """A replay stopped by a failing write; ``done`` of ``of`` records were sent (the cursor says so), ``cause`` is
    the failure."""

    def __init__(self, path: Path, done: int, of: int, cause: BaseException):
        super().__init__(f"{path}: {done} of {of} spooled write(s) replayed, then: {short_reason(cause)}")
        self.path, self.done, self.of, self.cause = path, done, of, cause


def replay(client, path: Path, warn: Callable[[str], None] = lambda s: None) -> Replayed:
    """Send the records of the spool ``path`` not yet replayed, in order, to ``client``'s store; remove the file
    once all are. Raises ``ReplayInterrupted`` when a write fails (the cursor keeps what was sent), ``SpoolError``
    for a file that is not a spool or has a corrupt record."""
    with _lock(path):
        if not path.exists():  # replayed meanwhile by another process
            return Replayed(run_id=path.stem)
        spool = read_spool(path)
        out = Replayed(spool.run_id, total=int(spool.header.get("earlier_writes", 0)) + len(spool.records))
        if spool.warning:
            out.warnings.append(spool.warning)
            warn(spool.warning)
        start = _read_cursor(path, len(spool.records))
        todo = spool.records[start:]
        tagged = False
        for i, rec in enumerate(todo):
            try:
                if rec["op"] == "end":  # the status is the run's last write
                    apply(client, spool.run_id, batch_record(tags=[RunTag(SPOOLED_TAG, str(out.total))]))
                    tagged = True
                if rec["op"] == "file":  # checked again here: the file may have changed since read_spool
                    rec = {**rec, "path": str(spooled_file(path, rec["path"]))}
                apply(client, spool.run_id, rec)
            except SpoolError:
                raise
            except Exception as e:
                raise ReplayInterrupted(path, start + i, len(spool.records), e) from e
            _write_cursor(path, start + i + 1)
            out.writes += 1
            out.metrics += len(rec.get("metrics", ()))
            out.end = rec["status"] if rec["op"] == "end" else out.end
        if not tagged:
            try:
                apply(client, spool.run_id, batch_record(tags=[RunTag(SPOOLED_TAG, str(out.total))]))
            except Exception as e:
                raise ReplayInterrupted(path, len(spool.records), len(spool.records), e) from e
        remove(path)
    return out


# --- in the training process ---------------------------------------------------------------------------------------


@dataclass
class _Pending:
    path: Path
    delay_s: float = RETRY_FIRST_S
    retry_at: float = 0.0
    spooled: int = 0


def _say(msg: str) -> None:
    print(f"lowprec: {msg}", file=sys.stderr, flush=True)


class Spooler:
    """The spool of one ``Tracker``: which of its runs are spooling and when to try the store again. Every write
    of a run goes through ``send``.

    Args:
        folder: the spool folder (``<paths.runs>/spool``).
        uri: the tracking store, recorded in each spool's header for ``lowprec sync``.
        transient: which failures of a write the spool absorbs (default ``is_transient``: a tracking server that
            does not answer; a local sqlite store passes its disk-full test); any other failure raises.
        what: how messages name the store (default ``tracking server <uri>``).
        down: how messages say the store fails (default ``does not answer``); ``back``: that it works again.
    """

    def __init__(
        self,
        folder: Path,
        uri: str,
        transient: Callable[[BaseException], bool] = is_transient,
        what: str = "",
        down: str = "does not answer",
        back: str = "the server answers",
    ):
        self.folder, self.uri = Path(folder), uri
        self.transient = transient
        self.what = what or f"tracking server {uri}"
        self.down, self.back = down, back
        self._pending: dict[str, _Pending] = {}
        self._replayed: dict[str, int] = {}  # writes of a run replayed so far (the header's earlier_writes)

    def pending(self) -> dict[str, Path]:
        """Runs of this process with spooled writes not yet replayed, and their spool files."""
        return {r: p.path for r, p in self._pending.items()}

    def send(self, client, run_id: str, rec: dict, final: bool = False) -> None:
        """Write ``rec`` to the server, or to the run's spool when the server fails or the run is spooling.

        A spooling run's writes are appended until its pause ends; the next write then replays the spool first and
        goes to the server only when the spool is empty. ``final`` (the run's end) always tries the server, and
        says on stderr where the results wait when it cannot reach it. Raises a non-transient failure (HTTP 4xx).
        """
        p = self._pending.get(run_id)
        if p is not None and (final or time.monotonic() >= p.retry_at):
            self._drain(client, run_id, p)
            p = self._pending.get(run_id)
        if p is None:
            try:
                with fail_fast():
                    apply(client, run_id, rec)
                return
            except Exception as e:
                if not self.transient(e):
                    raise
                p = self._start(run_id, e)
        append(p.path, run_id, self.uri, rec, self._replayed.get(run_id, 0))
        p.spooled += 1
        if final:
            self._pending.pop(run_id, None)
            _say(
                f"run {run_id} ended {rec.get('status', '')} here, but the {self.what} {self.down}: "
                f"its results are spooled in {p.path}; replay them with: lowprec sync {shlex.quote(str(p.path))} "
                f"{shlex.quote('tracking.uri=' + self.uri)}"
            )

    def drain(self, client, run_ids: Iterable[str]) -> list[Path]:
        """Replay the spool files of ``run_ids`` found in the folder (also those another process of an ablation
        wrote); returns those still not replayed."""
        left = []
        for run_id in run_ids:
            path = spool_path(self.folder, run_id)
            if not path.exists():
                continue
            try:
                with fail_fast():
                    replay(client, path, warn=lambda s: _say(f"warning: {s}"))
                self._pending.pop(run_id, None)
            except ReplayInterrupted as e:
                if not self.transient(e.cause):
                    raise
                left.append(path)
        return left

    def _start(self, run_id: str, e: BaseException) -> _Pending:
        path = spool_path(self.folder, run_id)
        p = self._pending[run_id] = _Pending(path, retry_at=time.monotonic() + RETRY_FIRST_S)
        _say(
            f"{self.what} failed ({short_reason(e)}); run {run_id} goes on, its writes are spooled "
            f"in {path} and replayed when {self.back}"
        )
        return p

    def _drain(self, client, run_id: str, p: _Pending) -> None:
        try:
            with fail_fast():
                r = replay(client, p.path, warn=lambda s: _say(f"warning: {s}"))
        except ReplayInterrupted as e:
            if not self.transient(e.cause):
                raise
            p.delay_s = min(2 * p.delay_s, RETRY_MAX_S)
            p.retry_at = time.monotonic() + p.delay_s
            return
        del self._pending[run_id]
        self._replayed[run_id] = r.total
        _say(f"{self.what} answers again: replayed {r.writes} spooled write(s) of run {run_id}")
