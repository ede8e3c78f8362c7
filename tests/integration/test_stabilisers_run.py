"""``lowprec train model=debug model.qk_norm=true train.z_loss=1e-4``: both stabilisers reach the trained model
and the loss through the real CLI, and the run's MLflow record holds them as params and ``z_loss`` as a metric beside
the plain cross-entropy ``loss``."""

import torch
from mlflow.tracking import MlflowClient

from lowprec.model import model_args
from lowprec.train.build import build_model_meta, materialize
from lowprec.train.checkpoint import load_model_weights
from lowprec_lab.cli import main

QUICK = [
    "model=debug",
    "recipe=fp32",
    "train.steps=2",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=0",
    "train.val_batches=1",
    "train.warmup_steps=1",
    "train.timing_warmup_steps=0",
    "train.checkpoint_every=2",
]


def test_train_records_qk_norm_and_z_loss(run_dirs, tmp_path):
    assert main(["train", "model.qk_norm=true", "train.z_loss=1e-4", *QUICK, *run_dirs]) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    p = run.data.params
    assert (p["model.qk_norm"], p["train.z_loss"]) == ("True", "0.0001")
    assert run.info.status == "FINISHED"
    z = client.get_metric_history(run.info.run_id, "z_loss")
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert len(z) == len(loss) == 2 and all(0 < m.value < 1 for m in z)
    # the trained model had the norms: the final checkpoint holds their trained weights
    (ckpt,) = (tmp_path / "runs").rglob("step_2")
    model = build_model_meta(model_args("debug", qk_norm=True))
    materialize(model, torch.device("cpu"), seed=1)
    load_model_weights(ckpt, model)
    w = model.layers["0"].attention.q_norm.weight
    assert w.shape == (model.args.head_dim,) and not torch.equal(w, torch.ones_like(w))
