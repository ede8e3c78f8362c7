"""FP8 recipes inside the Llama: layer selection, delayed-scaling state through a DCP checkpoint."""

import pytest
import torch

from lowprec.build_optim import OptimHParams
from lowprec.convert import fp8_candidate_fqns
from lowprec.data import TokenBatches
from lowprec.float8 import Float8Linear
from lowprec.model import model_args
from lowprec.recipe import Float8Spec, LayersSpec
from lowprec.recipes import get_recipe
from lowprec.train.build import build, build_model_meta
from lowprec.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lowprec.train.loop import train_step
from lowprec.train.spec import TrainSpec

SPEC = TrainSpec(
    steps=6,
    batch_size=2,
    seq_len=64,
    val_every=0,
    val_batches=1,
    timing_warmup_steps=1,
    telemetry_every=0,
    progress=False,
)


def test_layer_filters():
    model = build_model_meta(model_args("debug", n_layers=4))
    every = fp8_candidate_fqns(model, Float8Spec(backend="lowprec"))
    assert "output" not in every and len(every) == 4 * 7
    edge = fp8_candidate_fqns(
        model, Float8Spec(backend="lowprec", layers=LayersSpec(hp_first_blocks=1, hp_last_blocks=1))
    )
    assert {f.split(".")[1] for f in edge} == {"1", "2"}
    small = fp8_candidate_fqns(model, Float8Spec(backend="lowprec", layers=LayersSpec(min_features=32)))
    assert not any(f.endswith(("wk", "wv")) for f in small)  # 32 -> 16 projections are below the size filter
    named = fp8_candidate_fqns(model, Float8Spec(backend="lowprec", layers=LayersSpec(keep_hp_fqns=("output", "w2"))))
    assert not any(f.endswith("w2") for f in named) and any(f.endswith("w1") for f in named)


def test_delayed_history_survives_a_checkpoint_round_trip(token_data, tmp_path):
    batches = TokenBatches(token_data.train, token_data.val, SPEC.seq_len, SPEC.batch_size, 0)
    a = build(get_recipe("fp8_delayed"), model_args("debug"), SPEC, OptimHParams(), 0, torch.device("cpu"))
    for step in range(3):
        train_step(a, [batches.train_batch(step)], 1.0, step)
    lin = a.model.get_submodule("layers.0.feed_forward.w1")
    assert isinstance(lin, Float8Linear) and lin.scalers["input"].scale.item() != 1.0
    save_checkpoint(tmp_path / "ckpt", a.model, a.optimizer, 3)
    b = build(get_recipe("fp8_delayed"), model_args("debug"), SPEC, OptimHParams(), 1, torch.device("cpu"))
    assert load_checkpoint(tmp_path / "ckpt", b.model, b.optimizer) == 3
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    # the next steps are identical: scales, histories and optimizer moments all came back
    for step in range(3, 5):
        la = train_step(a, [batches.train_batch(step)], 1.0, step).loss
        lb = train_step(b, [batches.train_batch(step)], 1.0, step).loss
        assert la == lb
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope", b.model, b.optimizer)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "fp8_rowwise", "fp8_blockwise"])
def test_fp8_recipes_train_the_debug_model(name, token_data):
    b = build(get_recipe(name), model_args("debug"), SPEC, OptimHParams(), 0, torch.device("cpu"))
    batches = TokenBatches(token_data.train, token_data.val, SPEC.seq_len, SPEC.batch_size, 0)
    batch = batches.train_batch(0)
    losses = [train_step(b, [batch], 1.0, s).loss for s in range(6)]  # one batch, so the loss must fall
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
