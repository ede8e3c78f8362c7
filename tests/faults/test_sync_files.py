"""``lowprec sync`` uploads only the files of a spool's own ``<run id>.files/`` folder, each opened once: the folder
must be a real folder of this user's (not a link to ``/``), a record's path may hold no symbolic link at any
component, and what is uploaded is read from the one ``O_NOFOLLOW`` descriptor, so a file or folder swapped for a
link between the checks and the upload is refused, not followed. Real MLflow sqlite store, real symbolic links."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from mlflow.entities import RunTag

import lowprec_lab.tracking.spool as spool_module
from lowprec_lab.cli import main
from lowprec_lab.tracking.spool import append, batch_record, spool_path
from lowprec_lab.tracking.tracker import Tracker

SECRET = "token=hunter2\n"


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """A real sqlite store with the experiment, created once (its schema takes seconds): each test copies it."""
    root = tmp_path_factory.mktemp("store")
    Tracker(f"sqlite:///{root / 'mlflow.db'}", "lowprec", root)
    return root / "mlflow.db"


@pytest.fixture
def spooled(tmp_path, empty_store):
    """A real sqlite store with one RUNNING run and its spool (a tag, then a file under ``<run>.files/``, as a
    run writes them); returns (client, run id, spool path, the spooled copy, a secret file outside the folder)."""
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lowprec", tmp_path)
    run_id = t.start_run("r", {})
    path = spool_path(tmp_path / "spool", run_id)
    art = tmp_path / "notes.txt"
    art.write_text("the run's own notes\n")
    append(path, run_id, t.client.tracking_uri, batch_record(tags=[RunTag("k", "v")]))
    append(path, run_id, t.client.tracking_uri, {"op": "file", "path": str(art), "folder": "plots"})
    (copy,) = path.with_suffix(".files").rglob("notes.txt")
    secret = tmp_path / "home" / "notes.txt"  # the same name: only the content tells them apart
    secret.parent.mkdir()
    secret.write_text(SECRET)
    return t.client, run_id, path, copy, secret


def _record(path: Path, named: str) -> None:
    """Replace the spool's file record by one naming ``named``."""
    lines = path.read_text().splitlines()
    rec = json.loads(lines[-1])
    path.write_text("\n".join([*lines[:-1], json.dumps({**rec, "path": named})]) + "\n")


def _uploaded(client, run_id: str) -> dict[str, str]:
    root = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def _sync_refused(client, path: Path, capsys) -> str:
    assert main(["sync", str(path), f"tracking.uri={client.tracking_uri}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lowprec sync: error: {path}: a file record names ") and "\n" not in err, err
    assert err.endswith("; refused"), err
    return err


def test_a_spooled_file_is_uploaded_as_it_was_copied(spooled, capsys):
    client, run_id, path, _, _ = spooled
    assert main(["sync", str(path), f"tracking.uri={client.tracking_uri}"]) == 0, capsys.readouterr().err
    assert _uploaded(client, run_id) == {"plots/notes.txt": "the run's own notes\n"}
    assert client.get_run(run_id).data.tags["k"] == "v" and not path.exists()


def test_a_files_folder_that_is_a_link_to_the_root_uploads_nothing(spooled, capsys):
    client, run_id, path, _, secret = spooled
    files = path.with_suffix(".files")
    shutil.rmtree(files)
    files.symlink_to("/")
    _record(path, f"{files.name}/{secret.relative_to('/')}")  # <run>.files/etc/passwd, with a file of the test's
    err = _sync_refused(client, path, capsys)
    assert f"but {files.name} is a symbolic link" in err
    assert _uploaded(client, run_id) == {} and "k" not in client.get_run(run_id).data.tags  # nothing replayed
    assert path.exists()


@pytest.mark.parametrize("to", ["outside", "inside"])
def test_a_link_at_a_subfolder_of_the_record_is_refused(spooled, capsys, to):
    """A subfolder of ``<run>.files`` that is a link: to a folder outside, or even to a real folder inside it."""
    client, run_id, path, copy, secret = spooled
    files = path.with_suffix(".files")
    (files / "link").symlink_to(secret.parent if to == "outside" else copy.parent)
    _record(path, f"{files.name}/link/notes.txt")
    err = _sync_refused(client, path, capsys)
    if to == "inside":  # the link resolves inside the folder: refused for being a link
        assert f"but {files.name}/link is a symbolic link" in err
    assert _uploaded(client, run_id) == {} and "k" not in client.get_run(run_id).data.tags


def test_a_files_folder_of_another_user_is_refused(spooled, capsys):
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    client, run_id, path, _, _ = spooled
    os.chown(path.with_suffix(".files"), 65534, 65534)
    err = _sync_refused(client, path, capsys)
    assert "belongs to uid 65534, not to this user" in err and _uploaded(client, run_id) == {}


def test_a_fifo_is_refused_without_waiting_on_it(spooled, capsys):
    client, run_id, path, copy, _ = spooled
    copy.unlink()
    os.mkfifo(copy)
    _sync_refused(client, path, capsys)


@pytest.mark.parametrize("swapped", ["file", "folder"])
def test_what_is_swapped_for_a_link_after_the_checks_is_not_followed(spooled, capsys, monkeypatch, swapped):
    """Between the checks (``spooled_file``'s and sync's, all passed) and the upload, the file (or its folder)
    becomes a link to a file outside: the upload opens it with ``O_NOFOLLOW`` and refuses it."""
    client, run_id, path, copy, secret = spooled
    real_apply = spool_module.apply

    def swap_then_apply(client_, run_id_, rec, base=None):
        if rec["op"] == "file":  # the race an attacker would need to win, won every time
            if swapped == "file":
                copy.unlink()
                copy.symlink_to(secret)
            else:
                shutil.rmtree(copy.parent)
                copy.parent.symlink_to(secret.parent)
        return real_apply(client_, run_id_, rec, base)

    monkeypatch.setattr(spool_module, "apply", swap_then_apply)
    err = _sync_refused(client, path, capsys)
    assert "is a symbolic link" in err
    assert SECRET not in _uploaded(client, run_id).values() and _uploaded(client, run_id) == {}
    assert path.exists()  # the record stays spooled
