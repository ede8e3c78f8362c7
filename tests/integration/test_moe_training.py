"""Every catalog recipe trains the DeepSeekMoE model: the experts go through the recipe's FP8 linears, the router
gate stays out of FP8 in FP32 (recorded in the effective recipe), and ``lowprec train model=moe_debug`` logs the
expert-load metrics to MLflow."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from lowprec.backends import fp8_backend
from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.recipe import CommSpec
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec
from lowprec_lab.cli import main

SPEC = TrainSpec(
    steps=2, batch_size=2, seq_len=32, warmup_steps=1, val_every=0, val_batches=1, timing_warmup_steps=1, progress=False
)
ON_THIS_MACHINE = [n for n, r in CATALOG.items() if r.fp8.backend != "te" or torch.cuda.is_available()]


class _Rows:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append(metrics)


@pytest.mark.parametrize("name", ON_THIS_MACHINE)
def test_every_recipe_trains_moe_debug(name, token_data):
    recipe = CATALOG[name]
    if recipe.comm != CommSpec():  # FP8 communication needs FSDP: tests/distributed/test_moe_fsdp.py runs it
        recipe = recipe.with_fields("comm", **dataclasses.asdict(CommSpec()))
    built = build(recipe, model_args("moe_debug"), SPEC, OptimHParams(), 0, torch.device("cpu"))
    sink = _Rows()
    res = run_training(
        built, TokenBatches(token_data.train, token_data.val, SPEC.seq_len, SPEC.batch_size, 0), SPEC, sink
    )
    assert res.effective_checked  # the effective recipe matched the requested one
    assert res.effective["router_dtype"] == {"float32": 2}
    gate_fqns = {f"layers.{i}.moe.router.gate" for i in range(2)}
    assert not gate_fqns & set(built.fp8_fqns)
    if recipe.fp8.enabled:
        # per block 4 attention + 8 experts x 3 + 3 shared linears, all 32 wide but wk/wv (32 -> 16, GQA); the
        # output head stays high precision, and so do the recipe's last hp_last_blocks blocks and narrow linears
        narrow = 2 if recipe.fp8.layers.min_features > 16 else 0
        want = (2 - recipe.fp8.layers.hp_last_blocks) * (4 + 8 * 3 + 3 - narrow)
        assert len(built.fp8_fqns) == want, built.fp8_fqns
        assert "layers.0.moe.experts.7.w2" in built.fp8_fqns
        assert res.effective["fp8_linears"] == {fp8_backend(recipe.fp8.backend).module_class: want}
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in sink.rows)
    assert all(r["moe/max_over_mean"] >= 1.0 for r in sink.rows)


def test_lowprec_train_logs_expert_load_metrics(run_dirs, tmp_path):
    args = [
        "train",
        *run_dirs,
        "model=moe_debug",
        "recipe=deepseek_v3",
        "train.steps=3",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.val_every=0",
        "train.val_batches=1",
        "train.warmup_steps=1",
        "train.timing_warmup_steps=1",
        "train.telemetry_every=2",
    ]
    assert main(args) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lowprec").experiment_id])
    m = run.data.metrics
    for key in ("moe/max_over_mean", "moe/load_cv", "moe/seq_aux_loss", "moe/layers.1.moe/load_cv"):
        assert [h.step for h in client.get_metric_history(run.info.run_id, key)] == [0, 1, 2], key
    # per-expert counts on telemetry steps: every token to top_k = 2 experts
    counts = [client.get_metric_history(run.info.run_id, f"moe/layers.0.moe/tokens_e{e:02d}") for e in range(8)]
    assert all([h.step for h in c] == [0, 2] for c in counts)
    assert sum(c[0].value for c in counts) == 2 * 32 * 2
    assert m["moe/seq_aux_loss"] > 0
    assert json.loads(run.data.tags["effective_recipe"])["router_dtype"] == {"float32": 2}
    assert run.data.params["model.n_routed_experts"] == "8"


def test_a_resumed_moe_run_continues_bit_identically(token_data, tmp_path):
    """The load-balancing biases are checkpointed (a buffer): resumed at step 3, the losses and biases equal the
    uninterrupted run's."""
    spec = dataclasses.replace(SPEC, steps=6, checkpoint_every=3)
    args = model_args("moe_debug", bias_update_speed=0.01)

    def run(**kw):
        built = build(CATALOG["deepseek_v3"], args, spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))
        sink = _Rows()
        batches = TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0)
        run_training(built, batches, spec, sink, **kw)
        return [r["loss"] for r in sink.rows], built.model.layers["1"].moe.router.expert_bias

    full, bias = run(checkpoint_dir=tmp_path)
    resumed, bias_resumed = run(resume_from=tmp_path / "step_3")
    assert resumed == full[3:] and torch.equal(bias, bias_resumed) and bias.abs().sum() > 0


def test_an_expert_without_tokens_in_the_first_step_is_reported_not_refused(token_data):
    """Expert 7's bias keeps every token away from it in the first step: its three linears never run, so their
    output dtype cannot be seen; the effective recipe counts them and checks the linears that ran."""
    spec = SPEC
    built = build(CATALOG["fp8_current"], model_args("moe_debug"), spec, OptimHParams(), 0, torch.device("cpu"))
    for m in built.model.moe_layers().values():
        m.router.expert_bias[7] = -100.0
    batches = TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0)
    res = run_training(built, batches, spec, _Rows())
    assert res.effective_checked
    assert res.effective["moe_idle_expert_linears"] == 2 * 3
    assert res.effective["linear_output_dtype"] == {"bfloat16": 2 * (4 + 8 * 3 + 3) + 1 - 6}
