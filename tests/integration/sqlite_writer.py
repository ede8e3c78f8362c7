"""One writer of tests/integration/test_sqlite_concurrency.py: waits for the start signal (a file), then opens the
sqlite store through ``Tracker`` (as an ablation or one of its workers does) and logs ``runs`` runs of ``steps``
steps each: params, tags, an artifact, buffered metrics, the end status.

usage: python sqlite_writer.py DB_URI FOLDER NAME RUNS STEPS"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lowprec_lab.tracking.tracker import MetricBuffer, Tracker


def main(uri: str, folder: Path, name: str, runs: int, steps: int) -> None:
    (folder / f"{name}.ready").touch()
    while not (folder / "go").exists():
        time.sleep(0.005)
    t = Tracker(uri, "lowprec", folder)
    for i in range(runs):
        run_id = t.start_run(f"{name}/{i}", {"writer": name, "i": str(i)})
        t.log_params(run_id, {f"p{j}": j for j in range(20)})
        t.log_text(run_id, f"{name} {i}\n", "config.yaml")
        buf = MetricBuffer(t, run_id, every=5)
        for s in range(steps):
            buf.log_metrics({"loss": 10.0 - s / steps, "grad_norm": float(s), "lr": 1e-3}, s)
            if s % 10 == 0:
                t.set_tags(run_id, {"last_tagged_step": str(s)})
        buf.flush()
        t.end_run(run_id, "FINISHED")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
