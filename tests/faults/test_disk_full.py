"""A disk that fills during a checkpoint save, on real ``lowprec train`` runs of the ``debug``
model with a real MLflow sqlite store: ``ENOSPC`` is injected at the file-system layer (the write of DCP's
``FileSystemWriter``, or ``torch.save`` of the trainer state). The run ends FAILED (``failure_kind`` ``disk``) with
one line naming the error and the disk, every step before the save is in the store, the ``.partial`` folder is
gone and the checkpoint before is intact."""

from __future__ import annotations

import errno
import socket
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from mlflow.tracking import MlflowClient
from sqlalchemy import event
from sqlalchemy.engine import Engine

import lowprec_lab.tracking.spool as spool_module
from lowprec.storage import disk_errno, disk_error
from lowprec.train.checkpoint_files import verify
from lowprec_lab.cli import main
from lowprec_lab.runner.orphans import OWNER_TAG, close_orphans
from lowprec_lab.tracking.spool import SPOOLED_TAG
from lowprec_lab.tracking.tracker import Tracker

RUN = ["train", "model=debug", "train.batch_size=2", "train.seq_len=32", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=1", "train.timing_warmup_steps=1", "train.steps=6", "train.checkpoint_every=2"]


def _enospc(path="") -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _fail_dcp_write(monkeypatch):
    """The second checkpoint's shard write (DCP's FileSystemWriter) finds the disk full."""
    real = dcp_fs._write_item
    calls = {"n": 0}

    def write_item(transforms, stream, *a, **k):
        if "step_4.partial" in str(getattr(stream, "name", "")):
            calls["n"] += 1
            raise _enospc(stream.name)
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    return calls


def _fail_trainer_state(monkeypatch):
    """The second checkpoint's ``trainer_state.pt`` finds the disk full (the file's write, as the kernel says it)."""
    real = Path.write_bytes
    calls = {"n": 0}

    def write_bytes(self, data):
        if "step_4.partial" in str(self) and self.name == "trainer_state.pt":
            calls["n"] += 1
            raise _enospc(self)
        return real(self, data)

    real_save = torch.save

    def save(obj, f, *a, **k):  # lowprec once handed torch.save the path itself
        if "step_4.partial" in str(f) and str(f).endswith("trainer_state.pt"):
            calls["n"] += 1
            raise _enospc(f)
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    monkeypatch.setattr(torch, "save", save)
    return calls


@pytest.mark.parametrize("inject", [_fail_dcp_write, _fail_trainer_state], ids=["dcp_shards", "trainer_state"])
def test_a_full_disk_during_a_save_fails_the_run_in_one_line_and_loses_nothing(
    inject, run_dirs, tmp_path, capsys, monkeypatch
):
    calls = inject(monkeypatch)
    main([*RUN, *run_dirs])  # returns, never raises: the run is recorded
    assert calls["n"] >= 1  # the fault was hit
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    failed = [ln for ln in out.out.splitlines() if ln.startswith("FAILED run")]
    assert len(failed) == 1 and "No space left on device (ENOSPC)" in failed[0] and "step_4" in failed[0]
    assert "step_2', is intact" in failed[0]  # where to resume once space is back

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (run,) = client.search_runs([exp])
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_kind"] == "disk"  # an ablation's resume continues it once space is back
    assert "ENOSPC" in run.data.tags["failure_reason"] and "disk '" in run.data.tags["failure_reason"]
    # the metrics buffered since the last flush (steps 2 and 3, before the failed save after step 3) are stored
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]

    ckpts = tmp_path / "runs" / "checkpoints" / run.info.run_id
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2"]  # no .step_4.partial left behind
    assert verify(ckpts / "step_2")  # the checkpoint before is intact (its sha256 manifest holds)


# --- the sqlite store's disk --------------------------------------------------------------------

