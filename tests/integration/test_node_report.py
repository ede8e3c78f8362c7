"""The report of an ablation placed one run per GPU: runs alone on their GPUs are not contended, and a
recipe that ``train.compile=auto`` ran eager is said not comparable. A fabricated ablation, a real MLflow store."""

from fabricated_ablation import fabricate_ablation
from store_dirs import sqlite_uri

from lowprec_lab.plan.placement import plan_placement
from lowprec_lab.report.build import build_report
from lowprec_lab.tracking.tracker import PARENT_TAG, Tracker

ABL = "abl-node"
RUNS = {"bf16": {0: 4.00, 1: 4.05}, "fp8_rowwise": {0: 4.001, 1: 4.049}, "fp8_blockwise": {0: 4.002, 1: 4.051}}


def test_runs_alone_on_their_gpus_are_not_contended_and_an_eager_fallback_is_not_comparable(tmp_path):
    tracker = Tracker(sqlite_uri(tmp_path / "mlflow.db"), "lowprec", tmp_path)
    parent = fabricate_ablation(tracker, ABL, RUNS)
    p = plan_placement(8, 1, "auto", "cuda")
    tracker.set_tags(parent, {"workers": "8", "placement": p.to_json(), "runs_per_device": "1"})
    for c in tracker.client.search_runs([tracker.experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'"):
        tags = {"train_auto": "compile=auto->True, ac=auto->selective"}
        if c.data.tags["recipe"] == "fp8_blockwise":
            tags = {"train_auto": "compile=auto->False, ac=auto->selective", "compile_fallback": "no inductor"}
        tracker.set_tags(c.info.run_id, tags)
    text = build_report(tracker, ABL, tmp_path / "reports").read_text()
    assert "contended" not in text  # 8 runs at a time, each on its own GPU: each tokens/s is its device's own
    assert "8 runs trained at a time, each alone on its own GPU(s)" in text
    assert "`bf16` compile=auto-\\>True, ac=auto-\\>selective" in text  # the tag is store text: escaped
    assert "**throughput not comparable**: `fp8_blockwise` ran eager" in text
