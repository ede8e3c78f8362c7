"""``launcher=submitit_local``: each run of an ablation is a job of submitit's real
``LocalExecutor`` (its own controller and process), submitted, polled and collected by the ablation process, the
path ``launcher=slurm`` takes on a cluster. The ablation ends with the report ``launcher=local`` writes; a job whose
process is killed (SIGKILL, as SLURM's hard kill or the OOM killer would) fails its run only, never left RUNNING, with
the job named in the reason; ``resume=`` continues that run alone from its checkpoint. Real submitit, real MLflow
(sqlite in a tmp folder), real Hydra composition through the command line."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import threading
from pathlib import Path

import pytest
from fault_env import injected
from mlflow.tracking import MlflowClient
from stop_handlers import restored_stop_handlers
from store_dirs import dirs_under

import lowprec_lab.plan.preflight
import lowprec_lab.runner.scheduler
import lowprec_lab.runner.submitit_jobs
from lowprec_lab.cli import main

RUN = ["experiment=smoke", "recipes=[fp32,bf16]", "seeds=1", "train.steps=6", "train.val_every=3"]
RUN += ["train.val_batches=1", "train.telemetry_every=3", "train.batch_size=2", "train.seq_len=64"]
RUN += ["train.warmup_steps=2", "train.timing_warmup_steps=1", "launcher.poll_s=0.2"]


@pytest.fixture(autouse=True)
def own_handlers(monkeypatch):
    """The commands install their stop handlers in this (pytest) process: put pytest's back afterwards. Two jobs
    with one thread each on any machine."""
    for module in (lowprec_lab.runner.scheduler, lowprec_lab.plan.preflight, lowprec_lab.runner.submitit_jobs):
        monkeypatch.setattr(module, "cores", lambda: 2)
    with restored_stop_handlers():
        yield


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
    by_recipe = {k.data.tags["recipe"]: k for k in kids}
    assert len(by_recipe) == len(kids), "two runs of one recipe"
    return parent, by_recipe


def _sections(report: Path) -> list[str]:
    """The report's headings, without what names the contention (``launcher=local`` here trains one run at a time)."""
    return [re.sub(r" \(.*\)$", "", h) for h in re.findall(r"^#+ .*$", report.read_text(), re.M)[1:]]