STORE_RUN = ["train", "model=debug", "train.batch_size=2", "train.seq_len=32", "train.val_every=0"]
STORE_RUN += ["train.val_batches=1", "train.warmup_steps=1", "train.timing_warmup_steps=1", "train.steps=4"]


@contextmanager
def full_store(
    until_refused: int | None = None, message: str = "database or disk is full", first: str = "INSERT INTO METRICS"
):
    """The sqlite store's disk fills when the first metrics are written (the first statement that starts with
    ``first``): every INSERT/UPDATE/DELETE (and CREATE) then fails in sqlite3 itself with ``message`` (default
    SQLITE_FULL's; SQLITE_READONLY's for a file system remounted read-only), under MLflow's own error handling; after
    ``until_refused`` refused statements (None: never) space returns. Yields the count of refused statements."""
    state = {"on": False, "refused": 0}

    def before(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith(first):
            state["on"] = state["on"] or state["refused"] == 0
        if state["on"] and statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE", "CREATE")):
            state["refused"] += 1
            if until_refused is not None and state["refused"] >= until_refused:
                state["on"] = False
            raise sqlite3.OperationalError(message)

    event.listen(Engine, "before_cursor_execute", before)
    try:
        yield state
    finally:
        event.remove(Engine, "before_cursor_execute", before)


def _only_run(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    return client, run


def test_a_full_store_spools_the_run_in_one_line_and_lowprec_sync_replays_it(run_dirs, tmp_path, capsys):
    with full_store() as state:
        assert main([*STORE_RUN, *run_dirs]) == 0  # the run trained to the end; its results wait in the spool
    assert state["refused"] >= 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    said = [ln for ln in out.err.splitlines() if "database or disk is full" in ln or "does not take writes" in ln]
    assert len(said) == 2, out.err  # the first refused write, and the end: where the results are and how to replay
    client, run = _only_run(tmp_path)
    assert run.info.status == "RUNNING" and not client.get_metric_history(run.info.run_id, "loss")
    spool = tmp_path / "runs" / "spool" / f"{run.info.run_id}.jsonl"
    assert spool.exists() and f"lowprec sync {spool}" in said[-1]

    assert main(["sync", str(spool), *run_dirs[2:3]]) == 0  # space is back
    client, run = _only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]
    assert "final_val_loss" in run.data.metrics and int(run.data.tags[SPOOLED_TAG]) >= 1
    assert not spool.exists()


def test_a_store_whose_space_returns_is_written_and_closed_by_the_run_itself(run_dirs, tmp_path, capsys):
    with full_store(until_refused=1) as state:
        assert main([*STORE_RUN, *run_dirs]) == 0
    assert state["refused"] == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "answers again: replayed" in out.err
    client, run = _only_run(tmp_path)
    assert run.info.status == "FINISHED"  # closed when the store answered, with nothing left in a spool
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]
    assert not list((tmp_path / "runs" / "spool").glob("*.jsonl"))


def test_the_next_commands_orphan_sweep_replays_a_dead_runs_spool_instead_of_failing_it(run_dirs, tmp_path):
    with full_store():
        assert main([*STORE_RUN, *run_dirs]) == 0
    client, run = _only_run(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs: the run's owner as a later command on this host sees it
    client.set_tag(run.info.run_id, OWNER_TAG, f"{socket.gethostname()}:{dead.pid}:0")

    tracker = Tracker(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}", "lowprec", tmp_path / "runs")
    assert close_orphans(tracker) == []  # its spool ended it: nothing to close
    client, run = _only_run(tmp_path)
    assert run.info.status == "FINISHED" and "orphan_closed" not in run.data.tags
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]
    assert not list((tmp_path / "runs" / "spool").glob("*.jsonl"))


