"""The tracking spool: the writes a tracking server could not take, kept in order on local disk and replayed later.
A local sqlite store on a full disk spools the same way (``Tracker``): its writes wait in the spool until the store
takes them again (later in the run, or through ``lowprec sync``).

With ``tracking.uri=http://...`` each write of a run (metrics, params, tags, artifacts, the final status) is tried
once and fails fast (``fail_fast``: no retry, a ``WRITE_TIMEOUT_S`` timeout, instead of MLflow's minutes of
backoff). A write the server cannot take (unreachable, timed out, HTTP 5xx) is appended to
``<paths.runs>/spool/<run id>.jsonl``, and every later write of that run follows it there, so the order is kept. The
run's next write after a pause (``RETRY_FIRST_S``, doubling up to ``RETRY_MAX_S``) first replays the spool, and the
run's end always tries; what is still spooled when the process ends is replayed by ``lowprec sync``
(``lowprec_lab/tracking/sync.py``). A 4xx answer (a bad request) is not a server failure: it raises, as without a spool.

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
    # Per run: the run's process appends while a `lowprec sync` elsewhere may be replaying the same file. One lock
    # object per file in a process (is_singleton), so that it is reentrant: a replay holds it while it reads the
    # header, which may move an unwritten file aside under the same lock.
    return FileLock(str(path.with_suffix(".lock")), is_singleton=True)


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


#: The longest header line read (bytes); a real header is about 110.
_MAX_HEADER_BYTES = 64 * 1024
#: The suffix a spool file without one complete line is renamed to (``_quarantine_unwritten``): out of the
#: ``*.jsonl`` that ``lowprec sync`` and the orphan sweep read, kept for whoever wants to look.
UNWRITTEN_SUFFIX = ".unwritten"


class EmptySpool(SpoolError):
    """A spool file without one complete line (0 bytes, or a header cut short): it held nothing to replay and was
    moved aside (``UNWRITTEN_SUFFIX``), so that it is reported once, not refused by every later command."""


def _quarantine_unwritten(path: Path) -> bool:
    """Rename ``path`` to ``<name>.unwritten`` when it holds no newline at all (0 bytes, or a header whose write
    was cut short by a crash): no record can be in it. True when it was moved; False for a file that has a line
    (or is gone). Under the spool's lock, so an append in progress is not taken for a dead one."""
    with _lock(path):
        try:
            with open(path, "rb") as f:
                head = f.read(_MAX_HEADER_BYTES)
        except OSError:
            return False
        if b"\n" in head or len(head) >= _MAX_HEADER_BYTES:
            return False
        os.replace(path, path.with_name(path.name + UNWRITTEN_SUFFIX))
        return True


