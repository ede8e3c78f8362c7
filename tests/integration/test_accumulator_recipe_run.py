"""``lowprec train`` with the emulated accumulator's model set from the command line: the run
trains with it and its MLflow record (params, short name, hash) says so."""

from mlflow.tracking import MlflowClient

from lowprec.recipes import CATALOG
from lowprec_lab.cli import main

QUICK = [
    "model=debug",
    "train.steps=1",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=0",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=0",
]


def test_train_records_the_accumulator_overrides(run_dirs, tmp_path):
    acc = [
        "recipe.fp8.gemm.accum_mantissa_bits=13",
        "recipe.fp8.gemm.accum_rounding=truncate",
        "recipe.fp8.gemm.accum_group=32",
    ]
    assert main(["train", "recipe=deepseek_v3_no_promotion", *acc, *QUICK, *run_dirs]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    p, tags = run.data.params, run.data.tags
    assert (
        p["recipe.fp8.gemm.accum_mantissa_bits"],
        p["recipe.fp8.gemm.accum_rounding"],
        p["recipe.fp8.gemm.accum_group"],
    ) == (
        "13",
        "truncate",
        "32",
    )
    assert "/acc13-truncate-g32-nopromo/" in tags["recipe_short"]
    # these overrides are the catalog's Hopper-fitted recipe, under another name
    assert tags["recipe_hash"] == CATALOG["deepseek_v3_no_promotion_hopper"].hash()
    assert tags["effective_matches"] == "true" and run.info.status == "FINISHED"
