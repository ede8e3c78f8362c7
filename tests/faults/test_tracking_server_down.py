"""A tracking server that dies during a run: a real ``mlflow server`` subprocess is
SIGKILLed while a real ``lowprec train`` process logs to it. Restarted during the run, it receives the spooled writes
when the run writes next, in order; kept down to the run's end, the run ends FINISHED locally and ``lowprec sync``
delivers everything afterwards. Either way the server's ``loss`` series is the run's own: every step once, each value
equal to the same run tracked in a local sqlite store.

The training process is paused (SIGSTOP) while the server is killed or restarted, so that the fault lands at a known
point of the run however fast the machine is. One server (and its restarts) serves the whole module: each start costs
several seconds of the suite's two cores."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from stop_handlers import restored_stop_handlers

from benchmarks._support import MlflowServer
from lowprec_lab.cli import main
from lowprec_lab.tracking.spool import SPOOLED_TAG

RUN = ["model=debug", "model.qk_norm=false"]
RUN += ["train.batch_size=2", "train.seq_len=64", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=2", "train.timing_warmup_steps=1", "recipe=fp32", "train.steps=75", "train.progress=false"]
#: MetricBuffer flushes every 25 steps: the server is killed after the first flush, so steps 25-49 meet it dead; it
#: is back for the flush at step 75, the last, and the writes that end the run.
STEPS = 75


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("server"))
    s.start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run tracked in a local sqlite store: its loss per step."""
    d = tmp_path_factory.mktemp("reference")
    with restored_stop_handlers():  # the command installs its stop handlers in this (pytest) process
        args = [f"paths.runs={d}", f"paths.reports={d}", f"tracking.uri=sqlite:///{d / 'mlflow.db'}"]
        assert main(["train", *RUN, *args]) == 0
    client = MlflowClient(f"sqlite:///{d / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}


def _train(server, runs):
    """``lowprec train`` against the server, in its own process; stdout and stderr go to files under ``runs``."""
    runs.mkdir(parents=True)
    args = [*RUN, f"tracking.uri={server.uri}", f"paths.runs={runs}", f"paths.reports={runs}"]
    out, err = open(runs / "stdout.txt", "w"), open(runs / "stderr.txt", "w")
    with out, err:
        return subprocess.Popen([sys.executable, "-m", "lowprec_lab", "train", *args], stdout=out, stderr=err)


def _wait(what, proc, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert proc.poll() is None, f"lowprec train ended (exit {proc.returncode}) before the fault"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _server_rows(server, sql) -> int:
    try:
        with sqlite3.connect(server.db, timeout=1) as c:
            return c.execute(sql).fetchone()[0]
    except sqlite3.Error:  # the server is writing: ask again
        return 0


def _check_run(server, reference):
    """The run as the server has it: FINISHED, every loss step once and equal to the reference, artifacts there."""
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("lowprec").experiment_id
    run = client.search_runs([exp], order_by=["attributes.start_time DESC"])[0]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(STEPS))  # none lost, none twice
    assert {m.step: m.value for m in history} == reference
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert int(run.data.tags[SPOOLED_TAG]) >= 1 and run.data.tags["effective_matches"] == "true"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "effective_recipe.json"}
    assert "final_val_loss" in run.data.metrics
    return run


def test_a_server_killed_and_restarted_mid_run_gets_every_spooled_metric_in_order(server, reference, tmp_path):
    runs = tmp_path / "runs"
    proc = _train(server, runs)
    try:
        _wait(lambda: _server_rows(server, "select count(*) from metrics where key = 'loss'") > 0, proc)
        proc.send_signal(signal.SIGSTOP)
        server.kill()
        proc.send_signal(signal.SIGCONT)
        _wait(lambda: any((runs / "spool").glob("*.jsonl")), proc)  # the flush at step 50 met the dead server
        proc.send_signal(signal.SIGSTOP)
        server.start()
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    err = (runs / "stderr.txt").read_text()
    assert f"lowprec: tracking server {server.uri} failed (" in err and "goes on, its writes are spooled in" in err
    assert f"lowprec: tracking server {server.uri} answers again: replayed" in err
    assert "does not answer" not in err  # drained during the run: nothing left for lowprec sync
    _check_run(server, reference)
    assert not list((runs / "spool").glob("*.jsonl"))