def read_header(path: Path) -> dict:
    """The header of the spool file ``path``; raises ``SpoolError`` (one line) when it is not one: not JSON, another
    format version, a run id that is not an MLflow run id or not the file's name, a URI that is not a string.
    A file without one complete line is moved aside first and raises ``EmptySpool`` (once: it is no longer
    there for the next command)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(_MAX_HEADER_BYTES)
    except OSError:
        first = b""
    if not first.endswith(b"\n") and _quarantine_unwritten(path):
        raise EmptySpool(
            f"{path} holds no complete line (its writer stopped before its header was written): nothing to replay; "
            f"moved aside to {path.name}{UNWRITTEN_SUFFIX}"
        )
    try:
        header = json.loads(first)
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
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
#: The keys each record holds (what ``Tracker`` writes): any other key, a ``run_id`` among them, is refused.
_KEYS = {
    "batch": {"op", "metrics", "params", "tags"},
    "text": {"op", "name", "text"},
    "dict": {"op", "name", "obj"},
    "file": {"op", "path", "folder"},
    "input": {"op", "dataset", "context"},
    "end": {"op", "status", "end_time"},
}
#: The statuses an ``end`` record may set: the terminal ones. A spool never reopens a run (``RUNNING``).
END_STATUSES = ("FINISHED", "FAILED", "KILLED")
#: Tags that say which runs belong together (set when a run is created, never through a spool): a spool that set
#: them would move its run under another ablation's parent and into that ablation's report.
MEMBERSHIP_TAGS = ("mlflow.parentRunId", "lowprec.ablation_id", "lowprec.kind", "ablation_group")
#: The longest spool line read (bytes): a record is one ``log_batch`` of at most 1000 metrics, or one text or dict
#: artifact; a longer line is refused before it is parsed, so a sent file cannot make ``sync`` read gigabytes.
MAX_LINE_BYTES = 16 * 2**20
#: The deepest nesting of lists and objects a record may hold (a ``dict`` record's object): Python's JSON parser
#: recurses per level and MLflow serializes the object again.
MAX_DEPTH = 64
#: MLflow stores steps and timestamps as SQL BIGINT (int64): a larger one fails inside the store, which would
#: read as a store failure, not as the spool's fault.
_INT64 = (-(2**63), 2**63 - 1)


def _is_int64(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1]


def _is_number(v: object) -> bool:
    """A metric value MLflow can store as a double: a float (NaN and infinities included, as MLflow keeps them) or
    an int within a double's range."""
    if isinstance(v, float):
        return True
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _depth(obj: object) -> int:
    """How deeply lists and objects nest in ``obj`` (0 for a scalar), without recursion."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, dict)):
            deepest = max(deepest, d)
            todo.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def _pairs_ok(items: object) -> bool:
    return isinstance(items, list) and all(
        isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in items
    )


def _record_problem(path: Path, rec: dict) -> str | None:
    """What is wrong with a parsed record (its op known), or None; the file record's folder check raises
    ``SpoolError`` itself."""
    op = rec["op"]
    extra = rec.keys() - _KEYS[op]
    if extra:
        return f"a {op!r} record holds the key(s) {sorted(extra)!r}, which no lowprec spool writes"
    if op == "file":
        spooled_file(path, rec.get("path"))
        return None if rec.get("folder") is None or isinstance(rec.get("folder"), str) else "bad folder"
    if op == "batch":
        metrics = rec.get("metrics")
        if not isinstance(metrics, list) or not _pairs_ok(rec.get("params")) or not _pairs_ok(rec.get("tags")):
            return "a 'batch' record's metrics, params or tags are not lists of the right shape"
        for m in metrics:
            if not (isinstance(m, list) and len(m) == 4 and isinstance(m[0], str) and _is_number(m[1])):
                return f"a metric {str(m)[:80]} is not [key, value, timestamp, step]"
            if not (_is_int64(m[2]) and _is_int64(m[3])):
                return f"metric {m[0][:80]!r} has a timestamp or step outside a 64-bit integer"
        moved = sorted({k for k, _ in rec["tags"]} & set(MEMBERSHIP_TAGS))
        if moved:
            return f"a 'batch' record sets {moved!r}, which would attach the run to another run or ablation"
        return None
    if op == "text":
        ok = isinstance(rec.get("text"), str) and isinstance(rec.get("name"), str)
    elif op == "dict":
        ok = isinstance(rec.get("obj"), dict) and isinstance(rec.get("name"), str)
        if ok and _depth(rec["obj"]) > MAX_DEPTH:
            return f"a 'dict' record nests deeper than {MAX_DEPTH} levels"
    elif op == "input":
        ds = rec.get("dataset")
        ok = isinstance(ds, dict) and {"name", "digest"} <= ds.keys() <= _DATASET_FIELDS
        ok = ok and all(isinstance(v, str) for v in ds.values())
        ok = ok and isinstance(rec.get("context", ""), str)
    else:
        if rec.get("status") not in END_STATUSES:
            return f"an 'end' record's status {str(rec.get('status'))[:40]!r} is not one of {', '.join(END_STATUSES)}"
        ok = _is_int64(rec.get("end_time")) and rec["end_time"] >= 0
    if op in ("text", "dict") and ok:
        name = Path(rec["name"])
        ok = not name.is_absolute() and ".." not in name.parts
    return None if ok else f"a {op!r} record is malformed"


def _check_record(path: Path, rec: dict, line: int | None = None) -> None:
    """Raise ``SpoolError`` (one line naming the file and ``line``) for a record whose fields would not replay or
    would change what no run's own spool may: checked for the whole file before any write, so a malformed spool is
    reported as such, never as a failure of the store."""
    where = f"{path}: line {line}" if line is not None else str(path)
    problem = _record_problem(path, rec)
    if problem:
        raise SpoolError(f"{where}: {problem}; nothing was replayed")


def _parse(line: bytes) -> tuple[dict | None, str]:
    """A spool line as a record, or None and why not. A line nested deeper than the parser recurses, or holding
    an integer past Python's digit limit, is a malformed line like any other (``RecursionError``/``ValueError``
    are caught here, not reported as a failure of the store)."""
    try:
        rec = json.loads(line)
    except RecursionError:
        return None, "nested too deeply to parse"
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError as e:  # JSONDecodeError, and an integer of more than sys.get_int_max_str_digits() digits
        return None, "not JSON" if isinstance(e, json.JSONDecodeError) else "an integer with too many digits"
    if not isinstance(rec, dict) or rec.get("op") not in OPS:
        return None, "not an object with a known op"
    return rec, ""


def _lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """The lines of ``path`` after its header: (line number, bytes without the newline, whether it ended with
    one). Raises ``SpoolError`` for a line longer than ``MAX_LINE_BYTES``, before reading the rest of it."""
    with open(path, "rb") as f:
        f.readline(MAX_LINE_BYTES + 1)
        n = 1
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            n += 1
            if len(line) > MAX_LINE_BYTES:
                raise SpoolError(f"{path}: line {n} is longer than {MAX_LINE_BYTES} bytes; nothing was replayed")
            ended = line.endswith(b"\n")
            yield n, line[:-1] if ended else line, ended


def read_spool(path: Path) -> Spool:
    """Read and check every record of ``path``. A last line without its newline that does not parse (its writer
    was killed mid-write) is left out with ``Spool.warning``; any other line that is not a valid record raises
    ``SpoolError`` naming the file and the line: the records after it could not be replayed in order."""
    header = read_header(path)
    records, warning = [], None
    for n, line, ended in _lines(path):
        rec, why = _parse(line)
        if rec is not None:
            _check_record(path, rec, n)
            records.append(rec)
        elif not ended:
            warning = (
                f"{path}: skipped its last line ({len(line)} bytes, not a complete record: the process writing it "
                "was stopped mid-write)"
            )
        else:
            raise SpoolError(f"{path}: line {n} is not a spool record ({why}); the records after it cannot be replayed")
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


def _whole_lines(path: Path) -> int | None:
    """Cut ``path`` back to its last complete line (a process killed in the middle of an append left a part of
    one, which a record appended after it would join into one unreadable line in the middle of the file); returns
    its size, or None when it does not exist or held no complete line (then it is removed: the header is written
    again)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        path.unlink()
        return None
    with open(path, "rb") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return size
        back = min(size, MAX_LINE_BYTES + 1)
        f.seek(size - back)
        tail = f.read(back)
    cut = tail.rfind(b"\n")
    if cut < 0 and back == size:
        path.unlink()
        return None
    size = size - back + cut + 1 if cut >= 0 else size  # a line longer than any record: left for the replay to refuse
    os.truncate(path, size)
    return size


