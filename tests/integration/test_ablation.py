"""The smoke ablation end to end: CLI -> Hydra -> training -> MLflow -> report, and failure isolation."""

import json
import re
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import compose, main
from lowprec_lab.report.build import report_figures
from lowprec_lab.tracking.tracker import ABLATION_TAG

SMOKE = list(compose("ablate", ["experiment=smoke"]).recipes)


def _ablation_id(out):
    return re.search(r"ablation (abl-[\w-]+) done", out).group(1)


#: every recipe of the smoke experiment on its model and batch, for half its steps: what is asserted needs one
#: validation, one telemetry sample and a few points per curve, not 12 steps of training
HALF = ["train.steps=6", "train.val_every=3", "train.telemetry_every=3"]


def test_smoke_ablation_tracks_every_recipe_and_writes_the_report(run_dirs, tmp_path, capsys):
    assert main(["ablate", "experiment=smoke", *HALF] + run_dirs) == 0
    out = capsys.readouterr().out
    abl = _ablation_id(out)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (parent,) = client.search_runs(
        [exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}' and tags.`lowprec.kind` = 'ablation'"
    )
    children = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["recipe"] for c in children) == sorted(SMOKE)
    assert all(c.info.status == "FINISHED" for c in children)
    report = tmp_path / "reports" / abl / "report.md"
    text = report.read_text()
    for name in SMOKE:
        assert f"| `{name}` |" in text
    for png in ("loss", "loss_gap", "memory", "throughput", "grad_norm", "telemetry_fp8_blockwise"):
        assert (report.parent / f"{png}.png").stat().st_size > 5000
    assert "## FP8 numerics telemetry" in text
    blockwise = next(c for c in children if c.data.tags["recipe"] == "fp8_blockwise")
    sqnr = [k for k in blockwise.data.metrics if k.startswith("fp8/layers.0.") and k.endswith("/output/sqnr_db")]
    assert sqnr and all(blockwise.data.metrics[k] > 15 for k in sqnr)
    assert "say nothing about FP8 or BF16 speed on a GPU" in text
    # the verdict table leads the report; one seed per recipe gives no interval, and the parent run records that
    assert text.splitlines()[2] == "## Verdicts" and "| `fp8_rowwise` | 1 | " in text and "no interval (1 seed)" in text
    assert parent.data.tags["verdict_control"] == "bf16"
    (found,) = client.search_runs([exp], filter_string="tags.`verdict.fp8_rowwise` = 'no-interval'")
    assert found.data.tags[ABLATION_TAG] == abl
    # the parent run holds the report, its figures and its config; each child its config and effective
    # recipe, under a name that reads in the UI; the parent's description sums the ablation up in one line
    logged = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.html", "config.yaml"} | {f.name for f in report_figures(report)} <= logged
    desc = parent.data.tags["mlflow.note.content"]
    assert desc.startswith("model debug, 6 steps of 4x128 tokens; recipes fp32, bf16,") and "control bf16" in desc
    for c in children:
        tags = c.data.tags
        assert c.info.run_name == f"{tags['recipe']}/seed{tags['seed']}"
        got = Path(client.download_artifacts(c.info.run_id, "", str(tmp_path / "artifacts" / c.info.run_id)))
        cfg = yaml.safe_load((got / "config.yaml").read_text())
        assert cfg["seed"] == int(tags["seed"]) and cfg["model"]["name"] == "debug" and cfg["train"]["steps"] == 6
        effective = json.loads((got / "effective_recipe.json").read_text())
        assert json.dumps(effective, sort_keys=True) == tags["effective_recipe"] and "param_dtype" in effective
    # the report is rebuilt from MLflow alone, identically
    first = text
    report.unlink()
    assert main(["report", abl] + run_dirs[:3]) == 0
    assert report.read_text() == first


def test_a_failing_recipe_is_recorded_and_the_ablation_goes_on(run_dirs, tmp_path, capsys, monkeypatch):
    args = [
        "ablate",
        "experiment=smoke",
        "recipes=[fp32,bf16,bf16_pure]",
        "train.steps=4",
        "train.val_every=2",
    ]
    monkeypatch.setenv("LOWPREC_FAULTS", "recipe=bf16,crash_at_step=2")
    assert main(args + run_dirs) == 0
    abl = _ablation_id(capsys.readouterr().out)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    runs = {
        r.data.tags["recipe"]: r
        for r in client.search_runs([exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}'")
        if r.data.tags.get("lowprec.kind") != "ablation"
    }
    assert runs["bf16"].info.status == "FAILED"
    assert runs["bf16"].data.tags["failure_reason"].startswith("InjectedCrash: injected crash before step 2")
    assert runs["fp32"].info.status == "FINISHED" and runs["bf16_pure"].info.status == "FINISHED"
    # the failed run keeps its configuration and its failure, with the traceback, as artifacts
    failed = {a.path for a in client.list_artifacts(runs["bf16"].info.run_id)}
    assert {"config.yaml", "failure_traceback.txt"} <= failed
    text = (tmp_path / "reports" / abl / "report.md").read_text()
    assert "## Failed or excluded runs" in text and "InjectedCrash" in text
    assert "**No verdict is possible:** every run of the control `bf16` failed" in text
    assert "| `fp32` | 0 | " in text and "| `bf16_pure` | 0 | " in text  # the finished runs' numbers stay
    # the control failed, so no gap can be computed: the table says n/a rather than inventing one
    assert re.search(r"\| `fp32` \|.*\| n/a% \|", text)
    assert "AdamW m error" in text
    assert main(["report", "abl-does-not-exist"] + run_dirs[:3]) == 2
