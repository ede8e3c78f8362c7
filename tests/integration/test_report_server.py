"""The report on a tracking server and ``lowprec ui``: ``lowprec ui`` serves a store
(a real ``mlflow ui`` server), lists its ablations and stops on Ctrl-C; ``lowprec report ID`` against that server
rebuilds the report from the server alone (into a folder that never held it), logs it as the parent run's artifacts
there, and links recipe names to their runs in the server's UI; bad input ends in one line.

One test holds the server's whole life: each server start costs ~15 s of the suite's two cores."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
from fabricated_ablation import fabricate_ablation, main_runs
from mlflow.tracking import MlflowClient
from store_dirs import sqlite_uri

from lowprec_lab.cli import main
from lowprec_lab.report.build import find_ablation
from lowprec_lab.tracking.tracker import Tracker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ui(db: str, port: int) -> tuple[subprocess.Popen, str]:
    """``lowprec ui`` in a subprocess; returns it and what it printed up to its URL line."""
    cmd = [sys.executable, "-m", "lowprec_lab", "ui", "--port", str(port), f"tracking.uri={db}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("MLflow UI: "):
            break
    return proc, "".join(lines)


def _report_from_server(uri: str, abl: str, tmp_path) -> None:
    elsewhere = tmp_path / "another_machine"
    args = ["report", abl, f"tracking.uri={uri}", f"paths.reports={elsewhere}", f"paths.runs={elsewhere}"]
    assert main(args) == 0
    report = elsewhere / abl / "report.md"
    assert report.is_file() and (report.parent / "report.html").is_file()
    client = MlflowClient(uri)
    parent = find_ablation(Tracker(uri, "lowprec", elsewhere), abl)
    logged = {a.path for a in client.list_artifacts(parent.info.run_id)}
    pngs = {p.name for p in report.parent.glob("*.png")}
    assert {"report.md", "report.html"} | pngs <= logged and len(pngs) >= 6
    # the logged report is the one written (read back through the server)
    got = client.download_artifacts(parent.info.run_id, "report.md", str(tmp_path))
    assert open(got).read() == report.read_text()
    html = (report.parent / "report.html").read_text()
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    rowwise0 = next(c for c in children if c.data.tags["recipe"] == "fp8_rowwise" and c.data.tags["seed"] == "0")
    link = f'<a href="{uri}/#/experiments/{parent.info.experiment_id}/runs/{rowwise0.info.run_id}"'
    assert link in html and "<code>fp8_rowwise</code></a>" in html


def test_lowprec_ui_serves_the_store_the_report_is_rebuilt_from_it_and_ctrl_c_stops_it(tmp_path, capsys):
    db = sqlite_uri(tmp_path / "mlflow.db")
    fabricate_ablation(Tracker(db, "lowprec", tmp_path), "abl-srv", main_runs())
    port = _free_port()
    proc, out = _start_ui(db, port)
    uri = f"http://127.0.0.1:{port}"
    try:
        assert f"MLflow UI: {uri}" in out, out
        assert "  abl-srv  FINISHED" in out and "1 ablation(s)" in out
        # a second UI on the same port: one line, before any server starts
        capsys.readouterr()
        assert main(["ui", "--port", str(port), f"tracking.uri={db}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"lowprec ui: error: port {port} on 127.0.0.1 is in use") and "\n" not in err
        _report_from_server(uri, "abl-srv", tmp_path)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failed assertion above: SIGKILL, and the server dies with it (PDEATHSIG)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "lowprec ui: stopped" in rest
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is not a listener
        s.bind(("127.0.0.1", port))  # the server went with lowprec


def test_report_of_an_unknown_id_or_an_unreachable_server_is_one_line(main_ablation, tmp_path, capsys):
    db = main_ablation.uri  # an existing store, holding other ablations
    capsys.readouterr()
    assert main(["report", "abl-nope", f"tracking.uri={db}", f"paths.reports={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowprec report: error: no ablation 'abl-nope'") and "\n" not in err
    t0 = time.monotonic()
    closed = f"http://127.0.0.1:{_free_port()}"
    assert main(["report", "abl-srv", f"tracking.uri={closed}", f"paths.reports={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lowprec report: error: tracking server {closed} is unreachable") and "\n" not in err
    assert time.monotonic() - t0 < 30  # not MLflow's minutes of retries


@pytest.mark.parametrize("bad", ["../../escaped", "abl-x/../../y", "/tmp/abs", "x'y", "abl-a' or tags.x like '%", "é"])
def test_report_refuses_an_id_that_is_not_an_ablation_id_before_using_it(main_ablation, tmp_path, capsys, bad):
    db = main_ablation.uri  # a store holding an ablation (an id that reached a query could match it)
    reports = tmp_path / "deep" / "reports"
    capsys.readouterr()
    assert main(["report", bad, f"tracking.uri={db}", f"paths.reports={reports}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowprec report: error: ") and "is not an ablation id" in err and "\n" not in err
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "deep" / "y").exists()
