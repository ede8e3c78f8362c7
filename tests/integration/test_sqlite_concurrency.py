"""The embedded sqlite store under concurrent writers: two ablations, each an ablation process
and a worker, are four processes opening one new database at the same moment and logging runs, params, tags,
artifacts and buffered metrics into it. Nothing is lost and no process fails.

What failed before: MLflow's sqlite store creates its tables without a lock (``SqlAlchemyStore.__init__``), so the
processes that opened the new database together died with ``table experiments already exists`` or ``duplicate
column name: step``; ``Tracker`` now holds a lock file beside the database while it opens the store and creates the
experiment. Past that, MLflow's own ``PRAGMA busy_timeout = 20000`` per session kept every write (no ``database is
locked`` in these runs)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

WRITER = Path(__file__).with_name("sqlite_writer.py")
WRITERS, RUNS, STEPS = 4, 3, 60


def test_four_processes_writing_one_new_sqlite_store_at_once_lose_nothing(tmp_path, mlflow_makes_new_stores):
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    names = [f"w{i}" for i in range(WRITERS)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WRITER), uri, str(tmp_path), n, str(RUNS), str(STEPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in names
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"{n}.ready").exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()  # every process has imported MLflow: they open the new store together
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "database is locked" not in out and "Traceback" not in out
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id], max_results=1000)
    assert sorted((r.data.tags["writer"], r.data.tags["i"]) for r in runs) == [
        (n, str(i)) for n in names for i in range(RUNS)
    ]
    for r in runs:
        assert r.info.status == "FINISHED" and len(r.data.params) == 20
        assert r.data.tags["last_tagged_step"] == str((STEPS - 1) // 10 * 10)
        for key in ("loss", "grad_norm", "lr"):
            assert sorted(m.step for m in client.get_metric_history(r.info.run_id, key)) == list(range(STEPS))
        assert [a.path for a in client.list_artifacts(r.info.run_id)] == ["config.yaml"]