# a long check: the killed-job test below runs a submitit_local ablation to its report in the suite
@pytest.mark.slow
def test_submitit_local_ablation_writes_the_report_of_a_local_one(tmp_path):
    rc, out = _ablate([*RUN, "workers=1", *dirs_under(tmp_path / "local")])
    assert rc == 0, out
    local_id = _id(out)
    rc, out = _ablate([*RUN, "launcher=submitit_local", "workers=2", *dirs_under(tmp_path / "jobs")])
    assert rc == 0, out
    ablation_id = _id(out)
    assert "launcher=submitit_local: one job per run" in out
    report = tmp_path / "jobs" / "reports" / ablation_id / "report.md"
    local = _sections(tmp_path / "local" / "reports" / local_id / "report.md")
    assert _sections(report) == local and "Verdicts" in " ".join(local)
    parent, kids = _runs(tmp_path / "jobs", ablation_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["launcher"] == "submitit_local"
    assert {r: k.info.status for r, k in kids.items()} == {"fp32": "FINISHED", "bf16": "FINISHED"}
    folder = tmp_path / "jobs" / "runs" / "submitit" / ablation_id
    job_ids = {k.data.tags["submitit_job_id"] for k in kids.values()}
    # each run was trained by its own job: its id is a job folder of submitit's, whose result pickle is there
    assert len(job_ids) == 2 and all(list((folder / j).glob("*_result.pkl")) for j in job_ids), job_ids
    # and by another process than the ablation's
    assert all(k.data.tags["lowprec.owner"] != parent.data.tags["lowprec.owner"] for k in kids.values())


def test_a_killed_job_fails_its_run_only_and_resume_continues_it_alone(tmp_path):
    args = [*RUN, "launcher=submitit_local", "workers=2", "train.checkpoint_every=2", *dirs_under(tmp_path)]
    # SIGKILL to bf16's job process before its step 5: no handler runs, the job returns nothing
    with injected("recipe=bf16,kill_at_step=5"):  # inherited by the job processes submitit starts
        rc, out = _ablate(args)
    assert rc == 0, out
    ablation_id = _id(out)
    assert (tmp_path / "reports" / ablation_id / "report.md").exists()  # the ablation went on to its report
    parent, kids = _runs(tmp_path, ablation_id)
    killed, kept = kids["bf16"], kids["fp32"]
    assert kept.info.status == "FINISHED"
    assert killed.info.status == "FAILED"  # not left RUNNING
    job = killed.data.tags["submitit_job_id"]
    reason = killed.data.tags["failure_reason"]
    assert reason.startswith(f"submitit_local job {job}: its process ended without a result"), reason
    assert killed.data.tags["failure_kind"] == "crash" and killed.data.tags["job_state"]
    assert parent.data.tags["n_failed"] == "1"
    # the ablation read the finished job's outcome from its JSON, in a folder only this user can enter
    folder = tmp_path / "runs" / "submitit" / ablation_id
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / kept.data.tags["submitit_job_id"] / "outcome.json").exists()
    assert not (folder / job / "outcome.json").exists()  # the killed job wrote none

    rc, out = _ablate([*args, f"resume={ablation_id}"])
    assert rc == 0, out
    assert "fp32             seed 0: FINISHED before the resume, kept" in out
    assert "bf16             seed 0: continues from step_4 (FAILED: submitit_local job" in out
    parent, kids = _runs(tmp_path, ablation_id)
    again = kids["bf16"]
    assert again.info.run_id == killed.info.run_id and again.info.status == "FINISHED"  # continued in place
    assert again.data.tags["resumed_step"] == "4"
    assert again.data.tags["submitit_job_id"] != job  # by a new job
    assert kids["fp32"].info.end_time == kept.info.end_time  # kept as it was: not resubmitted
    assert parent.info.status == "FINISHED" and parent.data.tags["n_failed"] == "0"


