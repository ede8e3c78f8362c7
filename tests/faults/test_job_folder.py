"""The submitit job folder is data the ablation reads (``launcher=slurm|submitit_local``): a job's outcome comes from
the JSON it wrote there, never from submitit's result pickle, so a ``*_result.pkl`` replaced while the ablation polls
runs nothing; the folder is created 0700, and one another user could write (group- or other-writable, someone
else's, a link) is refused before anything in it is read. Real submitit (its SLURM executor, against ``sbatch`` and
``sacct`` that exist only on PATH), real MLflow sqlite, real pickles that would write a marker file."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from store_dirs import dirs_under

from lowprec_lab.cli import compose, main
from lowprec_lab.plan.preflight import preflight
from lowprec_lab.runner import submitit_jobs
from lowprec_lab.tracking.tracker import make_tracker

ABLATE = [
    "model=debug",
    "recipes=[fp32]",
    "controls=false",
    "train.steps=2",
    "device=cpu",
    "launcher=slurm",
    "launcher.poll_s=0.05",
]


class Payload:
    """A pickle that writes ``marker`` when unpickled: what someone who can write the job folder would leave."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The plan of a one-run ``launcher=slurm`` ablation, with ``sbatch`` (answers job 4242, and copies what
    ``$LEAVE`` holds into ``$JOB``, as a job that ran would have written it), ``srun``, ``sacct`` (the job
    COMPLETED) and ``scancel`` on PATH only. Made once: a plan takes seconds; each test has its own ablation id."""
    root = tmp_path_factory.mktemp("lab")
    bin_ = root / "fakebin"
    bin_.mkdir()
    scripts = {
        "sbatch": 'mkdir -p "$JOB"\ncp -a "$LEAVE"/. "$JOB"/\necho "Submitted batch job 4242"',
        "srun": "exit 0",
        "sacct": 'printf "JobID|State|NodeList\\n4242|COMPLETED|node7\\n"',
        "scancel": "exit 0",
    }
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
        yield preflight(compose("ablate", [*ABLATE, *dirs_under(root)]))


@pytest.fixture
def cluster(plan, monkeypatch, tmp_path):
    """This test's ablation id, the folder whose files the fake ``sbatch`` leaves in the job folder, and the job
    folder."""
    ablation = f"abl-20261126-000000-{tmp_path.name[-4:].replace('_', '0')}"
    leave = tmp_path / "leave"
    leave.mkdir()
    job = submitit_jobs.job_folder(plan, ablation) / "4242"
    monkeypatch.setenv("LEAVE", str(leave))
    monkeypatch.setenv("JOB", str(job))
    return ablation, leave, job


def _outcome(run_id: str, **over) -> dict:
    return {"run_id": run_id, "recipe": "fp32", "seed": 0, "status": "FINISHED", "reason": "", "summary": {}} | over


def _ablation(tracker):
    parent = tracker.start_run("ablation", {})
    child = tracker.start_run("fp32/seed0", {"recipe": "fp32", "seed": "0"}, parent)
    return parent, child


def test_a_replaced_result_pickle_runs_nothing_and_the_json_outcome_is_used(plan, cluster, tmp_path):
    """The ablation's polling loop (``run_submitit``): the job is done (its result pickle exists), and that
    pickle is a payload; the outcome comes from ``outcome.json``."""
    ablation, leave, job = cluster
    tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent, child = _ablation(tracker)
    marker = tmp_path / "ran"
    (leave / "outcome.json").write_text(json.dumps(_outcome(child, summary={"final_val_loss": 1.5})))
    (leave / "4242_0_result.pkl").write_bytes(pickle.dumps(("success", Payload(marker))))
    (out,) = submitit_jobs.run_submitit(plan, [(plan.recipes[0], 0)], tracker, parent, ablation)
    assert not marker.exists()  # submitit's own pickle was not read
    assert (out.run_id, out.status, out.summary) == (child, "FINISHED", {"final_val_loss": 1.5})
    assert (job.parent.stat().st_mode & 0o777, job.stat().st_mode & 0o777) == (0o700, 0o700)


def _finished_job(plan, cluster, outcome: dict | None = None):
    """Submit the one job (the fake sbatch leaves ``outcome`` and a payload result pickle in its folder)."""
    ablation, leave, _ = cluster
    if outcome is not None:
        (leave / "outcome.json").write_text(json.dumps(outcome))
    (leave / "4242_0_result.pkl").write_bytes(pickle.dumps(("success", Payload(leave.parent / "ran"))))
    folder = submitit_jobs.job_folder(plan, ablation)
    submitit_jobs.prepare_job_folder(folder)
    ex = submitit_jobs.make_executor(plan, folder)
    return submitit_jobs._submit(ex, plan, submitit_jobs.Slot(0), (plan.recipes[0], 0), "p", ablation, None, None)


@pytest.mark.parametrize("change", ["group-writable", "other-writable", "foreign job folder", "job folder link"])
def test_a_job_folder_another_user_could_write_is_not_read(change, plan, cluster, tmp_path):
    tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent, child = _ablation(tracker)
    job = _finished_job(plan, cluster, _outcome(child))
    folder = Path(job.paths.folder)
    if change == "group-writable":
        folder.parent.chmod(0o770)
    elif change == "other-writable":
        folder.chmod(0o702)
    elif change == "foreign job folder":
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(folder, 65534, 65534)
    else:  # the job's folder replaced by a link to a folder of the same content
        real = folder.rename(folder.with_name("elsewhere"))
        folder.symlink_to(real)
    o = submitit_jobs.outcome_of(plan, job, "fp32", 0, tracker, parent)
    assert (o.run_id, o.status) == (child, "FAILED") and "\n" not in o.reason
    assert o.reason.startswith("slurm job 4242: its outcome was not read: job folder "), o.reason
    said = {"foreign job folder": "belongs to uid 65534", "job folder link": "is not a folder (a link?)"}
    assert said.get(change, "is writable by group or others") in o.reason
    assert tracker.client.get_run(child).info.status == "FAILED" and not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "outcome, said",
    [
        (_outcome("r", recipe="bf16"), "outcome.json is the outcome of 'bf16' seed 0, not this job's"),
        (_outcome("r", seed="0"), "outcome.json: seed is a str, not a run's outcome"),
        ({**_outcome("r"), "__class__": "x"}, "outcome.json holds the fields"),
        ([1, 2], "outcome.json is not a JSON object"),
    ],
    ids=["other run", "wrong type", "other field", "not an object"],
)
def test_an_outcome_file_that_is_not_a_jobs_outcome_fails_the_run_in_one_line(outcome, said, plan, cluster, tmp_path):
    tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent, child = _ablation(tracker)
    job = _finished_job(plan, cluster, outcome)
    o = submitit_jobs.outcome_of(plan, job, "fp32", 0, tracker, parent)
    assert (o.run_id, o.status) == (child, "FAILED") and said in o.reason and "\n" not in o.reason, o.reason
    assert not (tmp_path / "ran").exists()


def test_a_job_that_raised_is_told_from_its_error_file(plan, cluster, tmp_path):
    tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent, child = _ablation(tracker)
    (cluster[1] / "error.json").write_text(json.dumps({"error": "ValueError: no corpus at /data\nsecond line"}))
    job = _finished_job(plan, cluster)
    o = submitit_jobs.outcome_of(plan, job, "fp32", 0, tracker, parent)
    assert (o.run_id, o.status, o.reason) == (child, "FAILED", "slurm job 4242 raised: ValueError: no corpus at /data")
    assert not (tmp_path / "ran").exists()


def test_the_job_folder_is_made_owner_only_whatever_the_umask(tmp_path):
    folder = tmp_path / "runs" / "submitit" / "abl-20261126-000000-abcd"
    old = os.umask(0o002)
    try:
        submitit_jobs.prepare_job_folder(folder)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o700


def test_a_launcher_folder_others_can_write_is_refused_before_any_mlflow_run(run_dirs, tmp_path, capsys):
    shared = tmp_path / "shared_jobs"
    shared.mkdir()
    shared.chmod(0o777)
    assert main(["ablate", *ABLATE[:5], "launcher=submitit_local", f"launcher.folder={shared}", *run_dirs]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"lowprec ablate: error: job folder {shared} is writable by group or others (mode 777): its files could "
        f"have been replaced; nothing was read from it (chmod 700 {shared})"
    )
    assert not (tmp_path / "runs" / "mlflow.db").exists()
