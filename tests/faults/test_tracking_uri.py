"""A ``tracking.uri`` MLflow cannot open here is refused in one line before a run or a store is created
(``lowprec_lab.plan.config.check_store_uri``): MLflow's file store (``file://`` or a bare folder: MLflow 3 refuses
it with a paragraph and a traceback), and a database URI whose driver is not installed (SQLAlchemy imports it only
when MLflow opens the store: ``ModuleNotFoundError`` with a 20-frame traceback)."""

from __future__ import annotations

import importlib.util

import pytest

from lowprec_lab.cli import main

RUN = ["train", "model=debug", "train.batch_size=2", "train.seq_len=32", "train.steps=2", "train.val_every=0"]


def _dirs(tmp_path, uri: str) -> list[str]:
    return [f"paths.runs={tmp_path / 'runs'}", f"paths.reports={tmp_path / 'reports'}", f"tracking.uri={uri}"]


def _one_line(capsys) -> str:
    out = capsys.readouterr()
    err = out.err.strip()
    assert "\n" not in err and "Traceback" not in out.out + out.err, out.err
    return err


@pytest.mark.parametrize("form", ["file_uri", "bare_folder"])
@pytest.mark.parametrize("command", ["train", "sync"])
def test_a_file_store_is_refused_in_one_line_before_anything_is_created(tmp_path, capsys, form, command):
    uri = (tmp_path / "mlruns").as_uri() if form == "file_uri" else str(tmp_path / "mlruns")
    argv = [*RUN, *_dirs(tmp_path, uri)] if command == "train" else ["sync", str(tmp_path), f"tracking.uri={uri}"]
    (tmp_path / "spool").mkdir()  # an empty spool folder: sync would say "nothing spooled" without the check
    (tmp_path / "spool" / "r.jsonl").write_text('{"lowprec_spool": 1, "run_id": "r", "uri": "sqlite:///x.db"}\n')
    assert main(argv) == 2
    err = _one_line(capsys)
    assert f"tracking.uri={uri}: MLflow's file store is not supported" in err and "sqlite:///" in err
    assert not (tmp_path / "mlruns").exists()  # no store, no run


@pytest.mark.parametrize(
    "uri, driver",
    [
        ("postgresql://lab:s3cret@127.0.0.1:1/mlflow", "psycopg"),
        ("postgresql+psycopg2://lab:s3cret@127.0.0.1:1/mlflow", "psycopg2"),
        ("mysql://lab:s3cret@127.0.0.1:1/mlflow", "MySQLdb"),
    ],
)
def test_a_database_uri_without_its_driver_is_one_line_naming_the_driver(tmp_path, capsys, uri, driver):
    if importlib.util.find_spec(driver) is not None:
        pytest.skip(f"{driver} is installed here")
    assert main([*RUN, *_dirs(tmp_path, uri)]) == 2
    err = _one_line(capsys)
    assert f"needs the database driver {driver}, which is not installed" in err
    assert "s3cret" not in err  # the password in the URI is not printed
    assert not (tmp_path / "runs" / "checkpoints").exists()
