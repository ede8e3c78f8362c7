"""The health monitor's parts, without training: the online spike rule against the offline one,
the data position, the policy's decisions on given losses and gradient norms, and the FP8 fallback's streaks and
switch on a real ``Float8Linear``.
"""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from lowprec.float8 import Float8Linear, linear_config
from lowprec.kernels import KernelPolicy
from lowprec.measure.spikes import OnlineSpikes, SpikeRule, scan_spikes
from lowprec.recipe import CastSpec, Float8Spec
from lowprec.train.data_position import DataPosition
from lowprec.train.fp8_fallback import FP8Health
from lowprec.train.health import HealthMonitor
from lowprec.train.spec import TrainSpec
from lowprec.train.step import AnomalyError, NonFiniteError


def _loss(steps=400, noise=0.02, seed=0):
    t = np.arange(steps)
    return 2.0 + 7.0 * np.exp(-t / 30) + np.random.default_rng(seed).normal(0, noise, steps)


def _series():
    """A loss curve with spikes, a NaN and an inf, a grad-norm-like series, and a short one (all burn-in)."""
    x = _loss()
    x[[100, 200, 300]] += 0.5
    x[150], x[151] = math.nan, math.inf
    g = 1.0 + 0.05 * np.random.default_rng(3).standard_normal(400)
    g[[120, 250]] *= 5
    return [x, g, _loss(15)]


@pytest.mark.parametrize("rule", [SpikeRule(), SpikeRule(ema_window=5, k=3.0, sd_window=30, min_history=10)])
def test_online_spikes_decide_exactly_as_the_offline_scan(rule):
    for x in _series():
        scan = scan_spikes(x, rule)
        online = OnlineSpikes(rule)
        tests = [online.update(v) for v in x]
        assert [t.spike for t in tests] == scan.spike.tolist()
        sd = np.array([(t.threshold - e) / rule.k for t, e in zip(tests, scan.ema_prev)])
        tested = ~np.isnan(scan.robust_sd) & (scan.robust_sd > 0) & ~np.isnan(scan.ema_prev)
        np.testing.assert_allclose(sd[tested], scan.robust_sd[tested], rtol=1e-12)  # threshold = EMA + k sd
        assert np.isnan([t.threshold for t in tests])[~tested].all()
        np.testing.assert_array_equal(np.array([t.residual for t in tests]), scan.residual)
    assert sum(t.spike for t in tests) == 0  # the 15-step curve never leaves burn-in


def test_online_spikes_continue_exactly_from_their_state():
    x = _series()[0]
    whole = OnlineSpikes()
    first = [whole.update(v) for v in x]
    part = OnlineSpikes()
    for v in x[:180]:
        part.update(v)
    resumed = OnlineSpikes()
    resumed.load_state_dict(part.state_dict())
    assert [resumed.update(v) for v in x[180:]] == first[180:]


def test_data_position_skips_batches_as_a_run_that_never_saw_them():
    pos = DataPosition([5, 3])
    assert [pos.batch(s) for s in range(7)] == [0, 1, 2, 4, 6, 7, 8]
    pos.skip(7)
    assert [pos.batch(s) for s in range(7)] == [0, 1, 2, 4, 6, 8, 9]
    again = DataPosition()
    again.load_state_dict(pos.state_dict())
    assert again.skipped == [3, 5, 7] and DataPosition().batch(11) == 11


def _monitor(events, **spec):
    built = SimpleNamespace(model=nn.Linear(2, 2), kernels=KernelPolicy())
    rule = SpikeRule(ema_window=3, k=3.0, sd_window=10, min_history=3)
    return HealthMonitor(built, TrainSpec(**{"telemetry_every": 0, **spec}), rule, events.append)


def _warm(m, n=8):
    """Steps 0..n-1 with a gently noisy loss (the spike rule is testing from step 4 on)."""
    for s in range(n):
        m.batch(s)
        assert m.judge(s, 5.0 - 0.01 * s + 0.003 * (-1) ** s, 1.0 + 0.01 * (-1) ** s, False).apply


def test_fail_raises_on_nonfinite_with_the_old_message_and_records_spikes():
    events = []
    m = _monitor(events)
    _warm(m)
    m.batch(8)
    assert m.judge(8, 9.0, 1.0, False).apply  # a loss spike under fail: recorded, the step applied
    assert (events[-1].kind, events[-1].action, events[-1].value) == ("loss_spike", "recorded", 9.0)
    assert events[-1].threshold < 9.0 and events[-1].batch == 8
    m.batch(9)
    with pytest.raises(NonFiniteError, match=r"^grad_norm is inf at step 9 \(loss 4\.9"):
        m.judge(9, 4.9, math.inf, False)
    m.batch(10)
    assert m.judge(10, 4.9, math.inf, True).apply  # the loss scaler skips inf gradients itself: not an anomaly
    with pytest.raises(NonFiniteError, match=r"^loss is nan at step 11$"):
        m.judge(11, math.nan, math.nan, False)
    assert [e.action for e in events] == ["recorded", "failed", "failed"]
    assert m.pop_metrics() == {
        "anomaly/loss_spike": 1.0,
        "anomaly/nonfinite_grad_norm": 1.0,
        "anomaly/nonfinite_loss": 1.0,
    }


