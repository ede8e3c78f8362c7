"""The cluster fixture's refusals (tests/slurm/slurm_cluster.py): each says why the SLURM tests are skipped, in one
line, and leaves no daemon behind. No cluster is started here."""

from __future__ import annotations

import pytest
import slurm_cluster
from slurm_cluster import Cluster, Unavailable


def test_not_root_is_said(monkeypatch, tmp_path):
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(Unavailable, match=r"^a SLURM cluster for the tests needs root \(its daemons run as root\)$"):
        slurm_cluster.start(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_a_daemon_that_exits_is_named_with_its_log(tmp_path):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "munged.log").write_text("munged: Error: Keyfile is insecure\n")
    c = Cluster(tmp_path, tmp_path / "slurm.conf", "cpu", "n1", 1)
    c._daemon("munged", ["false"])
    with pytest.raises(Unavailable) as e:
        c._wait("munged", "its socket", lambda: False, timeout_s=30)
    assert str(e.value) == (
        "munged did not start (its socket: munged exited 1); its log ends: munged: Error: Keyfile is insecure"
    )
    c.stop()
    assert c.procs == {}


def test_a_daemon_that_does_not_answer_in_time_is_stopped(tmp_path):
    (tmp_path / "log").mkdir()
    c = Cluster(tmp_path, tmp_path / "slurm.conf", "cpu", "n1", 1)
    c._daemon("slurmd", ["sleep", "60"])
    with pytest.raises(Unavailable, match=r"^slurmd did not start \(node idle: not within 1 s\); its log ends: \(no "):
        c._wait("slurmd", "node idle", lambda: False, timeout_s=1)
    p = c.procs["slurmd"]
    c.stop()
    assert p.poll() is not None
