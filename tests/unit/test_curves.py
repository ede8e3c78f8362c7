"""Relative loss error curves and seed bands (lowprec_lab/stats/curves.py) against numpy and scipy on fixed data."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from lowprec_lab.stats import relative_loss_error, seed_band, t_band, trailing_mean

#: Three seeds x five steps of control and recipe losses (nats), chosen by hand.
CONTROL = {
    0: [4.0, 3.8, 3.6, 3.5, 3.4],
    1: [4.1, 3.9, 3.7, 3.5, 3.3],
    2: [3.9, 3.8, 3.5, 3.4, 3.3],
}
RECIPE = {
    0: [4.02, 3.81, 3.61, 3.52, 3.40],
    1: [4.10, 3.93, 3.70, 3.51, 3.31],
    2: [3.95, 3.80, 3.52, 3.40, 3.32],
}


def _curve(values, steps=None):
    steps = range(len(values)) if steps is None else steps
    return list(zip(steps, values))


def test_trailing_mean_matches_a_loop():
    x = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    want = [np.mean(x[max(0, t - 2) : t + 1]) for t in range(x.size)]
    np.testing.assert_allclose(trailing_mean(x, 3), want, rtol=1e-12)
    np.testing.assert_array_equal(trailing_mean(x, 1), x)
    with pytest.raises(ValueError, match="window"):
        trailing_mean(x, 0)


def test_relative_error_mean_and_band_match_scipy():
    c = relative_loss_error({s: _curve(v) for s, v in RECIPE.items()}, {s: _curve(v) for s, v in CONTROL.items()})
    r, k = np.array([RECIPE[s] for s in (0, 1, 2)]), np.array([CONTROL[s] for s in (0, 1, 2)])
    e = (r - k) / k
    np.testing.assert_allclose(c.per_seed, e, rtol=1e-12)
    np.testing.assert_array_equal(c.steps, np.arange(5))
    assert c.seeds == (0, 1, 2) and c.band == "t" and c.window is None
    np.testing.assert_allclose(c.mean, e.mean(axis=0), rtol=1e-12)
    lo, hi = stats.t.interval(0.95, 2, loc=e.mean(axis=0), scale=stats.sem(e, axis=0))
    np.testing.assert_allclose(c.lo, lo, rtol=1e-10)
    np.testing.assert_allclose(c.hi, hi, rtol=1e-10)
    # the same interval as a one-sample t-test of the per-seed errors at one step
    ci = stats.ttest_1samp(e[:, 2], 0.0).confidence_interval(0.95)
    assert (c.lo[2], c.hi[2]) == pytest.approx((ci.low, ci.high), rel=1e-10)


def test_the_train_loss_is_smoothed_before_the_ratio():
    """Each run is smoothed in step order, whatever order MLflow returned its points in (seed 0: reversed)."""
    recipe = {s: _curve(v) for s, v in RECIPE.items()}
    recipe[0] = recipe[0][::-1]
    c = relative_loss_error(recipe, {s: _curve(v) for s, v in CONTROL.items()}, window=3)
    r = np.array([trailing_mean(RECIPE[s], 3) for s in (0, 1, 2)])
    k = np.array([trailing_mean(CONTROL[s], 3) for s in (0, 1, 2)])
    np.testing.assert_allclose(c.per_seed, (r - k) / k, rtol=1e-12)
    assert c.window == 3


def test_one_seed_gives_the_line_and_no_band():
    c = relative_loss_error({0: _curve(RECIPE[0])}, {0: _curve(CONTROL[0]), 1: _curve(CONTROL[1])})
    assert c.seeds == (0,) and c.lo is None and c.hi is None
    np.testing.assert_allclose(c.mean, (np.array(RECIPE[0]) - CONTROL[0]) / np.array(CONTROL[0]), rtol=1e-12)
    mean, lo, hi = t_band(np.ones((1, 4)))
    assert lo is None and hi is None and mean.shape == (4,)


def test_misaligned_steps_are_paired_by_step_value_and_cut_to_the_common_ones():
    """Seed 0's recipe run logged steps 0, 2, 4, 6 in reverse order; its control 0..6; seed 1 misses step 4 and has
    a NaN at step 2: the curve keeps steps 0 and 6, where every pair has a finite value."""
    recipe = {0: _curve([1.1, 1.2, 1.3, 1.4], [6, 4, 2, 0]), 1: _curve([2.2, float("nan"), 2.6], [0, 2, 6])}
    control = {0: _curve([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 1: _curve([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])}
    c = relative_loss_error(recipe, control)
    np.testing.assert_array_equal(c.steps, [0, 6])
    np.testing.assert_allclose(c.per_seed, [[0.4, 0.1], [0.1, 0.3]], rtol=1e-12)
    assert relative_loss_error({0: _curve([1.0], [3])}, {0: _curve([1.0], [4])}) is None  # no common step
    assert relative_loss_error({5: _curve([1.0])}, {0: _curve([1.0])}) is None  # no common seed


def test_a_nonpositive_control_loss_is_refused():
    with pytest.raises(ValueError, match="control loss <= 0"):
        relative_loss_error({0: _curve([1.0])}, {0: _curve([0.0])})


def test_seed_band_is_the_mean_with_min_and_max_over_seeds():
    b = seed_band({s: _curve(v) for s, v in CONTROL.items()}, window=2)
    x = np.array([trailing_mean(CONTROL[s], 2) for s in (0, 1, 2)])
    np.testing.assert_allclose(b.mean, x.mean(axis=0), rtol=1e-12)
    np.testing.assert_array_equal(b.lo, x.min(axis=0))
    np.testing.assert_array_equal(b.hi, x.max(axis=0))
    assert b.band == "minmax" and b.n == 3
