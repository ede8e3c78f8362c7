"""A spool file is data someone may have sent (lowprec_lab/tracking/spool.py): each of its lines is read with a
bounded length and parsed without letting the parser's own limits escape; a record that would not replay, or that
would change what a run's own spool may not (its status backwards, another run's membership or files), is refused
in one line naming the file and the line, before anything is written, never reported as a failure of the store. A
spool file without one complete line is moved aside once instead of stopping every later command. Real MLflow
sqlite stores throughout."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
from mlflow.entities import Metric, RunTag

import lowprec_lab.tracking.spool as spool_module
from lowprec_lab.cli import main
from lowprec_lab.runner.orphans import OWNER_TAG, close_orphans
from lowprec_lab.tracking.spool import SpoolError, append, batch_record, end_record, read_spool, replay, spool_path
from lowprec_lab.tracking.tracker import Tracker


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """A real sqlite store with the experiment and no run, created once (MLflow's table creation takes seconds)."""
    root = tmp_path_factory.mktemp("store")
    Tracker(f"sqlite:///{root / 'mlflow.db'}", "lowprec", root)
    return root / "mlflow.db"


@pytest.fixture
def store(tmp_path, empty_store):
    """A copy of ``empty_store`` with one RUNNING run; returns (tracker, run id, spool folder)."""
    shutil.copyfile(empty_store, tmp_path / "mlflow.db")
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lowprec", tmp_path)
    return t, t.start_run("r", {}), tmp_path / "spool"


def _spool_with(store, line: str | bytes) -> Path:
    """The run's spool: a header, one good record (tag k=v) on line 2, then ``line`` on line 3."""
    t, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, t.uri, batch_record(tags=[RunTag("k", "v")]))
    with open(path, "ab") as f:
        f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


