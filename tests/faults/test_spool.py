"""The tracking spool's format and replay, against a real MLflow sqlite store (the same SQL store
an ``mlflow server`` runs on): records replay in order with their original timestamps and the end last; an
interrupted replay resumes from its cursor and a record sent twice is not duplicated; a truncated last line is
skipped with a warning, a corrupt line in the middle stops the replay by name; writes to a server that refuses
connections fail fast into the spool. The real-server cases are in tests/faults/test_tracking_server_down.py."""

from __future__ import annotations

import json
import socket
import time

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main
from lowprec_lab.tracking.spool import (
    SPOOLED_TAG,
    ReplayInterrupted,
    Spooler,
    SpoolError,
    append,
    batch_record,
    end_record,
    read_spool,
    replay,
    spool_path,
)
from lowprec_lab.tracking.tracker import Tracker


@pytest.fixture
def store(tmp_path):
    """A real sqlite store with one RUNNING run; returns (client, run id, spool folder)."""
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lowprec", tmp_path)
    return t.client, t.start_run("r", {}), tmp_path / "spool"


def _spool_a_run(path, run_id, tmp_path):
    """Every kind of record, in the order a run writes them; returns the metrics logged."""
    art = tmp_path / "report.md"
    art.write_text("# report\n")
    metrics = [Metric("loss", 10.0 - s, 1_700_000_000_000 + s, s) for s in range(30)]
    recs = [
        batch_record(params=[Param("seed", "0")], tags=[RunTag("order", "first")]),
        {"op": "text", "name": "config.yaml", "text": "seed: 0\n"},
        batch_record(metrics=metrics[:10]),
        {"op": "dict", "name": "effective_recipe.json", "obj": {"fp8": "rowwise"}},
        batch_record(metrics=metrics[10:], tags=[RunTag("order", "second")]),
        {"op": "file", "path": str(art), "folder": "plots"},
        {**end_record("FINISHED"), "end_time": 1_700_000_009_000},
    ]
    for r in recs:
        append(path, run_id, "http://example:5000", r)
    art.write_text("changed after it was spooled\n")  # the spool holds the file as it was when logged
    return metrics


def _history(client, run_id, key="loss"):
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def test_replay_sends_every_record_in_order_with_its_timestamps_and_the_end_last(store, tmp_path):
    client, run_id, folder = store
    path = spool_path(folder, run_id)
    metrics = _spool_a_run(path, run_id, tmp_path)
    assert [r["op"] for r in read_spool(path).records] == ["batch", "text", "batch", "dict", "batch", "file", "end"]
    r = replay(client, path)
    assert (r.writes, r.metrics, r.end, r.total) == (7, 30, "FINISHED", 7)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time == 1_700_000_009_000
    assert _history(client, run_id) == [(m.step, m.value, m.timestamp) for m in metrics]
    assert run.data.tags["order"] == "second" and run.data.params["seed"] == "0"
    assert run.data.tags[SPOOLED_TAG] == "7"
    root = run.info.artifact_uri.removeprefix("file://")
    assert open(f"{root}/plots/report.md").read() == "# report\n"
    assert json.load(open(f"{root}/effective_recipe.json")) == {"fp8": "rowwise"}
    assert open(f"{root}/config.yaml").read() == "seed: 0\n"
    assert list(folder.iterdir()) == []  # replayed in full: the file, its cursor, its copies and lock are gone


class FailingAfter:
    """A real client whose ``n``-th call onwards fails as a dead server does (MLflow's connection error)."""

    def __init__(self, client, n):
        self.client, self.n = client, n

    def __getattr__(self, name):
        def call(*a, **k):
            self.n -= 1
            if self.n < 0:
                raise MlflowException("API request to http://x failed with exception [Errno 111] Connection refused")
            return getattr(self.client, name)(*a, **k)

        return call


def test_an_interrupted_replay_resumes_at_its_cursor_and_a_record_sent_twice_is_not_duplicated(store, tmp_path):
    client, run_id, folder = store
    path = spool_path(folder, run_id)
    metrics = _spool_a_run(path, run_id, tmp_path)
    with pytest.raises(ReplayInterrupted) as e:
        replay(FailingAfter(client, 3), path)
    assert (e.value.done, e.value.of) == (3, 7) and "Connection refused" in str(e.value)
    assert path.with_suffix(".cursor").read_text() == "3" and client.get_run(run_id).info.status == "RUNNING"
    assert len(_history(client, run_id)) == 10
    # a crash between a record and its cursor: the whole spool is sent again from the start
    path.with_suffix(".cursor").unlink()
    r = replay(client, path)
    assert r.writes == 7 and client.get_run(run_id).info.status == "FINISHED"
    assert _history(client, run_id) == [(m.step, m.value, m.timestamp) for m in metrics]  # none twice, none lost


