"""Dynamic loss scaling (``lowprec.optim.loss_scale.DynamicLossScaler``, GradScaler semantics): the skip rule
with several parameters, the growth tracker across a back-off, and the scaler state through a real checkpoint
and a resumed FP16 run whose scale moves both ways before the checkpoint.

Every expected value here is written out or computed without the class under test."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lowprec.build_optim import OptimHParams
from lowprec.data import TokenBatches
from lowprec.model import model_args
from lowprec.optim.loss_scale import DynamicLossScaler
from lowprec.recipes import get_recipe
from lowprec.train.build import build
from lowprec.train.checkpoint import load_checkpoint, save_checkpoint
from lowprec.train.loop import run_training
from lowprec.train.spec import TrainSpec

SHAPES = ((4, 6), (6,), (3, 4), (5,))


def _model(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _scaled_backward(scaler: DynamicLossScaler, params: list[nn.Parameter], seed: int) -> None:
    """A loss that touches every parameter; gradients are ``scale * x_i`` (all finite, all nonzero)."""
    g = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = None
    loss = sum((p * (torch.rand(p.shape, generator=g) + 0.5)).sum() for p in params)
    scaler.scale(loss).backward()


def _snapshot(params, opt):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _assert_unchanged(params, opt, snap):
    ps, st = snap
    for p, q in zip(params, ps):
        assert torch.equal(p.detach(), q)
    now = opt.state_dict()
    assert now["state"].keys() == st["state"].keys()
    for k in st["state"]:
        for name, v in st["state"][k].items():
            w = now["state"][k][name]
            assert torch.equal(torch.as_tensor(w), torch.as_tensor(v)), (k, name)


# ---- (a) one non-finite gradient among several skips the step ---------------------------------------------------


@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("bad_param", [0, 2, 3])  # first, middle and last parameter: no position is special
@pytest.mark.parametrize("explicit_unscale", [True, False])
def test_one_nonfinite_gradient_among_several_skips_the_step(bad_value, bad_param, explicit_unscale):
    params = _model()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=100)

    # a clean step first, so the optimizer has state (step counter, moments) that a skip must leave alone
    _scaled_backward(scaler, params, 0)
    if explicit_unscale:
        scaler.unscale_(opt)
    before = [p.detach().clone() for p in params]
    assert scaler.step(opt) is True and scaler.last_step_skipped is False
    scaler.update()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))  # every parameter moved
    assert scaler.get_scale() == 2.0**12 and scaler.skipped_steps == 0

    # one element of one parameter's gradient is non-finite; every other gradient is finite
    _scaled_backward(scaler, params, 1)
    params[bad_param].grad.view(-1)[1] = bad_value
    assert sum(int((~torch.isfinite(p.grad)).sum()) for p in params) == 1
    snap = _snapshot(params, opt)
    if explicit_unscale:
        scaler.unscale_(opt)
    assert scaler.step(opt) is False
    assert scaler.last_step_skipped is True
    scaler.update()
    _assert_unchanged(params, opt, snap)
    assert opt.state_dict()["state"][0]["step"] == 1  # AdamW's own step counter did not advance
    assert scaler.get_scale() == 2.0**11
    assert scaler.skipped_steps == 1 and scaler.backoffs == 1 and scaler.steps == 2 and scaler.growths == 0
    assert scaler.metrics() == {"loss_scale": 2.0**11, "loss_scale_skipped_steps": 1.0}

    # all-finite gradients again: the step runs, with gradients unscaled by the new (halved) scale
    _scaled_backward(scaler, params, 2)
    expected_grads = [p.grad / 2.0**11 for p in params]
    scaler.unscale_(opt)
    for p, e in zip(params, expected_grads):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    snap = _snapshot(params, opt)
    assert scaler.step(opt) is True and scaler.last_step_skipped is False
    scaler.update()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, snap[0]))
    assert opt.state_dict()["state"][0]["step"] == 2
    assert scaler.get_scale() == 2.0**11 and scaler.skipped_steps == 1 and scaler.steps == 3


def test_fp16_overflow_in_one_parameter_skips_the_step():
    """The overflow comes from the scale itself: an FP16 gradient beyond 65504 becomes inf in one parameter only."""
    big = nn.Parameter(torch.ones(8, dtype=torch.float16))
    small = nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt = torch.optim.SGD([big, small], lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**13, growth_interval=100)
    xb = torch.full((8,), 10.0, dtype=torch.float16)  # 10 * 2**13 = 81920 > 65504: inf in fp16
    xs = torch.full((8,), 0.1, dtype=torch.float16)
    scaler.scale((big * xb).sum() + (small * xs).sum()).backward()
    assert torch.isinf(big.grad).all() and torch.isfinite(small.grad).all()
    before = (big.detach().clone(), small.detach().clone())
    assert scaler.step(opt) is False
    scaler.update()
    assert torch.equal(big.detach(), before[0]) and torch.equal(small.detach(), before[1])
    assert scaler.get_scale() == 2.0**12 and scaler.skipped_steps == 1

    big.grad = small.grad = None
    scaler.scale((big * xb).sum() + (small * xs).sum()).backward()  # 10 * 2**12 = 40960: finite
    assert scaler.step(opt) is True
    scaler.update()
    assert not torch.equal(big.detach(), before[0]) and not torch.equal(small.detach(), before[1])
    torch.testing.assert_close(big.detach(), before[0] - 1.0, rtol=0, atol=1e-3)  # lr 0.1 x unscaled grad 10


# ---- (b) the growth tracker restarts after a back-off -----------------------------------------------------------

# growth_interval 3, init 2**10. "C" clean step, "O" overflow step. Expected scale after each update, by hand:
#   C C: tracker 1, 2 (no growth yet); O: halve, tracker 0; C C: tracker 1, 2 -> NO growth although 4 clean
#   steps were taken since the start; C: tracker 3 -> grow; C C C -> grow again; O O: halve twice; C C C -> grow.
EVENTS = "CCOCCCCCCOOCCC"
EXPECTED_SCALES = [
    2.0**10,
    2.0**10,
    2.0**9,
    2.0**9,
    2.0**9,
    2.0**10,
    2.0**10,
    2.0**10,
    2.0**11,
    2.0**10,
    2.0**9,
    2.0**9,
    2.0**9,
    2.0**10,
]


def _reference_scales(events: str, init: float, interval: int, growth: float = 2.0, backoff: float = 0.5):
    """GradScaler's rule from its documentation, written independently of the class under test."""
    scale, clean, out = init, 0, []
    for e in events:
        if e == "O":
            scale, clean = scale * backoff, 0
        else:
            clean += 1
            if clean == interval:
                scale, clean = scale * growth, 0
        out.append(scale)
    return out