def _sync_refuses(store, path, capsys, where=": line 3") -> str:
    t, run_id, _ = store
    assert main(["sync", str(path), f"tracking.uri={t.uri}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"lowprec sync: error: {path}{where}"), err
    assert "failed" not in err and "still cannot take" not in err and "refused write" not in err  # not the store
    assert path.exists() and "k" not in t.client.get_run(run_id).data.tags  # nothing replayed
    return err


def _metric(step=0, ts=1, value=1.0) -> str:
    return json.dumps({"op": "batch", "metrics": [["loss", value, ts, step]], "params": [], "tags": []})


BAD_LINES = {
    # the parser's own limits: RecursionError and ValueError, neither a JSONDecodeError
    "nested_100000_deep": "[" * 100_000 + "]" * 100_000,
    "integer_of_5000_digits": _metric().replace('"loss", 1.0', '"loss", ' + "9" * 5000),
    # MLflow stores steps and timestamps as int64: a larger one fails inside the store
    "step_10_to_the_30": _metric(step=10**30),
    "timestamp_past_int64": _metric(ts=2**63),
    "value_past_a_double": _metric(value=10**400),
    "metric_without_a_string_key": _metric().replace('"loss"', "5"),
    "dict_nested_deeper_than_the_cap": json.dumps({"op": "dict", "name": "x.json", "obj": {}}).replace(
        "{}", '{"a": ' * 200 + "{}" + "}" * 200
    ),
    "param_value_not_a_string": json.dumps({"op": "batch", "metrics": [], "params": [["p", 5]], "tags": []}),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_a_malformed_line_is_one_line_naming_file_and_line_never_a_store_failure(store, capsys, kind):
    _sync_refuses(store, _spool_with(store, BAD_LINES[kind]), capsys)


def test_a_line_longer_than_the_cap_is_refused_before_it_is_parsed(store, capsys, monkeypatch):
    monkeypatch.setattr(spool_module, "MAX_LINE_BYTES", 4096)
    path = _spool_with(store, json.dumps({"op": "text", "name": "a.txt", "text": "x" * 10_000}))
    loads = []
    real = spool_module.json.loads
    monkeypatch.setattr(spool_module.json, "loads", lambda s, *a, **k: loads.append(len(s)) or real(s, *a, **k))
    err = _sync_refuses(store, path, capsys)
    assert "longer than 4096 bytes" in err and max(loads) < 4096  # the long line was never handed to the parser


def test_a_malformed_last_line_with_its_newline_is_refused_not_skipped_as_truncated(store, capsys):
    # only a line cut short (no newline: its writer was killed mid-write) is skipped; a complete last line that does
    # not parse is the file's content and is refused like any other
    err = _sync_refuses(store, _spool_with(store, "[" * 100_000), capsys)
    assert "nested too deeply" in err


# --- a spool changes only its own run, and never moves its status back ---------------------------------------------


def test_an_end_record_does_not_move_a_finished_run_back_to_failed(store, capsys):
    t, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, t.uri, batch_record(tags=[RunTag("k", "v")]))
    append(path, run_id, t.uri, {**end_record("FAILED"), "end_time": 5})
    t.client.set_terminated(run_id, "FINISHED", end_time=1_700_000_000_000)
    assert main(["sync", str(path), f"tracking.uri={t.uri}"]) == 0
    err = capsys.readouterr().err
    assert "its end record (FAILED) was not applied" in err and "already FINISHED" in err
    run = t.client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time == 1_700_000_000_000
    assert run.data.tags["k"] == "v" and not path.exists()  # the rest of the spool is replayed


def test_an_end_record_still_ends_a_failed_or_running_run(store):
    t, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, t.uri, {**end_record("FINISHED"), "end_time": 7})
    t.client.set_terminated(run_id, "FAILED")  # closed by a sweep while its spool waited: the spool knows better
    assert replay(t.client, path).end == "FINISHED" and t.client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.parametrize("status", ["RUNNING", "SCHEDULED", "finished", 3])
def test_an_end_record_sets_only_a_terminal_status(store, capsys, status):
    err = _sync_refuses(store, _spool_with(store, json.dumps({"op": "end", "status": status, "end_time": 5})), capsys)
    assert "is not one of FINISHED, FAILED, KILLED" in err


def test_a_spool_cannot_write_another_runs_records_or_attach_its_run_to_another_ablation(store, capsys):
    t, run_id, folder = store
    other = t.start_run("other", {"lowprec.ablation_id": "theirs"})
    # a record naming another run: records carry no run id, the file's name and header say whose they are
    line = json.dumps({"op": "batch", "run_id": other, "metrics": [], "params": [], "tags": [["k2", "v"]]})
    err = _sync_refuses(store, _spool_with(store, line), capsys)
    assert "'run_id'" in err and "k2" not in t.client.get_run(other).data.tags
    spool_path(folder, run_id).unlink()
    for tag in ("mlflow.parentRunId", "lowprec.ablation_id"):  # set when a run is created, never through a spool
        line = json.dumps({"op": "batch", "metrics": [], "params": [], "tags": [[tag, other]]})
        err = _sync_refuses(store, _spool_with(store, line), capsys)
        assert tag in err and "another run or ablation" in err
        assert tag not in t.client.get_run(run_id).data.tags
        spool_path(folder, run_id).unlink()


@pytest.mark.parametrize("target", ["other_runs_artifact", "other_runs_spool", "spool_folders_file"])
def test_a_file_record_is_confined_to_its_own_runs_files_folder_not_the_spool_folder(store, tmp_path, capsys, target):
    t, run_id, folder = store
    other = t.start_run("other", {})
    theirs = spool_path(folder, other)
    append(theirs, other, t.uri, {"op": "file", "path": str(_file(tmp_path / "secret.txt")), "folder": None})
    named = {
        "other_runs_artifact": next(theirs.with_suffix(".files").rglob("secret.txt")),
        "other_runs_spool": theirs,
        "spool_folders_file": _file(folder / "notes.txt"),
    }[target].relative_to(folder)
    line = json.dumps({"op": "file", "path": str(named), "folder": None})
    path = _spool_with(store, line)
    with pytest.raises(SpoolError, match="a file record names"):  # the spool's own check, whoever replays it
        read_spool(path)
    err = _sync_refuses(store, path, capsys, where=": a file record names")
    assert "refused" in err
    assert t.client.list_artifacts(run_id) == []


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("token=hunter2\n")
    return path


# --- a spool without one complete line ---------------------------------------------------------------------------


def _dead_owner_tags() -> dict[str, str]:
    """Owner tags of a process of this host, namespace and boot that is not running (pid max + 1 ticks)."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it
    return {
        OWNER_TAG: f"{socket.gethostname()}:{pid}:1",
        "lowprec.owner_pidns": os.readlink("/proc/self/ns/pid"),
        "lowprec.owner_boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
    }


@pytest.mark.parametrize("content", [b"", b'{"lowprec_spool": 1, "run_id": "ab'], ids=["0_bytes", "header_cut"])
def test_an_unwritten_spool_is_moved_aside_once_and_the_sweep_closes_its_run(store, capsys, content):
    t, _, folder = store
    dead = t.start_run("dead", _dead_owner_tags())
    path = spool_path(folder, dead)
    folder.mkdir(exist_ok=True)
    path.write_bytes(content)  # a crash between the spool's creation and its header's write
    assert close_orphans(t) == [dead]  # not refused: handled here
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "no complete line" in ln]
    assert len(lines) == 1 and "moved aside" in lines[0]
    assert not path.exists() and path.with_name(path.name + ".unwritten").read_bytes() == content
    assert t.client.get_run(dead).info.status == "FAILED"
    assert close_orphans(t) == [] and "no complete line" not in capsys.readouterr().err  # said once


def test_sync_of_a_folder_with_an_unwritten_spool_says_so_once(store, capsys):
    t, run_id, folder = store
    folder.mkdir(exist_ok=True)
    spool_path(folder, run_id).write_bytes(b"")
    assert main(["sync", str(folder), f"tracking.uri={t.uri}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no complete line" in err and "moved aside" in err
    assert main(["sync", str(folder), f"tracking.uri={t.uri}"]) == 0  # the next command is not refused
    assert "nothing spooled" in capsys.readouterr().out


def test_a_malformed_spool_of_a_dead_run_is_one_line_and_does_not_stop_the_sweep(store):
    t, _, _ = store
    dead = t.start_run("dead", _dead_owner_tags())
    gone = t.start_run("gone", _dead_owner_tags())
    path = _spool_with((t, dead, t.spool.folder), _metric(step=10**30))
    lines: list[str] = []
    assert close_orphans(t, lines.append) == [gone]  # the other dead run is still closed
    assert len(lines) == 1 and f"{path}: line 3" in lines[0] and "left RUNNING" in lines[0]
    assert t.client.get_run(dead).info.status == "RUNNING" and path.exists()  # kept for the user


def test_an_append_after_a_cut_line_starts_on_a_line_of_its_own(store):
    # a process killed mid-append left half a line; the run's next process (a resume) appends to the same file
    t, run_id, folder = store
    path = spool_path(folder, run_id)
    append(path, run_id, t.uri, batch_record([Metric("loss", 1.0, 1, 0)]))
    with open(path, "ab") as f:
        f.write(b'{"op": "batch", "metrics": [["loss", 2.0')
    append(path, run_id, t.uri, batch_record([Metric("loss", 3.0, 3, 2)]))
    assert replay(t.client, path).metrics == 2
    assert sorted(m.step for m in t.client.get_metric_history(run_id, "loss")) == [0, 2]
