"""``workers=2`` (runs in spawned worker processes) and ``seeds=auto`` end to end: real training, real MLflow."""

import contextlib
import json
import re
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main

QUICK = [
    "model=debug",
    "model.qk_norm=false",
    "train.steps=4",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=2",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=1",
    "train.telemetry_every=0",
]


def _children(tmp_path, out):
    abl = re.search(r"ablation (abl-[\w-]+) done", out).group(1)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (parent,) = client.search_runs(
        [exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}' and tags.`lowprec.kind` = 'ablation'"
    )
    kids = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, kids


def _finals(kids):
    return {(k.data.tags["recipe"], int(k.data.tags["seed"])): k.data.metrics["final_val_loss"] for k in kids}


def test_two_workers_with_seeds_auto_add_seeds_only_while_open_and_train_each_run_as_one_process_does(
    run_dirs, tmp_path, capsys
):
    # One 2-worker ablation serves both claims (each such ablation costs ~12 s of the suite's two cores): seeds=auto
    # with a margin far below the fp32-vs-bf16 difference leaves the verdict open at every look, up to max_seeds;
    # then one process trains seeds 0 and 1 of both recipes again and must get the same numbers.
    args = ["ablate", "controls=false", "recipes=[fp32,bf16]", "report.margin=1e-9"] + run_dirs + QUICK
    assert main(args + ["seeds=auto", "max_seeds=4", "workers=2"]) == 0
    out = capsys.readouterr().out
    assert "seeds=auto: seed 3 for fp32 (still inconclusive)" in out
    parent, kids = _children(tmp_path, out)
    assert sorted((k.data.tags["recipe"], int(k.data.tags["seed"])) for k in kids) == sorted(
        (r, s) for r in ("fp32", "bf16") for s in range(4)
    )
    assert parent.data.tags["seeds"] == "auto" and parent.data.tags["max_seeds"] == "4"
    # the report replays the looks from MLflow alone: the recipe's verdict is that of its last look
    report = (tmp_path / "reports" / parent.data.tags["lowprec.ablation_id"] / "report.md").read_text()
    assert "| `fp32` | 4 (auto: max_seeds reached) |" in report
    assert (
        "`seeds=auto` (lowprec_lab/stats/auto_seeds.py)" in report
        and "3 seeds at " in report
        and "4 seeds at " in report
    )
    assert parent.data.tags["verdict.fp32"] == "inconclusive"
    # the two workers: recorded, said in the report, every run finished with its stability metrics
    assert parent.data.tags["workers"] == "2"
    assert "2 runs trained at a time (`workers`)" in report
    assert sorted(k.info.status for k in kids) == ["FINISHED"] * 8
    assert all("stability/loss_spikes" in k.data.metrics for k in kids)
    # one process, and per-recipe seeds: fp32 trains seed 0 alone, the control bf16 both seeds
    assert main(args + ["seeds={others:2,fp32:1}", "workers=1"]) == 0
    out = capsys.readouterr().out
    assert "2 recipes x 2 seeds of bf16; 1 of fp32 on model=debug" in out
    again, sequential = _children(tmp_path, out)
    assert json.loads(again.data.tags["recipe_seeds"]) == {"fp32": 1, "bf16": 2}
    assert json.loads(again.data.tags["seeds"]) == [0, 1]
    # one intra-op thread in every process (2 cores / 2 workers; the test process has one): the same numbers
    one_process = _finals(sequential)
    assert sorted(one_process) == [("bf16", 0), ("bf16", 1), ("fp32", 0)]
    assert one_process == {k: v for k, v in _finals(kids).items() if k in one_process}
    abl = again.data.tags["lowprec.ablation_id"]
    report = (tmp_path / "reports" / abl / "report.md").read_text()
    assert "| `fp32` | 1 |" in report  # the one seed it shares with the control
    # a resume sees every run of each recipe's own seeds kept: nothing to train, nothing changed
    assert main(args + ["seeds={others:2,fp32:1}", "workers=1", f"resume={abl}"]) == 0
    assert f"resume={abl}: the ablation already finished (3 run(s), parent run FINISHED)" in capsys.readouterr().out


@pytest.mark.slow  # ~15 s; the same fault in one worker: test_node_runner.py's failing-GPU test (suite)
def test_a_worker_that_dies_fails_its_run_and_the_ablation_still_reports(run_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOWPREC_FAULTS", "recipe=bf16,exit_at_step=2")  # inherited by the worker processes
    args = ["ablate", "controls=false", "recipes=[fp32,bf16]", "seeds=1", "workers=2"]
    assert main(args + run_dirs + QUICK) == 0
    out = capsys.readouterr().out
    assert "bf16             seed 0: FAILED (worker process died:" in out
    parent, kids = _children(tmp_path, out)
    (dead,) = [k for k in kids if k.data.tags["recipe"] == "bf16"]
    assert dead.info.status == "FAILED" and dead.data.tags["failure_reason"] == "its worker process died during the run"
    # the control died, so the report exists and says that no verdict is possible
    report = (tmp_path / "reports" / parent.data.tags["lowprec.ablation_id"] / "report.md").read_text()
    assert "every run of the control `bf16` failed" in report


@contextlib.contextmanager
def busy_cores(n: int, seconds: float = 150.0):
    """``n`` processes that spin on a core each for the body (and never longer than ``seconds``)."""
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-S", "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow  # ~35 s of stress-ng load; the grace period itself: test_signals.py's stalled-exit test
def test_an_ablation_on_busy_cores_reaches_its_report_without_waiting_on_its_workers_exit(run_dirs, tmp_path, capsys):
    # With both cores busy, after the last run the ablation waited in ProcessPoolExecutor.shutdown()
    # for its two workers' exit (py-spy: each worker in its interpreter's final garbage collection, 4-6 s of CPU at a
    # load of 6), without limit. The workers now exit at once (lowprec_lab/runner/scheduler.py `_exit_now`).
    args = ["ablate", "controls=false", "recipes=[bf16,fp8_rowwise]", "seeds=2", "workers=2"] + run_dirs + QUICK
    with busy_cores(2):
        assert main(args) == 0
    out = capsys.readouterr().out
    parent, kids = _children(tmp_path, out)
    assert sorted(k.info.status for k in kids) == ["FINISHED"] * 4
    assert (tmp_path / "reports" / parent.data.tags["lowprec.ablation_id"] / "report.md").exists()
    # the parent ends right after run_jobs returns: from the last run's end, one result's way back and the workers'
    # exit (the old exit alone took 3-6 s here)
    waited_ms = parent.info.end_time - max(k.info.end_time for k in kids)
    assert waited_ms < 2500, waited_ms