def test_growth_tracker_resets_after_a_backoff():
    assert _reference_scales(EVENTS, 2.0**10, 3) == EXPECTED_SCALES  # the two references agree
    params = _model()
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    seen, skipped = [], []
    for i, e in enumerate(EVENTS):
        _scaled_backward(scaler, params, i)
        if e == "O":
            params[1].grad[0] = float("inf")
        skipped.append(not scaler.step(opt))
        scaler.update()
        seen.append(scaler.get_scale())
        assert seen == EXPECTED_SCALES[: i + 1], f"after step {i} ({EVENTS[: i + 1]})"
    assert skipped == [e == "O" for e in EVENTS]
    assert scaler.growths == 3 and scaler.backoffs == 3 and scaler.skipped_steps == 3 and scaler.steps == len(EVENTS)


def test_growth_tracker_resets_after_a_growth():
    params = _model()
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler = DynamicLossScaler(init_scale=1.0, growth_interval=2)
    seen = []
    for i in range(7):
        _scaled_backward(scaler, params, i)
        scaler.step(opt)
        scaler.update()
        seen.append(scaler.get_scale())
    assert seen == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0]


# ---- (c) the scaler state through a checkpoint ------------------------------------------------------------------


def _moved_scaler() -> DynamicLossScaler:
    """A scaler whose scale, growth tracker and counters all differ from a fresh one's."""
    params = _model()
    opt = torch.optim.SGD(params, lr=1e-3)
    s = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    for i, e in enumerate("OCCCOCC"):  # ends with tracker 2, one growth, two back-offs
        _scaled_backward(s, params, i)
        if e == "O":
            params[0].grad[0, 0] = float("nan")
        s.step(opt)
        s.update()
    return s


def test_loss_scaler_state_round_trips_through_save_and_load_checkpoint(tmp_path):
    scaler = _moved_scaler()
    # independent expectation: O -> 2**9, C C C -> 2**10 (growth), O -> 2**9, C C -> tracker 2
    assert scaler.get_scale() == 2.0**9
    saved = scaler.state_dict()
    assert saved == {
        "scale": 2.0**9,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "growth_tracker": 2,
        "skipped_steps": 2,
        "steps": 7,
        "growths": 1,
        "backoffs": 2,
        "enabled": True,
    }

    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", model, opt, 7, loss_scaler=scaler)

    fresh = DynamicLossScaler()  # defaults: 2**16, interval 2000, all counters 0
    assert fresh.state_dict() != saved
    model2 = nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    assert load_checkpoint(tmp_path / "ckpt", model2, opt2, loss_scaler=fresh) == 7
    assert fresh.state_dict() == saved
    assert fresh.get_scale() == 2.0**9 and fresh.loss_scale == 2.0**9
    assert fresh.metrics() == {"loss_scale": 2.0**9, "loss_scale_skipped_steps": 2.0}

    # and both continue identically: the restored tracker (2) makes the very next clean step grow the scale
    params = _model()
    opt3 = torch.optim.SGD(params, lr=1e-3)
    for s in (scaler, fresh):
        _scaled_backward(s, params, 50)
        assert s.step(opt3)
        s.update()
    assert scaler.get_scale() == fresh.get_scale() == 2.0**10
    assert scaler.state_dict() == fresh.state_dict()


