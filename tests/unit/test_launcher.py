"""``launcher=...`` refused in one line before any MLflow run: SLURM without ``sbatch``
on PATH or without the ``submitit`` package, an unknown launcher, a value out of range, a parallel layout larger
than ``launcher.gpus_per_node`` (each job runs its run's ranks with torchrun on one node), a submitit launcher under
torchrun; and the typed ``LauncherSpec`` the ``Plan`` carries. Real Hydra composition through the command line."""

from __future__ import annotations

import os
import sys

import pytest

from lowprec.errors import ConfigError
from lowprec_lab.cli import compose, main
from lowprec_lab.plan.launcher import LauncherSpec, check_launcher
from lowprec_lab.plan.placement import Slot
from lowprec_lab.plan.preflight import preflight

ABLATE = ["ablate", "model=debug", "recipes=[fp32]", "train.steps=2", "device=cpu", "controls=false", "seeds=3"]


def _one_line(args: list[str], run_dirs, capsys) -> str:
    assert main([*ABLATE, *run_dirs, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lowprec ablate: error: "), err
    return err


@pytest.fixture
def no_sbatch(monkeypatch, tmp_path):
    """A PATH with no ``sbatch`` on it (this machine has none either; said, so the test cannot pass by luck)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_slurm_without_sbatch_is_one_line_and_creates_no_mlflow_run(no_sbatch, run_dirs, tmp_path, capsys):
    err = _one_line(["launcher=slurm", "launcher.partition=gpu", "launcher.time=30"], run_dirs, capsys)
    assert "launcher=slurm: sbatch is not on PATH" in err, err
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_slurm_without_submitit_is_one_line(monkeypatch, run_dirs, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "submitit", None)  # importlib.util.find_spec: not installed
    err = _one_line(["launcher=slurm"], run_dirs, capsys)
    assert "launcher=slurm needs the submitit package" in err, err
    assert not (tmp_path / "runs" / "mlflow.db").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["launcher=pbs"], "unknown launcher 'pbs'; known: local, slurm, submitit_local"),
        (["launcher.name=pbs"], "launcher.name=pbs is not one of local, slurm, submitit_local"),
        (["launcher=submitit_local", "launcher.time=0"], "launcher.time=0 must be >= 1"),
        (["launcher=submitit_local", "launcher.mem_gb=-1"], "launcher.mem_gb=-1.0 must be > 0"),
        # --mem=0 asks SLURM for a whole node's memory; poll_s=0 is a busy loop over sacct
        (["launcher=submitit_local", "launcher.mem_gb=0"], "launcher.mem_gb=0.0 must be > 0"),
        (["launcher=submitit_local", "launcher.poll_s=0"], "launcher.poll_s=0.0 must be > 0"),
        (["launcher=submitit_local", "launcher.time=soon"], "launcher.time"),
        (  # a job's torchrun is --standalone: one run on one node at most
            ["launcher=submitit_local", "launcher.gpus_per_node=1", "parallel.dp_shard=2", "train.batch_size=2"],
            "the parallel layout needs 2 GPUs per run but launcher.gpus_per_node=1",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_launcher_is_one_line_and_creates_no_mlflow_run(args, needle, run_dirs, tmp_path, capsys):
    err = _one_line(args, run_dirs, capsys)
    assert needle in err, err
    assert not (tmp_path / "runs" / "mlflow.db").exists()


@pytest.mark.parametrize("key", ["partition", "account", "qos", "constraint", "folder", "setup"])
def test_a_newline_in_a_free_text_launcher_field_is_one_line(key, run_dirs, tmp_path, capsys):
    """The free-text fields become lines of the job's sbatch script: a newline in one would start a shell line of
    its own. Refused in one line before any MLflow run, through the real command line."""
    value = "gpu\n#SBATCH --wrap=touch /tmp/x"
    arg = f"launcher.setup=['echo hi', '{value}']" if key == "setup" else f"launcher.{key}='{value}'"
    err = _one_line(["launcher=slurm", arg], run_dirs, capsys)
    name = "launcher.setup[1]" if key == "setup" else f"launcher.{key}"
    assert f"{name}={value!r} holds the control character" in err and "sbatch script; refused" in err, err
    assert not (tmp_path / "runs" / "mlflow.db").exists()


@pytest.mark.parametrize("key", ["partition", "account", "qos", "constraint", "folder", "setup"])
@pytest.mark.parametrize("bad", ["\r", "\x00", "\x1b", "\x85", "\u2028", "\t"], ids=repr)
def test_any_control_character_in_a_free_text_launcher_field_is_refused(key, bad):
    found = lambda name: f"/usr/bin/{name}"  # noqa: E731
    spec = LauncherSpec(name="slurm", **{key: (f"a{bad}b",) if key == "setup" else f"a{bad}b"})
    with pytest.raises(ConfigError, match="holds the control character"):
        check_launcher(spec, 1, which=found)


def test_plain_launcher_text_passes():
    found = lambda name: f"/usr/bin/{name}"  # noqa: E731
    spec = LauncherSpec(name="slurm", partition="gpu,debug", account="proj-1", qos="high", constraint="a100&ib")
    check_launcher(LauncherSpec(**{**spec.__dict__, "setup": ("source .venv/bin/activate",)}), 1, which=found)
    check_launcher(LauncherSpec(name="slurm", folder="/scratch/me/jobs été"), 1, which=found)


def test_slurm_checks_with_sbatch_found():
    found = lambda name: f"/usr/bin/{name}"  # noqa: E731
    check_launcher(LauncherSpec(name="slurm", partition="gpu", gpus_per_node=8), 1, which=found)
    with pytest.raises(ConfigError, match="layout needs 16 GPUs per run but launcher.gpus_per_node=8"):
        check_launcher(LauncherSpec(name="slurm", gpus_per_node=8), 16, which=found)
    check_launcher(LauncherSpec(name="slurm", gpus_per_node=8), 8, which=found)  # 8 ranks: torchrun in the job
    check_launcher(LauncherSpec(name="local"), 16, which=lambda name: None)  # today's behaviour: nothing asked


def test_a_submitit_launcher_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")  # as torchrun sets them: every rank would submit every run
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="launcher=submitit_local submits from one process"):
        check_launcher(LauncherSpec(name="submitit_local"), 2)
    check_launcher(LauncherSpec(name="local"), 2)


def test_the_plan_carries_the_launcher_typed(run_dirs):
    plan = preflight(
        compose(
            "ablate",
            [*ABLATE[1:], *run_dirs, "launcher=submitit_local", "launcher.time=30", "launcher.setup=[echo hi]"],
        )
    )
    assert plan.launcher == LauncherSpec(name="submitit_local", time=30, setup=("echo hi",))
    assert plan.launcher.submitit and plan.launcher.job_id_tag == "submitit_job_id"
    assert preflight(compose("ablate", [*ABLATE[1:], *run_dirs])).launcher == LauncherSpec()  # local by default
    assert preflight(compose("train", ["model=debug", "recipe=fp32", *run_dirs])).launcher == LauncherSpec()


def test_a_dry_run_says_the_jobs(run_dirs, tmp_path, capsys):
    args = ["launcher=submitit_local", "workers=2", "seeds=2", "launcher.time=30", "dry_run=true"]
    assert main([*ABLATE[:2], "recipes=[fp32,bf16]", *ABLATE[3:], *run_dirs, *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "launcher=submitit_local: 4 job(s), one per run, 2 at a time; each asks 0 GPU(s), 30 min", out
    assert not (tmp_path / "runs" / "mlflow.db").exists()


@pytest.fixture
def fake_slurm(monkeypatch, tmp_path):
    """``sbatch``, ``srun``, ``sacct`` and ``scancel`` of a cluster that exists only on PATH: sbatch keeps the
    script it is given and answers job 4242; sacct says the job ran out of memory. (No cluster here: what is checked
    is what lowprec asks submitit for and what it does with SLURM's answer.)"""
    bin_ = tmp_path / "fakebin"
    bin_.mkdir()
    scripts = {
        "sbatch": f'cp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"',
        "srun": "exit 0",
        "sacct": 'printf "JobID|State|NodeList\\n4242|OUT_OF_MEMORY|node7\\n"',
        "scancel": "exit 0",
        "sinfo": 'echo "gpu*|gpu:8"',  # the partition's nodes have GPUs: device=auto's jobs may ask for one
    }
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    return tmp_path / "submitted.sh"


def test_slurm_jobs_ask_what_the_launcher_says_and_a_job_without_result_fails_its_run(
    fake_slurm, run_dirs, tmp_path, monkeypatch
):
    import submitit.core.core

    from lowprec_lab.runner import submitit_jobs
    from lowprec_lab.tracking.tracker import make_tracker

    over = ["launcher=slurm", "launcher.partition=gpu", "launcher.time=30", "launcher.account=proj"]
    over += ["launcher.mem_gb=64", "launcher.cpus_per_task=4", "launcher.setup=['source venv/bin/activate']"]
    plan = preflight(compose("ablate", [*ABLATE[1:4], *run_dirs, *over]))
    ex = submitit_jobs.make_executor(plan, tmp_path / "jobs")
    job = submitit_jobs._submit(ex, plan, Slot(0), (plan.recipes[0], 0), "p", "abl-20261126-000000-abcd", None, None)
    assert job.job_id == "4242"
    script = fake_slurm.read_text()
    for line in ["--partition=gpu", "--time=30", "--account=proj", "--mem=64GB", "--cpus-per-task=4"]:
        assert f"#SBATCH {line}\n" in script, line
    assert "#SBATCH --gpus-per-node=1\n" in script  # device=auto: the run's one GPU
    assert "#SBATCH --signal=USR2@90\n" in script and "source venv/bin/activate\n" in script
    assert "#SBATCH --job-name=lowprec-abl-20261126-000000-abcd-fp32-s0\n" in script

    # the job ended without a result: its run, left RUNNING, is ended FAILED with SLURM's state
    tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent = tracker.start_run("ablation", {})
    child = tracker.start_run("fp32/seed0", {"recipe": "fp32", "seed": "0"}, parent)
    monkeypatch.setattr(submitit.core.core.Job, "_results_timeout_s", 0)  # no result pickle will come
    o = submitit_jobs.outcome_of(plan, job, "fp32", 0, tracker, parent)
    assert (o.run_id, o.status) == (child, "FAILED")
    assert o.reason.startswith("SLURM job 4242 ended OUT_OF_MEMORY without a result; log: "), o.reason
    run = tracker.client.get_run(child)
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == o.reason
    assert run.data.tags["failure_kind"] == "crash" and run.data.tags["job_state"] == "OUT_OF_MEMORY"


def test_a_dry_run_says_the_torchrun_inside_each_job(run_dirs, capsys):
    args = ["launcher=submitit_local", "parallel.dp_shard=2", "train.batch_size=2", "dry_run=true"]
    assert main([*ABLATE, *run_dirs, *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (
        "launcher=submitit_local: 3 job(s), one per run, 1 at a time; each asks 0 GPU(s), 60 min; "
        "each runs torchrun with 2 ranks (fsdp2)"
    ), out


def test_local_jobs_of_a_parallel_layout_share_the_gpus_of_a_node(run_dirs):
    """On CUDA (a dry run's ``gpus=4``, no device queried) submitit's local jobs of 2 ranks each run 2 at a time;
    ``launcher=local`` runs a parallel layout under one torchrun, one run at a time."""
    args = [*ABLATE[1:4], *run_dirs, "gpus=4", "dry_run=true", "parallel.dp_shard=2", "train.batch_size=2"]
    jobs = preflight(compose("ablate", [*args, "launcher=submitit_local"]))
    assert jobs.workers == 2 and [s.gpus for s in jobs.placement.slots] == [(0, 1), (2, 3)]
    assert preflight(compose("ablate", args)).workers == 1


def test_a_jobs_arguments_load_through_the_allow_list_and_an_altered_file_is_refused(run_dirs, tmp_path):
    """The ranks of a parallel job read the arguments its job wrote (``job_ranks.write_args``) through an
    allow-list: the real plan of a seeds=auto ablation loads back equal; a file altered to call ``os.system`` is
    refused before anything runs."""
    import pickle

    from lowprec_lab.runner.job_ranks import ARGS, load_args, write_args

    plan = preflight(compose("ablate", ["experiment=smoke", "seeds=auto", "max_seeds=4", *run_dirs]))
    write_args(tmp_path / "job", plan=plan, recipe=plan.recipes[1], seed=3, parent_id="p", threads=2)
    back = load_args(tmp_path / "job")
    assert back["plan"] == plan and back["recipe"] == plan.recipes[1] and back["seed"] == 3

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    (tmp_path / "job" / ARGS).write_bytes(pickle.dumps({"plan": Evil()}))
    with pytest.raises(pickle.UnpicklingError, match=r"refers to posix\.system"):
        load_args(tmp_path / "job")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "state, status, kind",
    [
        ("TIMEOUT", "KILLED", None),  # past launcher.time: stopped from outside, resume= continues it
        ("CANCELLED by 1000", "KILLED", None),
        ("PREEMPTED", "KILLED", None),
        ("OUT_OF_MEMORY", "FAILED", "crash"),  # the run itself failed
        ("NODE_FAIL", "FAILED", "crash"),
    ],
)
def test_each_slurm_end_state_without_a_result_ends_its_run_as_documented(
    state, status, kind, fake_slurm, run_dirs, tmp_path, monkeypatch
):
    """A job that ends without a result: a stop from outside (TIMEOUT, CANCELLED, PREEMPTED) leaves its run KILLED,
    which ``resume=`` continues; the run's own failure (OUT_OF_MEMORY, NODE_FAIL) ends it FAILED. Each state as
    sacct prints it."""
    from lowprec_lab.runner import submitit_jobs
    from lowprec_lab.tracking.tracker import make_tracker

    # a job id of its own per state: submitit's watcher of sacct remembers a job's state by its id in the process
    job_id = 5000 + sum(map(ord, state))
    fakebin = fake_slurm.parent / "fakebin"
    (fakebin / "sbatch").write_text(f'#!/bin/bash\ncp "$1" {fake_slurm}\necho "Submitted batch job {job_id}"\n')
    (fakebin / "sacct").write_text(f'#!/bin/bash\nprintf "JobID|State|NodeList\\n{job_id}|{state}|node7\\n"\n')
    plan = preflight(compose("ablate", [*ABLATE[1:4], *run_dirs, "launcher=slurm", "launcher.time=30"]))
    ex = submitit_jobs.make_executor(plan, tmp_path / "jobs")
    job = submitit_jobs._submit(ex, plan, Slot(0), (plan.recipes[0], 0), "p", "abl-20261126-000000-abcd", None, None)
    tracker = make_tracker(plan.tracking.uri, plan.tracking.experiment, plan.paths.runs)
    parent = tracker.start_run("ablation", {})
    child = tracker.start_run("fp32/seed0", {"recipe": "fp32", "seed": "0"}, parent)
    o = submitit_jobs.outcome_of(plan, job, "fp32", 0, tracker, parent)
    assert (o.run_id, o.status) == (child, status), o
    run = tracker.client.get_run(child)
    assert run.info.status == status and run.data.tags["job_state"] == state
    assert run.data.tags.get("failure_kind") == kind
