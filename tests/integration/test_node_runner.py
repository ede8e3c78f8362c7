"""One run per GPU on a node, checked on a CPU: pinned workers (a faked GPU count), a worker that dies failing its
own run only, the dry run of experiment=node, and the one-line refusals (no MLflow run)."""

import os
import re
from concurrent.futures import wait

from mlflow.tracking import MlflowClient

import lowprec_lab.plan.preflight as preflight_mod
from lowprec_lab.cli import main
from lowprec_lab.plan.placement import plan_placement
from lowprec_lab.runner import scheduler

QUICK = [
    "model=debug",
    "model.qk_norm=false",
    "device=cpu",
    "train.steps=4",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=2",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=1",
    "train.telemetry_every=0",
]


def test_each_spawned_worker_sees_only_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the parent's own view: slots map through it
    placement = plan_placement(4, 2, "auto", "cuda")
    pools = [scheduler.start_slot_pool(s) for s in placement.slots]
    try:
        futures = [p.submit(scheduler.worker_visible_devices) for p in pools]
        wait(futures)
        assert [f.result() for f in futures] == ["4,5", "6,7"]
    finally:
        for p in pools:
            p.shutdown()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # the parent's environment is restored


def _parent_and_kids(tmp_path, out):
    abl = re.search(r"ablation (abl-[\w-]+) done", out).group(1)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (parent,) = client.search_runs(
        [exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}' and tags.`lowprec.kind` = 'ablation'"
    )
    kids = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, kids


def test_a_worker_whose_gpu_fails_fails_its_run_only(run_dirs, tmp_path, capsys, monkeypatch):
    # a node of 2 GPUs, faked: each worker pinned to one (CUDA_VISIBLE_DEVICES), the runs on the CPU
    monkeypatch.setattr(preflight_mod, "ablation_placement", lambda cfg: plan_placement(2, 1, "auto", "cuda"))
    # bf16 dies at its first step, while at least fp8_rowwise is still queued (4 runs, 2 workers)
    args = [
        "ablate",
        "controls=false",
        "recipes=[fp32,bf16,bf16_pure,fp8_rowwise]",
        "control=fp32",
        "seeds=1",
        "workers=auto",
    ]
    monkeypatch.setenv("LOWPREC_FAULTS", "recipe=bf16,exit_at_step=1")  # inherited by the worker processes
    assert main(args + run_dirs + QUICK) == 0
    out = capsys.readouterr().out
    parent, kids = _parent_and_kids(tmp_path, out)
    status = {k.data.tags["recipe"]: k.info.status for k in kids}
    # fp32 on GPU 0, bf16 on GPU 1 dies: GPU 1 is not used again, the queued runs train on GPU 0
    assert status == {"fp32": "FINISHED", "bf16": "FAILED", "bf16_pure": "FINISHED", "fp8_rowwise": "FINISHED"}
    assert {k.data.tags.get("gpus") for k in kids if k.info.status == "FINISHED"} == {"0"}
    assert parent.data.tags["runs_per_device"] == "1" and '"1": [1]' in parent.data.tags["placement"]
    fp32 = next(k for k in kids if k.data.tags["recipe"] == "fp32")
    assert fp32.data.params["train.compile"] == "False" and fp32.data.tags["train_auto"].startswith("compile=auto")
    report = (tmp_path / "reports" / parent.data.tags["lowprec.ablation_id"] / "report.md").read_text()
    assert "each alone on its own GPU(s)" in report and "contended" not in report


def test_node_dry_run_prints_the_plan_and_trains_nothing(run_dirs, tmp_path, capsys):
    assert main(["ablate", "experiment=node", "dry_run=true", "gpus=8", *run_dirs]) == 0
    out = capsys.readouterr().out
    assert "80 runs on model=llama3_1b" in out and "worker 7 -> GPU 7" in out  # 5 recipes x 16 seeds
    assert "lowprec data prepare" in out  # no corpus yet: what to prepare, and how many tokens a run needs
    assert re.search(r"predicted wall time: \d+\.\d min for 80 runs, 8 at a time", out)
    assert "compile=True, ac=selective (auto)" in out
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_one_line_refusals_without_an_mlflow_run(run_dirs, tmp_path, capsys):
    cases = {
        ("experiment=node", "dry_run=true", "gpus=0"): "gpus=0",
        ("experiment=node", "dry_run=true", "gpus=8", "workers=9"): "workers=9 exceeds 8",
        ("experiment=node", "dry_run=true", "gpus=2", "parallel.dp_shard=4"): "needs 4 GPUs per run but the node has 2",
        ("experiment=node",): "data.source=tokens needs data.path",
        ("experiment=gpu_quick", "dry_run=true", "train.steps=2000"): "data.allow_epochs=true",
    }
    for argv, words in cases.items():
        assert main(["ablate", *argv, *run_dirs]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], (argv, err)
    assert not (tmp_path / "runs" / "mlflow.db").exists()
    assert (
        main(
            ["ablate", "experiment=gpu_quick", "dry_run=true", "train.steps=2000", "data.allow_epochs=true"] + run_dirs
        )
        == 0
    )
    assert "epoch(s)" in capsys.readouterr().out
