"""``launcher=slurm`` against a real single-node SLURM cluster with accounting (the ``slurm_cluster`` fixture):
real sbatch, squeue, sacct, scancel and slurmctld's time-limit signal; real submitit, real MLflow (sqlite in a tmp
folder), real Hydra composition through the command line. The ablation runs in this process; each job is a process
slurmd starts."""

from __future__ import annotations

import contextlib
import io
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from store_dirs import dirs_under

import lowprec_lab.plan.preflight
import lowprec_lab.runner.scheduler
import lowprec_lab.runner.submitit_jobs
from lowprec.train.stop import STOP_SIGNALS, clear_stop
from lowprec_lab.cli import main

pytestmark = pytest.mark.slurm

#: A small ablation: the debug model, few steps, one CPU per job (the node has 2: two jobs at once).
RUN = ["experiment=smoke", "seeds=1", "train.val_every=3", "train.val_batches=1", "train.telemetry_every=3"]
RUN += ["train.batch_size=2", "train.seq_len=64", "train.warmup_steps=2", "train.timing_warmup_steps=1"]
RUN += ["launcher=slurm", "launcher.cpus_per_task=1", "launcher.poll_s=0.5"]


@pytest.fixture(autouse=True)
def own_handlers(monkeypatch):
    """The ablation installs its stop handlers in this (pytest) process: put pytest's back afterwards. One thread
    per job."""
    for module in (lowprec_lab.runner.scheduler, lowprec_lab.plan.preflight, lowprec_lab.runner.submitit_jobs):
        monkeypatch.setattr(module, "cores", lambda: 1)
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    clear_stop()
    try:
        yield
    finally:
        clear_stop()
        for s, h in saved.items():
            signal.signal(s, h)


def _ablate(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["ablate", *args])
    return rc, out.getvalue()


def _id(text: str) -> str:
    return re.search(r"ablation (abl-\d{8}-\d{6}-[0-9a-f]{4})", text).group(1)


def _runs(root: Path, ablation_id: str):
    """The parent run and its children by recipe."""
    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (parent,) = client.search_runs(
        [exp], filter_string=f"tags.`lowprec.ablation_id` = '{ablation_id}' and tags.`lowprec.kind` = 'ablation'"
    )
    kids = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {k.data.tags["recipe"]: k for k in kids}


