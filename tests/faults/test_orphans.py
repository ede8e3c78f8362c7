"""A run whose process was killed without a word (kill -9) is ended FAILED by the next lowprec command on the same
host (lowprec_lab/runner/orphans.py), and only such a run: one whose owner is alive, or on another host, stays
RUNNING."""

from __future__ import annotations

import signal
import subprocess
import sys

from fault_env import env_with
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main
from lowprec_lab.runner.orphans import OWNER_TAG, owner, owner_alive

RUN = ["model=debug", "train.batch_size=2", "train.seq_len=64", "train.val_every=0", "train.val_batches=1"]
RUN += ["train.warmup_steps=2", "train.timing_warmup_steps=1", "recipe=fp32", "train.steps=6"]


def _runs(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    return client, exp, sorted(client.search_runs([exp]), key=lambda r: r.info.start_time)


def test_owner_of_this_process_is_alive_and_a_dead_or_foreign_one_is_told_apart():
    assert owner_alive(owner()) is True
    host, pid, ticks = owner().rsplit(":", 2)
    assert owner_alive(f"{host}:{pid}:{int(ticks) + 1}") is False  # a recycled pid: another start time
    assert owner_alive(f"another-host-{host}:{pid}:{ticks}") is None
    assert owner_alive("garbage") is None


def test_a_killed_runs_mlflow_run_is_ended_failed_by_the_next_command(run_dirs, tmp_path, capsys):
    # the first run SIGKILLs itself before step 3: no handler runs, its MLflow run stays RUNNING
    args = ["train", *RUN, *run_dirs]
    cmd = [sys.executable, "-m", "lowprec_lab", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env_with("kill_at_step=3"))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    client, exp, (dead,) = _runs(tmp_path)
    assert dead.info.status == "RUNNING" and dead.data.tags[OWNER_TAG].split(":")[1] == str(proc.pid)
    # a RUNNING run owned by this (live) process, and one owned by another host, are not touched
    alive = client.create_run(exp, tags={OWNER_TAG: owner()}).info.run_id
    foreign = client.create_run(exp, tags={OWNER_TAG: "elsewhere.example:1:1"}).info.run_id

    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"run {dead.info.run_id} was left RUNNING by a process that died; recorded FAILED" in out
    closed = client.get_run(dead.info.run_id)
    assert closed.info.status == "FAILED" and closed.info.end_time is not None
    assert closed.data.tags["orphan_closed"] == "true"
    assert closed.data.tags["failure_reason"].endswith("died during the run (found by a later lowprec command)")
    assert client.get_run(alive).info.status == "RUNNING" and client.get_run(foreign).info.status == "RUNNING"
    statuses = sorted(r.info.status for r in client.search_runs([exp]))
    assert statuses == ["FAILED", "FINISHED", "RUNNING", "RUNNING"]


def test_every_step_up_to_a_checkpoint_is_in_mlflow_when_the_process_is_killed(run_dirs, tmp_path):
    # metrics are buffered (one MLflow write per 25 steps) but flushed after each checkpoint: a kill -9 loses only
    # steps after the last checkpoint, which the resumed run trains (and logs) again
    args = ["train", *RUN, *run_dirs, "train.steps=10", "train.checkpoint_every=3"]
    cmd = [sys.executable, "-m", "lowprec_lab", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with("kill_at_step=7"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    client, _, (dead,) = _runs(tmp_path)
    logged = sorted(m.step for m in client.get_metric_history(dead.info.run_id, "loss"))
    assert logged == list(range(6))  # steps 0-5: the checkpoint step_6 was written after step 5, then a flush
