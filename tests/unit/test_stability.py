"""Loss-stability metrics (``experiments.stats.stability``): spikes against a lagged EMA with a trailing robust sd,
largest excursion, non-finite events, divergence, and the per-recipe stability verdict.

Synthetic series with a known answer: a decaying loss curve with noise, with spikes, NaNs or a blow-up injected at
chosen steps. The EMA is checked against ``scipy.signal.lfilter`` and the robust sd against a plain loop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.signal import lfilter

from experiments.stats import SpikeRule, StabilityMetrics, scan_spikes, stability_metrics, stability_verdict
from experiments.stats.stability import divergence_step, ema_previous

SPIKES_AT = (100, 200, 300)


def _loss(steps=400, noise=0.02, seed=0):
    """A pretraining-like loss curve: fast descent from ~9 nats to a 2-nat floor, Gaussian noise per step."""
    t = np.arange(steps)
    return 2.0 + 7.0 * np.exp(-t / 30) + np.random.default_rng(seed).normal(0, noise, steps)


def _grad_norm(steps=400, seed=1):
    t = np.arange(steps)
    return 1.0 + 0.5 * np.exp(-t / 50) + np.random.default_rng(seed).normal(0, 0.05, steps)


def test_ema_is_the_span_convention_of_previous_steps():
    x = _loss(50)
    w = 20
    a = 2 / (w + 1)
    ref, _ = lfilter([a], [1, -(1 - a)], x, zi=[(1 - a) * x[0]])  # y_0 = x_0, y_t = a x_t + (1 - a) y_{t-1}
    ema = ema_previous(x, w)
    assert math.isnan(ema[0])
    np.testing.assert_allclose(ema[1:], ref[:-1], rtol=1e-14)


def test_nonfinite_values_leave_the_ema_unchanged():
    x = np.array([1.0, 2.0, math.nan, math.inf, 3.0])
    a = 2 / 3
    e1 = a * 2 + (1 - a) * 1
    np.testing.assert_allclose(ema_previous(x, 2), [math.nan, 1.0, e1, e1, e1])


def test_three_injected_spikes_give_exactly_three():
    x = _loss()
    x[list(SPIKES_AT)] += 0.5  # 25 noise sd above the curve
    m = stability_metrics(x)
    assert m.loss_spikes == 3 and m.loss_spike_steps == SPIKES_AT
    assert m.divergence_step is None and m.nonfinite_loss == 0 and not m.diverged
    ema = ema_previous(x, 20)
    assert m.largest_excursion == pytest.approx(max((x[t] - ema[t]) / ema[t] for t in SPIKES_AT), rel=1e-12)
    assert 0.2 < m.largest_excursion < 0.3


@pytest.mark.parametrize("seed", range(5))
def test_noisy_smooth_curves_have_no_spikes(seed):
    m = stability_metrics(_loss(seed=seed), _grad_norm(seed=seed + 10))
    assert m.loss_spikes == 0 and m.grad_norm_spikes == 0
    assert m.largest_excursion < 0.05


def test_k_sets_the_threshold():
    x = _loss()
    x[200] += 0.13  # about 6.5 noise sd
    assert stability_metrics(x).loss_spike_steps == (200,)  # default k = 5
    assert stability_metrics(x, rule=SpikeRule(k=8)).loss_spikes == 0


def test_robust_sd_is_mad_of_trailing_differences():
    x = _loss()
    x[70] = math.nan
    scan = scan_spikes(x, SpikeRule(sd_window=50, min_history=10))
    for t in (5, 10, 11, 60, 100, 399):
        prev = np.array([x[s] - x[s - 1] for s in range(max(1, t - 50), t)])
        prev = prev[np.isfinite(prev)]  # the two differences next to the NaN drop out
        if prev.size < 10:
            assert math.isnan(scan.robust_sd[t])
        else:
            mad = np.median(np.abs(prev - np.median(prev)))
            assert scan.robust_sd[t] == pytest.approx(1.4826 * mad / math.sqrt(2), rel=1e-12)
    assert np.isnan(scan.robust_sd[:11]).all() and not scan.spike[:11].any()  # burn-in: differences start at step 1
    # It measures the noise (sd 0.02) even during fast descent, where the residuals drift with the EMA's lag.
    r = scan.residual[50:100]
    assert scan.robust_sd[100] == pytest.approx(0.02, rel=0.2)
    assert 1.4826 * np.nanmedian(np.abs(r - np.nanmedian(r))) > 5 * 0.02


def test_nan_to_the_end_is_divergence_at_that_step():
    x = _loss()
    x[150:] = math.nan
    m = stability_metrics(x)
    assert m.divergence_step == 150 and m.diverged and m.nonfinite_loss == 250
    assert m.as_metrics()["stability/divergence_step"] == 150.0
    x = _loss()[:151]
    x[150] = math.inf  # the run stopped at its first non-finite loss
    assert stability_metrics(x).divergence_step == 150


def test_an_isolated_nan_is_a_nonfinite_event_not_divergence():
    x = _loss()
    x[150] = math.nan
    x[list(SPIKES_AT)] += 0.5
    m = stability_metrics(x)
    assert m.divergence_step is None and m.nonfinite_loss == 1
    assert m.loss_spike_steps == SPIKES_AT  # the NaN neither hides nor creates spikes


def test_blow_up_above_the_factor_is_divergence():
    x = _loss()
    x[300:] = np.linspace(14, 30, 100)  # above 1.5 x the first loss (9.0) from step 300 on
    assert stability_metrics(x).divergence_step == 300
    y = _loss()
    y[100] = 20.0  # one huge spike that recovers: a spike, not divergence
    m = stability_metrics(y)
    assert m.divergence_step is None and 100 in m.loss_spike_steps
    assert divergence_step(np.full(5, math.nan)) == 0
    assert divergence_step(x, factor=10.0) is None


def test_grad_norm_spikes():
    g = _grad_norm()
    g[[120, 250]] *= 5
    m = stability_metrics(_loss(), g, skipped_steps=7)
    assert m.grad_norm_spikes == 2 and m.grad_norm_spike_steps == (120, 250) and m.loss_spikes == 0
    metrics = m.as_metrics()
    assert metrics == {
        "stability/loss_spikes": 0.0,
        "stability/loss_max_excursion": m.largest_excursion,
        "stability/loss_nonfinite": 0.0,
        "stability/diverged": 0.0,
        "stability/skipped_steps": 7.0,
        "stability/grad_norm_spikes": 2.0,
        "stability/grad_norm_nonfinite": 0.0,
    }
    assert all(isinstance(v, float) for v in metrics.values())
    assert "stability/grad_norm_spikes" not in stability_metrics(_loss()).as_metrics()


@pytest.mark.parametrize(
    "kwargs", [{"ema_window": 0}, {"k": 0}, {"k": math.inf}, {"min_history": 2}, {"divergence_factor": 1.0}]
)
def test_bad_rule(kwargs):
    with pytest.raises(ValueError):
        SpikeRule(**kwargs)


def test_bad_series():
    with pytest.raises(ValueError, match="non-empty 1-D"):
        stability_metrics([])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        stability_metrics(np.ones((3, 3)))


# --- stability verdict ------------------------------------------------------------------------------------------


def _run(spikes=0, diverged=False, grad=None):
    return StabilityMetrics(
        steps=200,
        loss_spikes=spikes,
        loss_spike_steps=(),
        largest_excursion=0.0,
        nonfinite_loss=0,
        divergence_step=100 if diverged else None,
        grad_norm_spikes=grad,
        nonfinite_grad_norm=None if grad is None else 0,
    )


def test_divergence_makes_a_recipe_less_stable():
    v = stability_verdict([_run(), _run(diverged=True), _run()], [_run()] * 3)
    assert v.verdict == "less stable" and "diverged in 1/3" in v.reason
    assert v.diverged == (1, 3) and v.control_diverged == (0, 3)
    # The control diverging as often: not less stable.
    assert stability_verdict([_run(diverged=True), _run()], [_run(), _run(diverged=True)]).verdict == "as stable"


def test_spike_rate_uses_the_exact_conditional_test():
    control = [_run()] * 3
    v = stability_verdict([_run(2)] * 3, control)  # 6 spikes vs 0: p = 0.5**6
    assert v.verdict == "less stable" and v.p_loss_spikes == pytest.approx(0.5**6)
    v = stability_verdict([_run(2), _run(2), _run(0)], control)  # 4 vs 0: p = 0.0625
    assert v.verdict == "as stable" and v.p_loss_spikes == pytest.approx(0.5**4)
    # One spike against none is noise, not instability.
    assert stability_verdict([_run(1), _run(), _run()], control).verdict == "as stable"
    # Unequal run counts: under equal rates a spike falls on the recipe with probability 2 / 6.
    v = stability_verdict([_run(3), _run(2)], [_run()] * 4)
    assert v.p_loss_spikes == pytest.approx((1 / 3) ** 5)
    assert stability_verdict([_run()] * 3, control).p_loss_spikes is None


def test_grad_norm_spikes_with_bonferroni():
    control = [_run(grad=0)] * 3
    v = stability_verdict([_run(grad=2)] * 3, control)  # p = 0.5**6 = 0.016 < 0.05 / 2
    assert v.verdict == "less stable" and "grad-norm" in v.reason
    v = stability_verdict([_run(5, grad=0), _run(grad=0), _run(grad=0)], control)  # loss p = 0.031 > 0.025
    assert v.verdict == "as stable" and v.p_loss_spikes == pytest.approx(0.5**5)
    assert stability_verdict([_run(5), _run(), _run()], [_run()] * 3).verdict == "less stable"  # alone: < 0.05


def test_verdict_needs_runs():
    with pytest.raises(ValueError, match="at least one"):
        stability_verdict([], [_run()])
    with pytest.raises(ValueError, match="alpha"):
        stability_verdict([_run()], [_run()], alpha=1.5)