class AllMetrics:
    """A metric sink keeping every metric of every step."""

    def __init__(self):
        self.steps: dict[int, dict[str, float]] = {}

    def log_metrics(self, m, step):
        assert step not in self.steps
        self.steps[step] = dict(m)


SPEC = TrainSpec(
    steps=12,
    batch_size=2,
    seq_len=64,
    warmup_steps=2,
    val_every=0,
    val_batches=1,
    timing_warmup_steps=1,
    telemetry_every=0,
    checkpoint_every=5,
    progress=False,
)
# Debug model, batch 2 x 64: FP16 gradients overflow from a loss scale of about 2**20. Starting at 2**18 with a
# growth interval of 2, the scale grows at steps 1 and 3 (2**19, 2**20), overflows at step 4 (skipped, back to
# 2**19), so the checkpoint after step 5 holds a scale that moved both ways and is not the initial one.
# (An initial scale that overflows at step 0 is tested separately below.)
RECIPE_OVERRIDES = dict(init_scale=2.0**18, growth_interval=2)


def _fp16_run(token_data, rng_seed: int, **kw):
    recipe = get_recipe("fp16_amp").with_fields("compute", **RECIPE_OVERRIDES)
    b = build(recipe, model_args("debug"), SPEC, OptimHParams(lr=3e-3), 0, torch.device("cpu"))
    assert b.loss_scaler.get_scale() == RECIPE_OVERRIDES["init_scale"]
    sink = AllMetrics()
    torch.manual_seed(rng_seed)
    run_training(b, TokenBatches(token_data.train, token_data.val, SPEC.seq_len, SPEC.batch_size, 0), SPEC, sink, **kw)
    return sink, b.loss_scaler


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_fp16_resume_restores_a_moving_loss_scale(token_data, tmp_path):
    full, full_scaler = _fp16_run(token_data, 1234, checkpoint_dir=tmp_path)
    assert sorted(full.steps) == list(range(12))
    scales = [full.steps[s]["loss_scale"] for s in range(12)]  # logged after each step's update()
    skipped = [full.steps[s]["loss_scale_skipped_steps"] for s in range(12)]
    # not vacuous: before the checkpoint after step 5 the scale grew (clean steps) and backed off (overflow)
    before = [RECIPE_OVERRIDES["init_scale"]] + scales[:5]
    assert any(new > old for old, new in zip(before, before[1:])), scales
    assert any(new < old for old, new in zip(before, before[1:])), scales
    assert scales[4] != RECIPE_OVERRIDES["init_scale"] and skipped[4] > 0, (scales, skipped)
    assert any(math.isinf(full.steps[s]["grad_norm"]) for s in range(5)), "no overflow step before the checkpoint"
    assert all(math.isfinite(full.steps[s]["loss"]) for s in range(12))
    assert (tmp_path / "step_5" / ".metadata").exists()

    resumed, resumed_scaler = _fp16_run(token_data, 999, resume_from=tmp_path / "step_5")  # another global RNG
    assert sorted(resumed.steps) == list(range(5, 12))
    got = [resumed.steps[s]["loss_scale"] for s in range(5, 12)]
    for s in range(5, 12):
        for key in ("loss", "loss_scale", "loss_scale_skipped_steps", "grad_norm", "lr"):
            a, b = full.steps[s][key], resumed.steps[s][key]
            assert _same(a, b), (s, key, a, b, "full:", scales[5:], "resumed:", got)
    assert resumed_scaler.state_dict() == full_scaler.state_dict()  # tracker and counters too


def test_skipped_first_steps_defer_the_effective_inspection(token_data):
    """FP16 overflow at the initial scale is common: the first steps are skipped and create no optimizer state,
    so the effective recipe is inspected after the first step whose update ran, and the run finishes."""
    spec = TrainSpec(
        steps=10,
        batch_size=2,
        seq_len=64,
        warmup_steps=2,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=1,
        telemetry_every=0,
        progress=False,
    )
    recipe = get_recipe("fp16_amp").with_fields("compute", init_scale=2.0**24)
    b = build(recipe, model_args("debug"), spec, OptimHParams(lr=3e-3), 0, torch.device("cpu"))
    sink = AllMetrics()
    res = run_training(b, TokenBatches(token_data.train, token_data.val, spec.seq_len, spec.batch_size, 0), spec, sink)
    assert res.effective_checked and res.effective["moment_dtype"] == {"float32": res.summary["mem_params_bytes"] // 4}
    assert b.loss_scaler.skipped_steps >= 2 and sink.steps[0]["loss_scale_skipped_steps"] == 1