def test_skip_drops_the_update_until_the_consecutive_limit():
    events = []
    m = _monitor(events, on_anomaly="skip", max_consecutive_skips=2)
    _warm(m)
    for s in (8, 9):
        m.batch(s)
        d = m.judge(s, math.nan, math.nan, False)
        assert not d.apply and not d.rollback
    m.batch(10)
    assert m.judge(10, 4.9, 1.0, False).apply  # a clean step resets the count
    for s in (11, 12):
        m.batch(s)
        assert not m.judge(s, 4.9, math.nan, False).apply
    m.batch(13)
    with pytest.raises(NonFiniteError, match="at step 13: train.max_consecutive_skips=2 exhausted"):
        m.judge(13, 4.9, math.nan, False)
    assert [e.action for e in events] == ["skipped"] * 4 + ["failed"]
    assert m.counts["skipped_steps"] == 4


def test_rollback_skips_the_batch_and_fails_past_the_limit_or_before_any_checkpoint():
    events = []
    m = _monitor(events, on_anomaly="rollback", checkpoint_every=4, max_rollbacks=1)
    _warm(m)
    m.batch(8)
    with pytest.raises(NonFiniteError, match="no checkpoint to roll back to yet"):
        m.judge(8, math.nan, math.nan, False)
    m = _monitor(events, on_anomaly="rollback", checkpoint_every=4, max_rollbacks=1, skip_batches=[2])
    _warm(m)
    m.batch(8)
    assert m.judge(8, 9.0, 1.0, False).apply  # a spike before the first checkpoint: recorded
    m.checkpoint_written(8)
    m.batch(9)
    d = m.judge(9, math.nan, math.nan, False)
    assert d.rollback and not d.apply and m.data.skipped == [2, 10] and m.rollbacks == 1
    assert events[-1].detail == "reload step_8, skip batch 10 (rollback 1)" and events[-1].batch == 10
    m.batch(9)
    with pytest.raises(AnomalyError, match=r"^loss spike 20.0 at step 9: train.max_rollbacks=1 exhausted"):
        m.judge(9, 20.0, 1.0, False)


def test_monitor_state_round_trips_through_a_checkpoint_dict():
    events = []
    m = _monitor(events, on_anomaly="rollback", checkpoint_every=4)
    _warm(m)
    m.checkpoint_written(8)
    m.batch(8)
    m.judge(8, math.nan, math.nan, False)
    state = m.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = _monitor([], on_anomaly="rollback", checkpoint_every=4)
    back.load_state_dict(torch.load(buf, weights_only=True))  # what trainer_state.pt can hold
    assert str(back.state_dict()) == str(state)  # str: the histories hold NaN, which is not == itself
    assert back.data.batch(8) == 9 and back.rollbacks == 1 and back.counts == m.counts


def _fp8_model():
    spec = Float8Spec(backend="lowprec", scaling="tensorwise", cast=CastSpec(strategy="delayed", fp8_format="hybrid"))
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
    cfg = linear_config(spec)
    for i in range(2):
        model[i] = Float8Linear.from_linear(model[i], cfg)
    return model


def _shares(**by_layer):
    return {f"fp8/{fqn}/{role}/{stat}": v for fqn, (role, stat, v) in by_layer.items()}


def test_fp8_fallback_switches_a_layer_after_consecutive_samples_above_the_threshold():
    model = _fp8_model()
    h = FP8Health(model, threshold=0.05, samples=2, every=2, switch=True, kernel="native")
    assert h.observe(0, _shares(**{"0": ("input", "overflow", 0.5)})) == []
    assert h.observe(1, _shares(**{"0": ("input", "overflow", 0.5)})) == []  # not a sampled step
    assert h.observe(2, _shares(**{"0": ("input", "underflow", 0.01)})) == []  # below: the streak restarts
    assert h.observe(4, _shares(**{"0": ("weight", "underflow", 0.2), "1": ("input", "overflow", math.nan)})) == []
    (alarm,) = h.observe(6, _shares(**{"0": ("grad_output", "overflow", 0.3)}))
    assert (alarm.fqn, alarm.stat, alarm.role, alarm.share, alarm.steps) == (
        "0",
        "overflow",
        "grad_output",
        0.3,
        (4, 6),
    )
    assert model[0].fallback_kernel == "native" and model[1].fallback_kernel is None
    assert h.record()["fp8_fallback"]["layers"]["0"]["from_step"] == 7
    watch = FP8Health(_fp8_model(), threshold=0.05, samples=1, every=1, switch=False, kernel="native")
    assert len(watch.observe(0, _shares(**{"1": ("input", "overflow", 0.9)}))) == 1 and not watch.switched


def test_a_switched_layer_is_a_high_precision_linear():
    torch.manual_seed(0)
    model = _fp8_model()
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp8 = model[0](x)
        model[0].fallback_kernel = "native"
        hp = model[0](x)
        ref = torch.nn.functional.linear(x, model[0].weight)
    assert torch.equal(hp, ref) and hp.dtype == torch.bfloat16 and not torch.equal(hp, fp8)
    model[0].fallback_kernel = "emulated"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emulated = model[0](x)
    exact = (x.bfloat16().float() @ model[0].weight.bfloat16().float().t()).bfloat16()
    assert torch.equal(emulated, exact)
