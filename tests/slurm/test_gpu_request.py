"""``launcher=slurm`` asks each job for the GPUs of its run's layout unless ``device=cpu``; a partition whose
nodes have fewer is refused in one line before any job is submitted (sbatch would refuse every job with ``Invalid
generic resource (gres) specification``). ``sinfo``'s answers as SLURM prints them; no cluster needed here
(test_cluster.py shows the refusal against a real one)."""

from __future__ import annotations

import subprocess

import pytest

from lowprec.errors import ConfigError
from lowprec_lab.plan.launcher import LauncherSpec
from lowprec_lab.plan.preflight import check_slurm_gpus, slurm_partition_gpus


def sinfo(stdout: str = "", rc: int = 0, stderr: str = ""):
    """A ``run`` that answers as sinfo would, and records what it was asked."""
    asked = []

    def run(cmd, **kwargs):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, stdout, stderr)

    run.asked = asked
    return run


@pytest.mark.parametrize(
    "gres, gpus",
    [("(null)", 0), ("gpu:8", 8), ("gpu:a100:4(S:0-1),shard:8", 4), ("gpu:h100:2(S:0,1),gpu:a10:1", 3), ("gpu", 1)],
)
def test_the_gpus_of_a_node_as_sinfo_says_them(gres, gpus):
    assert slurm_partition_gpus(gres) == gpus


def test_a_partition_without_gpus_is_refused_unless_device_cpu():
    run = sinfo("cpu*|(null)\n")
    spec = LauncherSpec(name="slurm", partition="cpu")
    with pytest.raises(ConfigError) as e:
        check_slurm_gpus(spec, "auto", 1, run=run)
    assert str(e.value) == (
        "launcher=slurm with device=auto: each job asks for 1 GPU(s), but the nodes of partition cpu have none "
        "(sinfo gres: (null)); train on their CPUs with device=cpu, or name a partition with GPUs "
        "(launcher.partition=)"
    )
    assert run.asked == [["sinfo", "--noheader", "--format=%P|%G", "--partition", "cpu"]]
    check_slurm_gpus(spec, "cpu", 1, run=sinfo("cpu*|(null)\n", rc=1))  # device=cpu asks for no GPU: no query
    check_slurm_gpus(LauncherSpec(name="submitit_local"), "auto", 1, run=sinfo(rc=1))  # not SLURM: no query


def test_the_default_partition_and_the_layout_are_checked():
    rows = "debug|(null)\ngpu*|gpu:a100:4(S:0-1)\n"
    check_slurm_gpus(LauncherSpec(name="slurm"), "auto", 4, run=sinfo(rows))  # 4 ranks on a node of 4
    with pytest.raises(ConfigError, match="each job asks for 8 GPU.s., but the nodes of partition gpu have 4 "):
        check_slurm_gpus(LauncherSpec(name="slurm"), "cuda", 8, run=sinfo(rows))
    with pytest.raises(ConfigError, match="partition debug have none"):
        check_slurm_gpus(LauncherSpec(name="slurm", partition="debug"), "auto", 1, run=sinfo("debug|(null)\n"))


def test_sinfo_failing_or_silent_is_refused_in_one_line():
    spec = LauncherSpec(name="slurm", partition="gpu")
    with pytest.raises(ConfigError, match="sinfo, asked for the partition's GPUs, failed: sinfo: error: boom$"):
        check_slurm_gpus(spec, "auto", 1, run=sinfo(rc=1, stderr="sinfo: error: boom\nmore\n"))
    with pytest.raises(ConfigError, match="sinfo lists no partition gpu; name one with launcher.partition="):
        check_slurm_gpus(spec, "auto", 1, run=sinfo(""))

    def missing(cmd, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "sinfo")

    with pytest.raises(ConfigError, match="sinfo, asked for the partition's GPUs, did not answer"):
        check_slurm_gpus(spec, "auto", 1, run=missing)