def test_a_truncated_last_line_is_skipped_with_a_warning_a_corrupt_middle_line_stops_by_name(store, tmp_path):
    client, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, "http://example:5000", batch_record(metrics=[Metric("loss", 1.0, 5, 0)]))
    append(path, run_id, "http://example:5000", batch_record(metrics=[Metric("loss", 2.0, 6, 1)]))
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"op": "batch", "metrics": [["loss", 3.0, 7')  # killed in the middle of a write
    warnings = []
    r = replay(client, path, warn=warnings.append)
    assert r.writes == 2 and _history(client, run_id) == [(0, 1.0, 5), (1, 2.0, 6)]
    assert len(warnings) == 1 and "skipped its last line" in warnings[0]
    path.write_bytes(whole.replace(b'"loss", 1.0', b'"loss", 1.0 oops', 1))
    with pytest.raises(SpoolError, match=r"line 2 is not a spool record"):
        replay(client, path)


class Outage:
    """A real client behind a server that can be down: while ``down``, every call fails as MLflow's does when the
    server refuses the connection; ``calls`` counts the calls that reached the store."""

    def __init__(self, client):
        self.client, self.down, self.calls = client, False, 0

    def __getattr__(self, name):
        def call(*a, **k):
            if self.down:
                raise MlflowException("API request to http://x failed with exception [Errno 111] Connection refused")
            self.calls += 1
            return getattr(self.client, name)(*a, **k)

        return call


def test_a_spooling_run_replays_its_spool_before_its_next_write_once_the_server_answers(store, capsys):
    client, run_id, folder = store
    server = Outage(client)
    spooler = Spooler(folder, "http://example:5000")
    server.down = True
    spooler.send(server, run_id, batch_record(tags=[RunTag("x", "1")], metrics=[Metric("loss", 1.0, 10, 0)]))
    server.down = False
    spooler.send(server, run_id, batch_record(tags=[RunTag("x", "2")], metrics=[Metric("loss", 2.0, 11, 1)]))
    assert server.calls == 0  # within the pause after a failure: spooled without asking the server
    spooler._pending[run_id].retry_at = 0  # the pause is over
    spooler.send(server, run_id, batch_record(tags=[RunTag("x", "3")], metrics=[Metric("loss", 3.0, 12, 2)]))
    assert spooler.pending() == {} and not spool_path(folder, run_id).exists()
    run = client.get_run(run_id)
    assert run.data.tags["x"] == "3" and run.data.tags[SPOOLED_TAG] == "2"  # the spool went first, in order
    assert _history(client, run_id) == [(0, 1.0, 10), (1, 2.0, 11), (2, 3.0, 12)]
    err = capsys.readouterr().err
    assert "failed ([Errno 111] Connection refused)" in err and "answers again: replayed 2 spooled write(s)" in err
    # a later outage starts a new spool; the end always tries the server and replays it first
    server.down = True
    spooler.send(server, run_id, batch_record(tags=[RunTag("x", "4")]))
    server.down = False
    spooler.send(server, run_id, end_record("FINISHED"), final=True)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["x"] == "4" and run.data.tags[SPOOLED_TAG] == "3"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_writes_to_a_server_that_refuses_connections_fail_fast_into_the_spool_in_order(tmp_path, capsys):
    uri = f"http://127.0.0.1:{_closed_port()}"
    spooler = Spooler(tmp_path / "spool", uri)
    client = MlflowClient(uri)
    t0 = time.monotonic()
    for s in range(5):
        spooler.send(client, "run1", batch_record(metrics=[Metric("loss", float(s), 1000 + s, s)]))
    spooler.send(client, "run1", end_record("FINISHED"), final=True)
    assert time.monotonic() - t0 < 5  # MLflow's default retries would take minutes
    spool = read_spool(spool_path(tmp_path / "spool", "run1"))
    assert spool.uri == uri and [r["metrics"][0][3] for r in spool.records[:-1]] == [0, 1, 2, 3, 4]
    assert spool.records[-1]["status"] == "FINISHED"
    err = capsys.readouterr().err
    assert err.count("Connection refused") == 1 and "its writes are spooled in" in err
    assert f"ended FINISHED here, but the tracking server {uri} does not answer" in err
    assert f"lowprec sync {spool.path}" in err


def test_sync_of_a_missing_path_or_a_file_that_is_not_a_spool_is_one_line(tmp_path, capsys):
    assert main(["sync", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"lowprec sync: error: no spool file or folder at '{tmp_path / 'nope'}'"
    other = tmp_path / "metrics.jsonl"
    other.write_text('{"loss": 1}\n')
    assert main(["sync", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lowprec sync: error: {other} is not a lowprec spool file (its first line is not a spool header)"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["sync", str(empty), "tracking.urx=3"]) == 2
    assert capsys.readouterr().err.strip().startswith("lowprec sync: error: unknown key tracking.urx")
    assert main(["sync", str(empty)]) == 0 and "nothing spooled" in capsys.readouterr().out


# ---- a spool someone sent is data ----------------------------------------------------


def _foreign_spool(store, tmp_path, path_in_record: str, uri: str | None = None):
    client, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, uri or client.tracking_uri, batch_record(tags=[RunTag("k", "v")]))
    with open(path, "a") as f:
        f.write(json.dumps({"op": "file", "path": path_in_record, "folder": None}) + "\n")
    return client, run_id, path


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_sync_uploads_no_file_outside_the_spools_own_folder(store, tmp_path, capsys, kind):
    secret = tmp_path / "home" / ".secret_dotfile"
    secret.parent.mkdir()
    secret.write_text("token=hunter2\n")
    client, run_id, path = store[0], store[1], spool_path(store[2], store[1])
    if kind == "absolute":
        named = "/etc/passwd"
    elif kind == "dotdot":  # relative to the spool folder, climbing out of it
        named = f"{run_id}.files/../../../../../../../../../{secret.relative_to('/')}"
    else:  # a link inside the spool's own folder that points outside it
        link = path.with_suffix(".files") / "abc" / "notes.txt"
        link.parent.mkdir(parents=True)
        link.symlink_to(secret)
        named = str(link.relative_to(path.parent))
    client, run_id, path = _foreign_spool(store, tmp_path, named)
    assert main(["sync", str(path), f"tracking.uri={client.tracking_uri}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lowprec sync: error: {path}: a file record names") and "refused" in err and "\n" not in err
    assert path.exists()  # not deleted, nothing replayed
    assert client.list_artifacts(run_id) == [] and "k" not in client.get_run(run_id).data.tags


def test_sync_refuses_a_spool_written_for_another_store_unless_that_store_is_named(store, tmp_path, capsys):
    client, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, "http://attacker.invalid:5000", batch_record(tags=[RunTag("k", "v")]))
    # the configured store is the default one, not the spool's: refused
    assert main(["sync", str(path), f"paths.runs={tmp_path / 'mine'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "was written for the store http://attacker.invalid:5000, not the configured" in err and "\n" not in err
    # the user names the store to replay into: it goes there, whatever the header says
    assert main(["sync", str(path), f"tracking.uri={client.tracking_uri}"]) == 0
    assert client.get_run(run_id).data.tags["k"] == "v" and not path.exists()


@pytest.mark.parametrize(
    "header, said",
    [
        ({"lowprec_spool": 1, "uri": "sqlite:///x.db"}, "run id None is not this file's run id"),
        ({"lowprec_spool": 1, "run_id": "r", "uri": 5}, "tracking URI 5 is not a URI"),
        ({"lowprec_spool": 1, "run_id": "../../x", "uri": "sqlite:///x.db"}, "is not this file's run id"),
    ],
)
def test_a_malformed_spool_header_is_one_line(tmp_path, capsys, header, said):
    path = tmp_path / f"{header.get('run_id', 'r')}.jsonl".replace("/", "_")
    path.write_text(json.dumps(header) + "\n")
    assert main(["sync", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowprec sync: error: ") and said in err and "\n" not in err


def test_a_bad_cursor_is_one_line_and_replays_nothing(store, tmp_path, capsys):
    client, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, client.tracking_uri, batch_record(tags=[RunTag("k", "v")]))
    path.with_suffix(".cursor").write_text("banana")
    assert main(["sync", str(path), f"tracking.uri={client.tracking_uri}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds 'banana', not a count of the 1 record(s)" in err and "tracking server" not in err
    assert "k" not in client.get_run(run_id).data.tags


def _nearly_full_disk(monkeypatch, room: int) -> None:
    """The spool's disk takes ``room`` more bytes, then refuses with ENOSPC: a write that meets the end of the space
    is taken in part and returns its count (as the kernel's write does), the next one raises."""
    import errno
    import os

    import lowprec_lab.tracking.spool as spool_module

    real, left = os.write, [room]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data)[: left[0]])
        left[0] -= n
        return n

    monkeypatch.setattr(spool_module.os, "write", write)


@pytest.mark.parametrize("room", [0, 20, 50])  # a record line is ~70 bytes, a header ~110
def test_an_append_on_a_full_disk_leaves_the_spool_as_it_was(store, tmp_path, monkeypatch, room):
    # the fault campaign found it: the store's and the spool's disks full at a metric flush left a spool file without
    # its header (or with half a line), and every later command's orphan sweep refused it ("not a lowprec spool file")
    client, run_id, folder = store
    new, old = spool_path(folder, "a" * 32), spool_path(folder, run_id)
    append(old, run_id, "sqlite:///x.db", batch_record([Metric("loss", 1.0, 1, 0)]))
    before = old.read_bytes()
    rec = batch_record([Metric("loss", 2.0, 2, 1)])
    _nearly_full_disk(monkeypatch, room)
    with pytest.raises(OSError, match="No space left"):
        append(old, run_id, "sqlite:///x.db", rec)  # takes ``room`` bytes of the record, then the disk is full
    _nearly_full_disk(monkeypatch, room)
    with pytest.raises(OSError, match="No space left"):
        append(new, "a" * 32, "sqlite:///x.db", rec)
    monkeypatch.undo()
    assert old.read_bytes() == before  # no half line after the last whole record
    assert [r["metrics"][0][1] for r in read_spool(old).records] == [1.0]
    assert not new.exists()  # nothing of a spool that could not be written whole