@pytest.mark.slow  # ~25 s; the job's own stop handling is the local runner's (test_signals.py)
def test_sigterm_to_the_ablation_stops_its_jobs_with_checkpoints(tmp_path, capsys):
    db = tmp_path / "runs" / "mlflow.db"
    over = threading.Event()

    def sigterm_once_both_jobs_train() -> None:  # from outside, as a scheduler or a user would
        while not over.wait(0.2):
            try:
                client = MlflowClient(f"sqlite:///{db}")
                exp = client.get_experiment_by_name("lowprec")
                if exp and len(client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")) >= 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # the parent and both jobs' runs are running
                    return
            except Exception:  # the store is being created
                pass

    t = threading.Thread(target=sigterm_once_both_jobs_train, daemon=True)
    t.start()
    try:
        rc = main(["ablate", *RUN, "train.steps=300", "launcher=submitit_local", "workers=2", *dirs_under(tmp_path)])
    finally:
        over.set()
        t.join()
    assert rc == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("resume it: lowprec ablate ") and "launcher=submitit_local" in line, line
    parent, kids = _runs(tmp_path, line.rsplit("resume=", 1)[1])
    assert parent.info.status == "KILLED"
    for kid in kids.values():  # each job's run stopped after a step, with the checkpoint resume= continues from
        assert kid.info.status == "KILLED", kid.data.tags.get("failure_reason")
        assert kid.data.tags["stopped_by"] == "SIGTERM" and kid.data.tags["resume_checkpoint"]
        assert int(kid.data.tags["stopped_after_step"]) < 299


def test_a_parallel_layout_trains_under_torchrun_inside_its_job(tmp_path):
    """``parallel.dp_shard=2``: the job starts torchrun with 2 ranks (gloo) and rank 0 alone logs the run, whose
    losses are those of one process (the FSDP2 tests' 1e-5 relative)."""
    one = [a for a in RUN if not a.startswith("recipes=")] + ["recipes=[fp32]"]
    rc, out = _ablate([*one, "workers=1", *dirs_under(tmp_path / "one")])
    assert rc == 0, out
    _, ref = _runs(tmp_path / "one", _id(out))
    rc, out = _ablate([*one, "parallel.dp_shard=2", "launcher=submitit_local", *dirs_under(tmp_path / "jobs")])
    assert rc == 0, out
    assert "launching torchrun" not in out  # the ablation process submits; the job starts the ranks
    ablation_id = _id(out)
    parent, kids = _runs(tmp_path / "jobs", ablation_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["world_size"] == "2"
    run = kids["fp32"]
    assert run.info.status == "FINISHED", run.data.tags.get("failure_reason")
    assert run.data.tags["parallel"] == "fsdp2" and run.data.tags["world_size"] == "2"
    assert run.data.metrics["comm_reduce_scatter_bytes"] > 0  # two ranks exchanged gradients
    job = run.data.tags["submitit_job_id"]
    folder = tmp_path / "jobs" / "runs" / "submitit" / ablation_id / job
    assert (folder / "outcome.json").exists() and list(folder.glob("*_result.pkl"))  # rank 0's outcome, returned
    client = MlflowClient(f"sqlite:///{tmp_path / 'jobs' / 'runs' / 'mlflow.db'}")
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(losses) == 6  # one rank logged: each step once
    single = [
        m.value
        for m in MlflowClient(f"sqlite:///{tmp_path / 'one' / 'runs' / 'mlflow.db'}").get_metric_history(
            ref["fp32"].info.run_id, "loss"
        )
    ]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, single, strict=True)) < 1e-5, (losses, single)
    assert run.data.metrics["final_val_loss"] == pytest.approx(ref["fp32"].data.metrics["final_val_loss"], rel=1e-5)


def test_sigterm_stops_a_parallel_job_on_every_rank_with_a_checkpoint(tmp_path, capsys):
    """SIGTERM to the ablation: its job passes it to both ranks (not through torchrun, which ignores it), which
    stop after the same step and write the sharded checkpoint; the run is KILLED with it."""
    db = tmp_path / "runs" / "mlflow.db"
    over = threading.Event()

    def sigterm_once_the_run_trains() -> None:
        while not over.wait(0.2):
            try:
                client = MlflowClient(f"sqlite:///{db}")
                exp = client.get_experiment_by_name("lowprec")
                running = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") if exp else []
                if any(client.get_metric_history(r.info.run_id, "loss") for r in running):
                    os.kill(os.getpid(), signal.SIGTERM)  # the job's ranks are past their first step
                    return
            except Exception:  # the store is being created
                pass

    one = [a for a in RUN if not a.startswith("recipes=")] + ["recipes=[fp32]", "train.telemetry_every=1"]
    t = threading.Thread(target=sigterm_once_the_run_trains, daemon=True)
    t.start()
    try:
        rc = main(
            [
                "ablate",
                *one,
                "train.steps=300",
                "parallel.dp_shard=2",
                "launcher=submitit_local",
                *dirs_under(tmp_path),
            ]
        )
    finally:
        over.set()
        t.join()
    assert rc == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    parent, kids = _runs(tmp_path, line.rsplit("resume=", 1)[1])
    assert parent.info.status == "KILLED"
    run = kids["fp32"]
    assert run.info.status == "KILLED", run.data.tags.get("failure_reason")
    assert run.data.tags["stopped_by"] == "SIGTERM" and int(run.data.tags["stopped_after_step"]) < 299
    assert Path(run.data.tags["resume_checkpoint"]).is_dir()
