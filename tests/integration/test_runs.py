"""Real training runs of the debug model, tracked in a real MLflow sqlite store in a temp dir."""

import json
import math

import pytest
import torch
from mlflow.tracking import MlflowClient
from store_dirs import dirs_under, store_uri

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec.train.build import build
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec
from lowprec_lab.cli import compose, main, train_main

QUICK = [
    "model=debug",
    "train.steps=6",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.val_every=3",
    "train.val_batches=1",
    "train.warmup_steps=2",
    "train.timing_warmup_steps=1",
]


class ListSink:
    def __init__(self):
        self.rows = []

    def log_metrics(self, m, step):
        self.rows.append((step, dict(m)))


def _losses(recipe, token_data, seed):
    spec = TrainSpec(
        steps=5, batch_size=2, seq_len=64, val_every=0, val_batches=1, timing_warmup_steps=1, progress=False
    )
    b = build(get_recipe(recipe), model_args("debug"), spec, OptimHParams(), seed, torch.device("cpu"))
    res = run_training(b, TokenBatches(token_data.train, token_data.val, 64, 2, seed), spec, ListSink())
    return [h["loss"] for h in res.history], res


def test_same_seed_gives_identical_losses(token_data):
    for recipe in ("fp32", "bf16_adamw8bit"):
        a, res = _losses(recipe, token_data, 0)
        b, _ = _losses(recipe, token_data, 0)
        assert a == b
        c, _ = _losses(recipe, token_data, 1)
        assert a != c
    assert res.summary["mean_tokens_per_s"] > 0 and res.summary["mem_peak_bytes"] > 0
    assert math.isfinite(res.summary["final_val_loss"])


def test_a_single_run_is_tracked_with_provenance(run_dirs, tmp_path, capsys):
    cfg = compose("train", run_dirs + QUICK + ["recipe=fp8_tensorwise"])
    o = train_main(cfg)
    assert o.status == "FINISHED"
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run = client.get_run(o.run_id)
    t = run.data.tags
    for key in (
        "recipe_hash",
        "recipe_short",
        "effective_recipe",
        "git_sha",
        "torch_version",
        "torchao_version",
        "bitsandbytes_version",
        "device",
        "corpus_fingerprint",
    ):
        assert t.get(key), key
    assert t["effective_matches"] == "true"
    assert json.loads(t["effective_recipe"])["fp8_linears"] == {"torchao.float8.float8_linear.Float8Linear": 14}
    assert run.data.params["recipe.fp8.backend"] == "torchao"
    assert "mfu" not in run.data.metrics  # no MFU on a CPU
    assert [m.step for m in client.get_metric_history(o.run_id, "loss")] == list(range(6))
    assert len(client.get_metric_history(o.run_id, "val_loss")) == 2
    for key in (
        "mem_params_bytes",
        "mem_grads_bytes",
        "mem_optim_states_bytes",
        "mem_peak_bytes",
        "tokens_per_s",
        "step_time_s",
        "grad_norm",
        "lr",
        "state_bytes_per_param",
        "achieved_tflops",
        "model_flops_per_token",
        "stability/loss_spikes",
        "stability/grad_norm_spikes",
        "stability/loss_max_excursion",
    ):
        assert key in run.data.metrics, key
    assert run.data.metrics["stability/diverged"] == 0 and "stability/divergence_step" not in run.data.metrics


def test_nan_loss_is_recorded_failed_with_its_step(run_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("LOWPREC_FAULTS", "nan_at_step=3")
    assert main(["train"] + run_dirs + QUICK + ["recipe=fp32"]) == 1
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["failure_reason"] == "NonFiniteError: loss is nan at step 3"
    assert not [k for k in run.data.params if k.startswith("faults")]  # a test channel, not the run's config
    # the steps before the failure are kept
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2]
    # and the stability metrics count the NaN step as the run's divergence, logged at that step
    m = run.data.metrics
    assert (m["stability/loss_nonfinite"], m["stability/diverged"], m["stability/divergence_step"]) == (1, 1, 3)
    assert [h.step for h in client.get_metric_history(run.info.run_id, "stability/diverged")] == [3]
    assert "EMA(span 20)" in run.data.tags["stability_rule"]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """One fp32 run of ``QUICK`` checkpointed at step 3 (and 6), in a store of its own, for the tests that resume
    from it (each resume adds its run to that store): ``(dirs, client, experiment id, the run)``."""
    root = tmp_path_factory.mktemp("checkpointed")
    dirs = dirs_under(root)
    assert main(["train"] + dirs + QUICK + ["recipe=fp32", "train.checkpoint_every=3"]) == 0
    client = MlflowClient(store_uri(root))
    exp = client.get_experiment_by_name("lowprec").experiment_id
    (first,) = client.search_runs([exp])
    return dirs, client, exp, first


