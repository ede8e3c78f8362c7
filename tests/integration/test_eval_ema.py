"""``train.eval_ema``: an FP32 EMA of the trained weights evaluated beside them (lowprec.train.ema). The training
trajectory is bit-identical with and without it, the EMA is torch's ``AveragedModel`` + ``get_ema_multi_avg_fn`` on
the same weights, a resumed run's ``val_loss_ema`` is the uninterrupted run's, and bad settings are one line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.errors import CheckpointError, ConfigError
from lowprec.model import model_args
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.ema import WeightEma
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec
from lowprec.train.step import evaluate

BASE = dict(
    steps=6,
    batch_size=2,
    seq_len=64,
    warmup_steps=2,
    val_every=3,
    val_batches=1,
    timing_warmup_steps=1,
    telemetry_every=0,
    progress=False,
)


class Sink:
    def __init__(self):
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, m, step):
        self.rows.setdefault(step, {}).update(m)


def _built(recipe: str, spec: TrainSpec):
    torch.manual_seed(0)
    return build(CATALOG[recipe], model_args("debug"), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))


def _run(recipe: str, token_data, spec: TrainSpec, **kw):
    b = _built(recipe, spec)
    sink = Sink()
    data = TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0)
    res = run_training(b, data, spec, sink, **kw)
    return b, sink.rows, res, data


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])  # bf16: the EMA follows the FP32 masters
def test_ema_leaves_the_trajectory_bit_identical_and_logs_its_own_val_loss(recipe, token_data):
    _, off, res_off, _ = _run(recipe, token_data, TrainSpec(**BASE))
    b, on, res_on, _ = _run(recipe, token_data, TrainSpec(**BASE, eval_ema=0.9))
    assert [off[s]["loss"] for s in range(6)] == [on[s]["loss"] for s in range(6)]
    assert [off[s]["grad_norm"] for s in range(6)] == [on[s]["grad_norm"] for s in range(6)]
    assert [off[s]["val_loss"] for s in (2, 5)] == [on[s]["val_loss"] for s in (2, 5)]
    assert all("val_loss_ema" not in r for r in off.values()) and "final_val_loss_ema" not in res_off.summary
    assert sorted(s for s, r in on.items() if "val_loss_ema" in r) == [2, 5]
    for s in (2, 5):
        assert torch.isfinite(torch.tensor(on[s]["val_loss_ema"])) and on[s]["val_loss_ema"] != on[s]["val_loss"]
    assert res_on.summary["final_val_loss_ema"] == on[5]["val_loss_ema"]
    assert res_on.summary["final_val_loss"] == res_off.summary["final_val_loss"]


def test_val_loss_ema_is_torchs_averaged_model_of_the_weights(token_data):
    """After each of 3 steps the weights (fp32: their own masters) are folded into torch's AveragedModel with
    get_ema_multi_avg_fn; its weights, evaluated on the run's validation batches, give the run's val_loss_ema."""
    spec = TrainSpec(**{**BASE, "steps": 3, "val_every": 0}, eval_ema=0.7)
    snaps = []

    def snap(step, built):  # before step k: the weights after step k-1
        if step > 0:
            snaps.append(copy.deepcopy(built.model.state_dict()))

    b, rows, res, data = _run("fp32", token_data, spec, before_step=[snap])
    snaps.append(copy.deepcopy(b.model.state_dict()))
    assert len(snaps) == 3
    shadow = copy.deepcopy(b.model)
    avg = AveragedModel(copy.deepcopy(b.model), multi_avg_fn=get_ema_multi_avg_fn(0.7), use_buffers=False)
    for sd in snaps:
        shadow.load_state_dict(sd)
        avg.update_parameters(shadow)
    trained = copy.deepcopy(b.model.state_dict())
    with torch.no_grad():
        for p, a in zip(b.model.parameters(), avg.module.parameters(), strict=True):
            p.copy_(a)
    expected = evaluate(b, data.val_batches(spec.val_batches))
    assert res.summary["final_val_loss_ema"] == expected
    assert expected != res.summary["final_val_loss"]
    # and the swap put the trained weights back: the model after the run is the last snapshot
    assert all(torch.equal(trained[k], snaps[-1][k]) for k in trained)


def test_ema_state_follows_averaged_model_on_bf16_masters():
    """Direct: WeightEma over a MasterWeightOptimizer's FP32 masters equals AveragedModel over an FP32 copy."""
    from lowprec.optim.master import MasterWeightOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = MasterWeightOptimizer(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    ema = WeightEma(model, opt, 0.8)
    ref_model = torch.nn.Linear(8, 4)
    avg = AveragedModel(ref_model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=False)
    for _ in range(3):
        model(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        with torch.no_grad():
            for r, p in zip(ref_model.parameters(), model.parameters(), strict=True):
                r.copy_(opt.master_of(p))
        avg.update_parameters(ref_model)
    for mine, theirs in zip(ema.avg, avg.module.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_resumed_run_has_the_uninterrupted_val_loss_ema(token_data, tmp_path):
    spec = TrainSpec(**{**BASE, "checkpoint_every": 3}, eval_ema=0.9)
    _, full, _, _ = _run("fp32", token_data, spec, checkpoint_dir=tmp_path)
    _, resumed, res, _ = _run("fp32", token_data, spec, resume_from=tmp_path / "step_3")
    assert sorted(resumed) == [3, 4, 5]
    assert [resumed[s]["loss"] for s in (3, 4, 5)] == [full[s]["loss"] for s in (3, 4, 5)]
    assert resumed[5]["val_loss_ema"] == full[5]["val_loss_ema"] == res.summary["final_val_loss_ema"]
    # the same checkpoint under another decay: its average is not this run's, refused in one line
    other = TrainSpec(**{**BASE, "checkpoint_every": 3}, eval_ema=0.99)
    with pytest.raises(CheckpointError, match="holds a weight EMA of decay 0.9, not train.eval_ema=0.99") as e:
        _run("fp32", token_data, other, resume_from=tmp_path / "step_3")
    assert "\n" not in str(e.value)
    plain = TrainSpec(**{**BASE, "checkpoint_every": 3})  # a checkpoint without an EMA is refused in one line
    _run("fp32", token_data, plain, checkpoint_dir=tmp_path / "plain")
    with pytest.raises(CheckpointError, match="holds no weight EMA") as e:
        _run("fp32", token_data, spec, resume_from=tmp_path / "plain" / "step_3")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5, float("nan")])
def test_decay_out_of_range_is_one_line(decay):
    with pytest.raises(ConfigError, match=r"train.eval_ema=.* must be a decay in \(0, 1\)") as e:
        TrainSpec(eval_ema=decay)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_bad_decay_and_a_parallel_layout(run_dirs, capsys):
    from lowprec_lab.cli import main

    assert main(["train", "model=debug", "train.eval_ema=1.0", *run_dirs]) != 0
    err = capsys.readouterr().err
    assert "train.eval_ema=1.0 must be a decay in (0, 1)" in err
    assert main(["train", "model=debug", "train.eval_ema=0.9", "parallel.dp_shard=2", "device=cpu", *run_dirs]) != 0
    err = capsys.readouterr().err
    assert "train.eval_ema is not implemented for a parallel layout" in err
