"""The ``slurm_cluster`` fixture: one real single-node SLURM cluster with accounting per pytest process
(tests/slurm/slurm_cluster.py), started on first use and stopped at the end of the session; its tests are skipped
with the reason when it cannot run here (not root, no apt-get, a daemon that does not start)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from slurm_cluster import Cluster, Unavailable, start


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Cluster:
    """A running cluster, its ``SLURM_CONF`` exported to this process (so submitit's sbatch, sacct and scancel,
    and the jobs it submits, use it) for the session. Stopped after: its jobs cancelled, its daemons ended."""
    t0 = time.monotonic()
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except Unavailable as e:
        pytest.skip(f"no SLURM cluster here: {e}")
    cluster.setup_s = time.monotonic() - t0
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root / "db", ignore_errors=True)  # MariaDB's 100 MB, in each kept pytest folder
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