def _when_training(root: Path, act, over: threading.Event, after_s: float = 3.0) -> threading.Thread:
    """A thread that calls ``act(job_id)`` ``after_s`` seconds after the one job's run appears RUNNING in MLflow
    (the job has started training it: its metrics reach MLflow only at the end), as a user or a scheduler acting
    from outside would."""
    db = root / "runs" / "mlflow.db"

    def watch() -> None:
        while not over.wait(0.5):
            try:
                client = MlflowClient(f"sqlite:///{db}")
                exp = client.get_experiment_by_name("lowprec")
                kids = client.search_runs([exp.experiment_id], "tags.`mlflow.parentRunId` != ''") if exp else []
                if kids and kids[0].info.status == "RUNNING" and kids[0].data.tags.get("slurm_job_id"):
                    if not over.wait(after_s):
                        act(kids[0].data.tags["slurm_job_id"])
                    return
            except Exception:  # the store is being created
                pass

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _ended_states(cluster, job_ids) -> dict[str, str]:
    """Each job's final state in ``sacct``, once none is pending, running or completing (60 s at most).

    submitit hands back a job's result once its pickle is written; the job's process exits after that and slurmdbd
    records the end asynchronously, so a loaded machine can still show RUNNING for several seconds. A test waits
    for its jobs before it ends: its folder, which they write in, is removed then."""
    deadline = time.monotonic() + 60
    while True:
        states = cluster.run("sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(sorted(job_ids)))
        got = dict(line.split("|", 1) for line in states.splitlines() if line.strip())
        if not set(got.values()) & {"PENDING", "RUNNING", "COMPLETING"} or time.monotonic() > deadline:
            return got
        time.sleep(1)


def test_an_ablation_on_slurm_finishes_every_run_and_writes_its_report(slurm_cluster, tmp_path):
    t0 = time.monotonic()
    args = [*RUN, "recipes=[fp32,bf16]", "train.steps=6", "device=cpu", f"launcher.partition={slurm_cluster.partition}"]
    next_job = slurm_cluster.next_job_id()
    rc, out = _ablate([*args, *dirs_under(tmp_path)])
    assert rc == 0, out
    ablation_id = _id(out)
    assert (tmp_path / "reports" / ablation_id / "report.md").exists()
    parent, kids = _runs(tmp_path, ablation_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["launcher"] == "slurm"
    assert {r: k.info.status for r, k in kids.items()} == {"fp32": "FINISHED", "bf16": "FINISHED"}
    job_ids = {k.data.tags["slurm_job_id"] for k in kids.values()}
    assert _ended_states(slurm_cluster, job_ids) == {j: "COMPLETED" for j in job_ids}
    # the next job id moves with each submission (the gres refusal's test relies on it)
    assert slurm_cluster.next_job_id() == next_job + 2 and {int(j) for j in job_ids} == {next_job, next_job + 1}
    print(f"slurm: cluster setup {slurm_cluster.setup_s:.1f} s; ablation of 2 jobs {time.monotonic() - t0:.1f} s")


def test_scancel_of_a_running_job_ends_its_run_killed_and_resume_finishes_it(slurm_cluster, tmp_path):
    args = [*RUN, "recipes=[fp32]", "train.steps=300", "train.checkpoint_every=100", "device=cpu"]
    args += [f"launcher.partition={slurm_cluster.partition}", *dirs_under(tmp_path)]
    over = threading.Event()
    cancelled = []

    def scancel(job_id: str) -> None:
        slurm_cluster.run("scancel", job_id)  # SIGTERM to the job's steps, SIGKILL after KillWait
        cancelled.append(job_id)

    t = _when_training(tmp_path, scancel, over)
    try:
        rc, out = _ablate(args)
    finally:
        over.set()
        t.join()
    assert rc == 0 and cancelled, out
    ablation_id = _id(out)
    _, kids = _runs(tmp_path, ablation_id)
    run = kids["fp32"]
    assert run.info.status == "KILLED", run.data.tags.get("failure_reason")
    assert run.data.tags["stopped_by"] == "SIGTERM" and run.data.tags["resume_checkpoint"]
    step = int(run.data.tags["stopped_after_step"])
    assert step < 299 and run.data.tags["slurm_job_id"] == cancelled[0]

    rc, out = _ablate([*args, f"resume={ablation_id}"])
    assert rc == 0, out
    parent, kids = _runs(tmp_path, ablation_id)
    again = kids["fp32"]
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"  # continued in place
    assert again.data.tags["resumed_step"] == run.data.tags["resume_checkpoint"].rsplit("/step_", 1)[1]
    assert again.data.tags["slurm_job_id"] != cancelled[0]  # by a new job
    assert parent.info.status == "FINISHED"
    job = again.data.tags["slurm_job_id"]
    assert _ended_states(slurm_cluster, {job}) == {job: "COMPLETED"}


# ~100 s measured on the 2-core machine (two job start-ups and up to 30 s until slurmctld's periodic check sends
# the warning): over the suite's budget for one test; the scancel test covers the same stop, checkpoint and resume
@pytest.mark.slow
def test_slurms_time_limit_signal_stops_the_run_with_a_checkpoint_and_resume_finishes_it(slurm_cluster, tmp_path):
    """``launcher.time`` is in minutes (1 at least) and submitit asks for SIGUSR2 90 s before it: the job's limit
    is lowered to 1 minute once it trains, so slurmctld's next periodic check (every 30 s) sends the warning at
    once, rather than waiting out a limit."""
    args = [*RUN, "recipes=[fp32]", "train.steps=600", "device=cpu"]
    args += [f"launcher.partition={slurm_cluster.partition}", *dirs_under(tmp_path)]
    over = threading.Event()
    limited = []

    def lower_the_limit(job_id: str) -> None:
        slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=1")
        limited.append(job_id)

    t = _when_training(tmp_path, lower_the_limit, over)
    try:
        rc, out = _ablate(args)
    finally:
        over.set()
        t.join()
    assert rc == 0 and limited, out
    ablation_id = _id(out)
    _, kids = _runs(tmp_path, ablation_id)
    run = kids["fp32"]
    assert run.info.status == "KILLED", run.data.tags.get("failure_reason")
    assert run.data.tags["stopped_by"] == "SIGUSR2" and run.data.tags["resume_checkpoint"]
    step = int(run.data.tags["stopped_after_step"])

    rc, out = _ablate([*args, f"resume={ablation_id}"])
    assert rc == 0, out
    _, kids = _runs(tmp_path, ablation_id)
    again = kids["fp32"]
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags["resumed_step"] == run.data.tags["resume_checkpoint"].rsplit("/step_", 1)[1]
    assert step < 599


def test_device_auto_on_a_partition_without_gpus_is_refused_in_one_line(slurm_cluster, tmp_path, capsys):
    """``device=auto`` (the default) asks each job for a GPU: sbatch would refuse every job (``Invalid generic
    resource (gres) specification``); the cluster's sinfo says the partition has none, before any MLflow run."""
    args = [*RUN, "recipes=[fp32]", "train.steps=2", f"launcher.partition={slurm_cluster.partition}"]
    next_job = slurm_cluster.next_job_id()
    assert main(["ablate", *args, *dirs_under(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "lowprec ablate: error: launcher=slurm with device=auto: each job asks for 1 GPU(s), but the nodes of "
        f"partition {slurm_cluster.partition} have none (sinfo gres: (null)); train on their CPUs with device=cpu, "
        "or name a partition with GPUs (launcher.partition=)"
    ), err
    assert not (tmp_path / "runs" / "mlflow.db").exists()
    # nothing submitted (an earlier test's job on this cluster can still be ending: not an empty squeue)
    assert slurm_cluster.next_job_id() == next_job
