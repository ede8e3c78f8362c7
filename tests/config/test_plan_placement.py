"""The Plan of node's features: placement, the dry run's keys and each recipe's ``train.compile/ac=auto``, built by
preflight (the door) and picklable for the workers."""

import pickle

from lowprec_lab.cli import compose
from lowprec_lab.plan.preflight import preflight


def test_plan_carries_placement_dry_run_keys_and_each_recipes_resolved_train(tmp_path):
    cfg = compose(
        "ablate",
        [
            "experiment=smoke",
            "device=cpu",
            "workers=2",
            "recipes=[fp32,fp8_rowwise]",
            "dry_run=true",
            "hardware=h100_sxm",
            f"paths.runs={tmp_path / 'runs'}",
            f"paths.reports={tmp_path / 'reports'}",
        ],
    )
    plan = preflight(cfg)
    assert plan.placement.workers == plan.workers == 2 and plan.placement.device_type == "cpu"
    assert plan.dry_run and plan.hardware == "h100_sxm" and plan.gpus is None
    for r in plan.recipes:  # auto on a CPU: eager, no activation checkpointing, tagged as resolved
        assert (plan.train_for(r).compile, plan.train_for(r).ac) == (False, "none")
        assert plan.train_tags(r) == {"train_auto": "compile=auto->False, ac=auto->none"}
        assert plan.params(r)["train.compile"] == "False" and plan.params(r)["train.ac"] == "none"
    again = pickle.loads(pickle.dumps(plan))  # what each slot's worker receives
    assert again.placement == plan.placement and again.trains == plan.trains
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # the door writes no MLflow store