def test_a_server_down_to_the_end_of_the_run_gets_everything_from_lowprec_sync(server, reference, tmp_path, capsys):
    runs = tmp_path / "runs"
    proc = _train(server, runs)
    try:
        # its first write after the run's creation: the run exists and its process knows it (a server killed
        # during the creation leaves the run to MLflow's minutes of retries, as without a spool)
        params = "select count(*) from params p join runs r using (run_uuid) where r.status = 'RUNNING'"
        _wait(lambda: _server_rows(server, params) > 0, proc)
        proc.send_signal(signal.SIGSTOP)
        server.kill()
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=120) == 0  # the run finished here, the server dead since its first steps
    finally:
        proc.kill()
    err, out = (runs / "stderr.txt").read_text(), (runs / "stdout.txt").read_text()
    (spool,) = (runs / "spool").glob("*.jsonl")
    assert f"ended FINISHED here, but the tracking server {server.uri} does not answer" in err, err
    assert f"replay them with: lowprec sync {spool} tracking.uri={server.uri}" in err and "FINISHED run" in out
    # a spool replays only to the store the user names: without tracking.uri=, the default store is not its own
    assert main(["sync", str(runs)]) == 2
    line = capsys.readouterr().err.strip()
    assert f"was written for the store {server.uri}, not the configured sqlite:///" in line and "\n" not in line
    sync = ["sync", str(runs), f"tracking.uri={server.uri}"]
    assert main(sync) == 2  # the server is still down: one line, nothing replayed
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"lowprec sync: error: tracking server {server.uri} is unreachable") and "\n" not in line
    shutil.copytree(runs / "spool", tmp_path / "copy")  # as if a sync were interrupted before its cursor moved
    server.start()
    assert main(sync) == 0
    said = capsys.readouterr().out
    assert f"sync: run {spool.stem}: replayed" in said and "ended FINISHED" in said
    run = _check_run(server, reference)
    assert not spool.exists() and main(sync) == 0  # again: nothing left
    assert "nothing spooled" in capsys.readouterr().out
    # every write sent a second time: the server keeps one copy of each metric, and the same end
    assert main(["sync", str(tmp_path / "copy"), f"tracking.uri={server.uri}"]) == 0
    again = _check_run(server, reference)
    assert again.info.end_time == run.info.end_time


@pytest.mark.slow  # ~30 s: the spool/sync path of the two tests above, from two worker processes
def test_an_ablations_workers_spool_and_sync_then_report_delivers_the_whole_ablation(server, reference, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    args = [
        "ablate",
        "controls=false",
        "recipes=[fp32,bf16]",
        "seeds=1",
        "workers=2",
        *[a for a in RUN if not a.startswith("recipe=")],
    ]
    args += [f"tracking.uri={server.uri}", f"paths.runs={runs}", f"paths.reports={tmp_path / 'reports'}"]
    with open(runs / "stdout.txt", "w") as out, open(runs / "stderr.txt", "w") as err:
        # its own process group: the ablation and its two worker processes are paused together
        cmd = [sys.executable, "-m", "lowprec_lab", *args]
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
    try:
        started = "select count(distinct p.run_uuid) from params p join tags t on p.run_uuid = t.run_uuid "
        started += "where t.key = 'mlflow.parentRunId'"
        _wait(lambda: _server_rows(server, started) == 2, proc)  # both runs created, each has written once
        os.killpg(proc.pid, signal.SIGSTOP)
        server.kill()
        os.killpg(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=180) == 0
    finally:
        proc.kill()
    said, err = (runs / "stdout.txt").read_text(), (runs / "stderr.txt").read_text()
    assert err.count("ended FINISHED here, but the tracking server") == 3, err  # two runs and the parent
    abl = said.split("ablation ", 1)[1].split(":", 1)[0]
    sync = f"lowprec sync {runs / 'spool'} tracking.uri={server.uri}"
    assert f"3 run(s) spooled in {runs / 'spool'}; {sync}, then lowprec report {abl}" in said
    server.start()
    assert main(["sync", str(runs), f"tracking.uri={server.uri}"]) == 0
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("lowprec").experiment_id
    found = client.search_runs([exp], f"tags.`lowprec.ablation_id` = '{abl}'")
    assert len(found) == 3 and all(r.info.status == "FINISHED" for r in found)
    fp32 = next(r for r in found if r.data.tags.get("recipe") == "fp32")
    assert {m.step: m.value for m in client.get_metric_history(fp32.info.run_id, "loss")} == reference
    report = ["report", abl, f"tracking.uri={server.uri}", f"paths.reports={tmp_path / 'reports'}"]
    assert main([*report, f"paths.runs={runs}"]) == 0 and (tmp_path / "reports" / abl / "report.md").is_file()