def test_cli_checkpoints_and_resumes(checkpointed, tmp_path):
    dirs, client, exp, first = checkpointed
    ckpt = first.data.tags["checkpoint_dir"]
    full = {m.step: m.value for m in client.get_metric_history(first.info.run_id, "loss")}
    before = {r.info.run_id for r in client.search_runs([exp])}
    assert main(["train"] + dirs + QUICK + ["recipe=fp32", f"resume={ckpt}/step_3"]) == 0
    (second,) = [r for r in client.search_runs([exp]) if r.info.run_id not in before]
    assert second.data.tags["resumed_from"].endswith("step_3")
    resumed = {m.step: m.value for m in client.get_metric_history(second.info.run_id, "loss")}
    assert resumed == {s: full[s] for s in range(3, 6)}
    assert main(["train"] + dirs + QUICK + [f"resume={tmp_path / 'nope'}"]) == 2  # refused before any run
    assert len(client.search_runs([exp])) == len(before) + 1


def test_a_converter_that_converts_nothing_makes_the_run_failed(run_dirs, tmp_path, monkeypatch):
    """The expected FP8 linears come from the recipe's filters applied to the model, not from what the
    converter reports: a converter that claims to have converted but did not is caught after step 0."""
    import lowprec.train.build
    from lowprec.convert import fp8_candidate_fqns

    monkeypatch.setattr(lowprec.train.build, "convert_fp8", lambda model, spec, **kw: fp8_candidate_fqns(model, spec))
    assert main(["train"] + run_dirs + QUICK + ["recipe=fp8_current"]) == 1
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["effective_matches"] == "false"
    assert (
        "fp8_linears: requested {'lowprec.float8.linear.Float8Linear': 14}, ran {}" in run.data.tags["failure_reason"]
    )


def test_resume_under_another_recipe_needs_consent_and_is_recorded(checkpointed, capsys):
    dirs, client, exp, first = checkpointed
    ckpt = f"{first.data.tags['checkpoint_dir']}/step_3"
    before = {r.info.run_id for r in client.search_runs([exp])}
    capsys.readouterr()
    assert main(["train"] + dirs + QUICK + ["recipe=fp8_current", f"resume={ckpt}"]) == 2
    err = capsys.readouterr().err
    assert "written under recipe fp32" in err and "train.resume_recipe_change=true" in err
    assert {r.info.run_id for r in client.search_runs([exp])} == before  # refused before a run was created
    consent = ["recipe=fp8_current", f"resume={ckpt}", "train.resume_recipe_change=true"]
    assert main(["train"] + dirs + QUICK + consent) == 0
    (second,) = [r for r in client.search_runs([exp]) if r.info.run_id not in before]
    assert second.info.status == "FINISHED"
    change = json.loads(second.data.tags["effective_recipe"])["resume_recipe_change"]
    assert change["from"] == "fp32" and change["to"] == "fp8_current" and change["at_step"] == 3
    assert second.data.tags["resume_recipe_change"].startswith("fp32 (")


def test_stochastic_rounding_runs_are_reproducible_whatever_the_global_rng(token_data, monkeypatch):
    """Stochastic rounding draws from the process-global RNG, which torch seeds randomly per process: the build
    seeds it from the run's seed, so the same recipe and seed give the same losses in any process and after
    any earlier run of an ablation."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, *a, **k: fn if fn is not None else (lambda f: f))
    runs = []
    for outside in (1, 2):
        torch.manual_seed(outside)  # what another process, or an earlier run, left in the global RNG
        runs.append(_losses("bf16_sr", token_data, 0)[0])
    assert runs[0] == runs[1]


def test_a_run_with_z_loss_carries_its_curve_and_runs_without_it_do_not(tmp_path):
    """``z_loss`` is read back only from the runs that logged it (``train.z_loss`` > 0), and the report builds from
    an ablation where some runs did and some did not."""
    from fabricated_ablation import fabricate_ablation
    from mlflow.entities import Metric

    from lowprec_lab.report.build import build_report
    from lowprec_lab.tracking.runs import load_runs
    from lowprec_lab.tracking.tracker import PARENT_TAG, Tracker

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "lowprec", tmp_path)
    parent = fabricate_ablation(tracker, "abl-z", {"bf16": {0: 4.0, 1: 4.05}, "fp8_rowwise": {0: 4.001, 1: 4.049}})
    z = [(0, 3e-4), (1, 2e-4), (2, 1e-4)]
    for c in tracker.client.search_runs([tracker.experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'"):
        if c.data.tags["recipe"] == "fp8_rowwise":
            tracker.client.log_batch(c.info.run_id, metrics=[Metric("z_loss", v, 0, s) for s, v in z])
    runs = load_runs(tracker, parent)
    assert {(r.recipe, "z_loss" in r.curves) for r in runs} == {("bf16", False), ("fp8_rowwise", True)}
    assert next(r for r in runs if r.recipe == "fp8_rowwise").curves["z_loss"] == z
    assert build_report(tracker, "abl-z", tmp_path / "reports").read_text().startswith("#")