def append(path: Path, run_id: str, uri: str, rec: dict, earlier_writes: int = 0) -> None:
    """Append ``rec`` to the spool of ``run_id`` at ``path`` (created with its header if missing). A ``file``
    record's file is copied beside the spool now, since the original may change before the replay.

    All or nothing: when a write fails (the spool's disk is full too: ``OSError``, raised), the file is cut back to
    what it held (a spool it created is removed, with the copy of a ``file`` record), so no header without a record
    and no half line is left for the next command's sweep to refuse."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        size = _whole_lines(path)
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


# --- a run's last word ---------------------------------------------------------------------------------------------

#: The bytes reserved for a run's stop note (``reserve_note``): a failure kind and a one-line reason.
NOTE_BYTES = 1024
#: The failure kinds a stop note may name; the orphan sweep ignores any other content.
NOTE_KINDS = ("disk",)


def note_path(folder: Path, run_id: str) -> Path:
    """Where a run's stop note is kept: ``<folder>/<run id>.stop``, beside its spool."""
    return Path(folder) / f"{run_id}.stop"


def reserve_note(folder: Path, run_id: str) -> None:
    """Write ``NOTE_BYTES`` blank bytes to the run's stop note now, while the disk has room, so that
    ``write_note`` overwrites blocks the file already has when the disk (store and spool alike) is full. Best
    effort: an ``OSError`` leaves the run without a note (the sweep then records it as a process that died)."""
    path = note_path(folder, run_id)
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b" " * NOTE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_note(folder: Path, run_id: str, kind: str, reason: str) -> bool:
    """Say in the run's stop note why its process is about to stop (``kind`` one of ``NOTE_KINDS``, ``reason`` one
    line, cut to fit), overwriting the reserved bytes in place; True when written. Used when nothing else can be
    written: the store and the spool refuse for the same full disk."""
    path = note_path(folder, run_id)
    reason = " ".join(reason.split())
    while True:
        data = json.dumps({"failure_kind": kind, "reason": reason}).encode()
        if len(data) <= NOTE_BYTES or not reason:
            break
        reason = reason[: len(reason) - (len(data) - NOTE_BYTES) - 3] + "..."
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data.ljust(NOTE_BYTES), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def read_note(folder: Path, run_id: str) -> dict[str, str] | None:
    """The run's stop note as ``{"failure_kind": ..., "reason": ...}``, or None when there is none, it is blank
    (reserved, never written: the process was killed) or it is not one (read as data: at most ``NOTE_BYTES``, a
    kind from ``NOTE_KINDS``, a reason cut to 500 characters of one line)."""
    try:
        with open(note_path(folder, run_id), "rb") as f:
            raw = f.read(NOTE_BYTES + 1)
        note = json.loads(raw) if raw.strip() and len(raw) <= NOTE_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(note, dict) or note.get("failure_kind") not in NOTE_KINDS:
        return None
    reason = note.get("reason")
    if not isinstance(reason, str):
        return None
    return {"failure_kind": note["failure_kind"], "reason": " ".join(reason.split())[:500]}


def drop_note(folder: Path, run_id: str) -> None:
    """Remove the run's stop note (the run ended, or was closed with it)."""
    try:
        note_path(folder, run_id).unlink(missing_ok=True)
    except OSError:
        pass


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
        try:
            spool = read_spool(path)
        except EmptySpool as e:  # moved aside: said once, and the next command no longer meets it
            warn(str(e))
            return Replayed(run_id=path.stem, warnings=[str(e)])
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
                    now = client.get_run(spool.run_id).info.status
                    if now == "FINISHED" and rec["status"] != "FINISHED":
                        kept = (
                            f"{path}: its end record ({rec['status']}) was not applied: run {spool.run_id} is "
                            "already FINISHED, and a spool never moves a run's status back"
                        )
                        out.warnings.append(kept)
                        warn(kept)
                        _write_cursor(path, start + i + 1)
                        out.end = now
                        continue
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
