"""A run's owner is a process of one PID namespace on one boot: the orphan sweep
(lowprec_lab/runner/orphans.py) and ``resume=`` of a run's checkpoint (lowprec_lab/runner/continued_runs.py
``supersede``) end a
RUNNING run only when its owner is provably dead; a run owned from another container that shares the hostname, or
still training, stays RUNNING. Real MLflow sqlite stores; the owner tags are written as another process would."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec_lab.runner import orphans
from lowprec_lab.runner.continued_runs import supersede
from lowprec_lab.runner.orphans import OWNER_TAG, _start_ticks, close_orphans, owner
from lowprec_lab.tracking.tracker import Tracker

# the tag names are spelled out (not imported) so that these tests fail by assertion, not by import, on code
# without them
PIDNS, BOOT, CHECK = "lowprec.owner_pidns", "lowprec.owner_boot", "lowprec.orphan_check"
OTHER_NS = "pid:[4026599999]"  # another container's PID namespace: an inode no namespace here has


def _boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _btime() -> float:
    return next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime "))


@pytest.fixture
def tracker(tmp_path):
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lowprec", tmp_path)


@pytest.fixture(scope="module")
def gone() -> str:
    """``owner()`` of a process that has exited: in this namespace it is provably dead; in another container
    the same pid and start time may well be a live process."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tag = f"{socket.gethostname()}:{p.pid}:{_start_ticks(p.pid)}"
    finally:
        p.kill()
        p.wait()
    assert _start_ticks(p.pid) != tag.rsplit(":", 1)[1]
    return tag


def _run(tracker, tags, start_time=None) -> str:
    return tracker.client.create_run(tracker.experiment_id, start_time=start_time, tags=tags).info.run_id


def _status(tracker, run_id) -> str:
    return tracker.client.get_run(run_id).info.status


def test_a_sweep_leaves_a_run_of_another_pid_namespace_running_and_says_why(tracker, gone):
    # the same hostname and boot (host networking), another container: its pid is not one of ours
    foreign = _run(tracker, {OWNER_TAG: gone, PIDNS: OTHER_NS, BOOT: _boot()})
    dead = _run(tracker, {OWNER_TAG: gone, PIDNS: os.readlink("/proc/self/ns/pid"), BOOT: _boot()})
    old_style = _run(tracker, {OWNER_TAG: gone})  # a run from before the namespace tags: the older rule

    assert sorted(close_orphans(tracker)) == sorted([dead, old_style])
    assert _status(tracker, foreign) == "RUNNING"
    assert _status(tracker, dead) == "FAILED" and _status(tracker, old_style) == "FAILED"
    note = tracker.client.get_run(foreign).data.tags[CHECK]
    assert note.startswith("left RUNNING: its process runs in another PID namespace (pid:[4026599999])")
    lines: list[str] = []
    assert close_orphans(tracker, lines.append) == []
    assert lines == [f"run {foreign} ({gone}) {note}"] and _status(tracker, foreign) == "RUNNING"


def test_a_sweep_ends_a_run_of_an_earlier_boot_and_leaves_one_of_a_namesake_machine(tracker, gone):
    before_boot = int((_btime() - 3600) * 1000)
    rebooted = _run(tracker, {OWNER_TAG: gone, PIDNS: OTHER_NS, BOOT: "0-earlier-boot"}, start_time=before_boot)
    namesake = _run(tracker, {OWNER_TAG: gone, PIDNS: OTHER_NS, BOOT: "0-another-machine"})  # started after our boot

    assert close_orphans(tracker) == [rebooted]
    reason = tracker.client.get_run(rebooted).data.tags["failure_reason"]
    died = "died in a reboot of its host during the run (found by a later lowprec command)"
    assert reason == f"its process ({gone}) {died}"
    assert _status(tracker, namesake) == "RUNNING"
    assert "owned by boot 0-another-machine" in tracker.client.get_run(namesake).data.tags[CHECK]


def _checkpoint(tmp_path, run_id) -> Path:
    folder = tmp_path / "checkpoints" / run_id / "step_4"
    folder.mkdir(parents=True)
    return folder.parent


@pytest.mark.parametrize("ns", ["here", "another container"])
def test_resume_from_a_live_runs_checkpoint_forks_it_and_leaves_it_running(tracker, tmp_path, gone, ns, capsys):
    if ns == "here":  # owned by this (live) test process
        tags = {OWNER_TAG: owner(), PIDNS: os.readlink("/proc/self/ns/pid"), BOOT: _boot()}
    else:  # a pid that is not ours, in another PID namespace: it cannot be told dead from here
        tags = {OWNER_TAG: gone, PIDNS: OTHER_NS, BOOT: _boot()}
    live = _run(tracker, tags)
    fork = _run(tracker, {})

    assert supersede(tracker, _checkpoint(tmp_path, live), fork) == live
    old, new = tracker.client.get_run(live), tracker.client.get_run(fork)
    assert old.info.status == "RUNNING" and old.info.end_time is None and "failure_reason" not in old.data.tags
    assert old.data.tags["forked_in_run"] == fork and "continued_in_run" not in old.data.tags
    assert new.data.tags["resumed_run_id"] == live and new.data.tags["resumed_while_running"]
    assert f"run {live} is still RUNNING (" in capsys.readouterr().out


def test_resume_of_a_dead_runs_checkpoint_still_ends_it(tracker, tmp_path, gone):
    dead = _run(tracker, {OWNER_TAG: gone, PIDNS: os.readlink("/proc/self/ns/pid"), BOOT: _boot()})
    new = _run(tracker, {})
    assert supersede(tracker, _checkpoint(tmp_path, dead), new) == dead
    old = tracker.client.get_run(dead)
    assert old.info.status == "FAILED" and old.data.tags["continued_in_run"] == new
    assert old.data.tags["failure_reason"] == f"its process died after step 3; continued in run {new}"


def test_owner_tags_name_this_process_namespace_and_boot():
    tags = orphans.owner_tags()
    assert tags == {OWNER_TAG: owner(), PIDNS: os.readlink("/proc/self/ns/pid"), BOOT: _boot()}
    assert orphans.owner_state(tags, None) == (True, "")


_IN_NAMESPACE = """
import json, socket
from lowprec_lab.runner import orphans
tags = orphans.owner_tags()
print(json.dumps({
    "ours": orphans.procfs_is_ours(),
    "owner": orphans.owner(),
    # pid 1 of this namespace is this process; in the host's /proc it is the host's init, with other start ticks
    "pid1": orphans.owner_alive(f"{socket.gethostname()}:1:12345"),
    "state": orphans.owner_state({**tags, orphans.OWNER_TAG: f"{socket.gethostname()}:1:12345"}, None),
}))
"""


def test_a_pid_namespace_without_its_own_proc_is_detected_and_no_pid_is_trusted():
    # unshare -p -f without --mount-proc: os.getpid() is this namespace's pid, /proc still the host's
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    cmd = ["unshare", "--user", "--map-root-user", "--pid", "--fork", sys.executable, "-c", _IN_NAMESPACE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    if proc.returncode and "unshare failed" in proc.stderr:
        pytest.skip(f"user and PID namespaces are not allowed here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["ours"] is False and orphans.procfs_is_ours() is True  # told apart from this test's own process
    assert seen["owner"].endswith(":1:")  # no start time recorded: the one it would read is another process's
    assert seen["pid1"] is None  # neither alive nor dead: it cannot be seen from there
    state, why = seen["state"]
    assert state is None and "/proc belongs to another PID namespace" in why