def test_a_full_store_whose_spool_is_full_too_is_one_line_and_the_next_command_closes_the_run(
    run_dirs, tmp_path, capsys, monkeypatch
):
    def no_space(path, line):
        raise _enospc(path)

    monkeypatch.setattr(spool_module, "_append_line", no_space)  # the spool folder is on the same full disk
    with full_store():
        assert main([*STORE_RUN, *run_dirs]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    (line,) = [ln for ln in out.err.splitlines() if "(ENOSPC)" in ln]
    assert "and to its spool" in line and "disk '" in line
    monkeypatch.undo()

    client, run = _only_run(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client.set_tag(run.info.run_id, OWNER_TAG, f"{socket.gethostname()}:{dead.pid}:0")
    note = tmp_path / "runs" / "spool" / f"{run.info.run_id}.stop"
    assert b"ENOSPC" in note.read_bytes()  # written over the bytes reserved at the run's first write
    tracker = Tracker(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}", "lowprec", tmp_path / "runs")
    assert close_orphans(tracker) == [run.info.run_id]  # space is back: no run is left RUNNING
    closed = client.get_run(run.info.run_id)
    assert closed.info.status == "FAILED"
    # the disk stopped it, not a crash: recorded as such (an ablation's resume continues it), and the reason says so
    assert closed.data.tags["failure_kind"] == "disk"
    reason = closed.data.tags["failure_reason"]
    assert "No space left on device (ENOSPC)" in reason and "and to its spool" in reason and "died" not in reason
    assert not note.exists()


def test_a_store_whose_file_system_turns_read_only_spools_the_run_in_one_line(run_dirs, tmp_path, capsys):
    # the fault campaign found it: a store remounted read-only mid-run (sqlite: "attempt to write a readonly
    # database", no errno) gave MLflow's traceback, and the run was left RUNNING with its metrics lost
    with full_store(message="attempt to write a readonly database") as state:
        assert main([*STORE_RUN, *run_dirs]) == 0
    assert state["refused"] >= 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    said = [ln for ln in out.err.splitlines() if "readonly database" in ln or "does not take writes" in ln]
    assert len(said) == 2 and "(disk full or read-only)" in said[-1], out.err
    client, run = _only_run(tmp_path)
    spool = tmp_path / "runs" / "spool" / f"{run.info.run_id}.jsonl"
    assert main(["sync", str(spool), *run_dirs[2:3]]) == 0  # the file system is writable again
    client, run = _only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]


def test_a_full_disk_when_the_store_is_created_is_one_line(run_dirs, tmp_path, capsys, mlflow_makes_new_stores):
    # a full disk in Tracker.__init__ (MLflow creating a new store's tables) was a traceback
    with full_store(first="CREATE TABLE") as state:
        assert main([*STORE_RUN, *run_dirs]) == 2
    assert state["refused"] >= 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    (line,) = [ln for ln in out.err.splitlines() if "(ENOSPC)" in ln]
    assert "opening the tracking store sqlite:///" in line and "disk '" in line
    assert main([*STORE_RUN, *run_dirs]) == 0  # space is back: the store is created and the run trains
    client, run = _only_run(tmp_path)
    assert run.info.status == "FINISHED"


def test_a_disk_full_error_only_in_an_exceptions_context_is_a_disk_failure(tmp_path):
    # a library that fails while handling ENOSPC (a writer's cleanup, a wrapper without ``from e``) keeps the
    # disk error only as ``__context__``
    try:
        try:
            raise _enospc(tmp_path / "shard")
        except OSError:
            raise RuntimeError("the writer's cleanup failed") from None
    except RuntimeError as e:
        wrapped = e
    assert wrapped.__cause__ is None and isinstance(wrapped.__context__, OSError)
    assert disk_errno(wrapped) == errno.ENOSPC
    err = disk_error("writing checkpoint 'x'", tmp_path, wrapped)
    assert err is not None and str(err).startswith("No space left on device (ENOSPC) writing checkpoint 'x': disk ")
    assert disk_error("x", tmp_path, RuntimeError("a bug")) is None  # and a plain bug is not one
