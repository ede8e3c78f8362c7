"""The fault campaign's short form (``benchmarks/faults.py --quick --kinds savekill disk``), as real ``lowprec train``
processes: a SIGKILL at a named point of a checkpoint save (``save.prune``: the checkpoint is committed, the old one
not yet deleted), and, where this machine can mount a tmpfs, a checkpoint disk that fills while a shard is written;
each is resumed and compared with an uninterrupted run. The campaign's exit code carries its targets: no metric lost
beyond the steps a resume trains again, no run left RUNNING, every continuation bit-identical."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mount_refused() -> str | None:
    spec = importlib.util.spec_from_file_location("fault_disks", ROOT / "benchmarks" / "fault_disks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.mount_refused()


# a long check: each of its faults has its own suite test under tests/faults
@pytest.mark.slow
def test_the_short_fault_campaign_meets_its_targets(tmp_path):
    out = tmp_path / "cases.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--quick", "--kinds", "savekill", "disk"]
    cmd += ["--workdir", str(tmp_path / "campaign"), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "| # | kind | fault |" in p.stdout and ": MET" in p.stdout
    cases = json.loads(out.read_text())
    kill = [c for c in cases if c["kind"] == "save kill"]
    # before the fix, the metrics flushed after the save: a kill between its commit and the flush lost steps 3-5
    assert len(kill) == 1 and kill[0]["label"].endswith("SIGKILL at save.prune")
    assert kill[0]["metrics_lost"] == 0 and kill[0]["steps_lost"] == 0 and kill[0]["bit_identical"] is True
    disk = [c for c in cases if c["kind"] == "disk"]
    if _mount_refused() is None:  # else the campaign printed why it skipped its disk cases
        assert len(disk) == 1 and disk[0]["detected"] and disk[0]["recovered"]
        assert disk[0]["steps_lost"] == 3 and disk[0]["metrics_lost"] == 0 and disk[0]["left_running"] == 0
    for c in cases:
        assert c["left_running"] == 0 and c["bit_identical"] is True
