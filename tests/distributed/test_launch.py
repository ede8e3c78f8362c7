"""`lowprec train/ablate parallel.dp_shard=2` re-runs itself under torchrun: rank 0 alone logs to a real MLflow
store, with metrics reduced across ranks, the layout, communication bytes and the effective wire dtypes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

QUICK = [
    "model=debug",
    "train.steps=4",
    "train.batch_size=4",
    "train.seq_len=64",
    "train.val_every=0",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=1",
    "train.telemetry_every=2",
    "train.progress=false",
]


def _lowprec(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "lowprec_lab", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_train_with_dp_shard_runs_under_torchrun_and_rank0_logs(tmp_path, token_data):
    dirs = [f"paths.runs={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"]
    p = _lowprec(["train", "recipe=fp8_comm8", "parallel.dp_shard=2", *QUICK, *dirs], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "launching torchrun with 2 ranks" in p.stdout
    assert p.stdout.count("FINISHED run") == 1  # rank 1 prints and logs nothing
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["parallel"] == "fsdp2" and run.data.tags["world_size"] == "2"
    eff = json.loads(run.data.tags["effective_recipe"])
    assert eff["comm"] == {"weight_all_gather": "fp8", "grad_reduce": "fp8"}
    m = run.data.metrics
    assert m["comm_all_gather_fp8_bytes"] > 0 and m["comm_reduce_scatter_fp8_bytes"] > 0
    assert m["pred_mem_params_bytes"] == m["mem_params_bytes"]  # rank 0's shard, predicted exactly
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 4


def test_bad_layout_is_one_line_before_launch(run_dirs, capsys):
    """Refused in the process that would launch torchrun, before it does (in-process: the refusal needs no
    interpreter of its own; the real command line and torchrun run in the test above)."""
    from lowprec_lab.cli import main

    assert main(["train", *run_dirs, "recipe=fp32", "parallel.dp_shard=3", *QUICK]) == 2
    out, err = capsys.readouterr()
    assert "launching torchrun" not in out
    err = err.strip().splitlines()
    assert len(err) == 1 and "train.batch_size=4 is not divisible by the data-parallel degree 3" in err[0], err
