"""The stability permutation test beyond its exact-enumeration limit (``MAX_SPLITS``): with 10 runs a side
(C(20, 10) = 184,756 splits) it draws random splits, and its p-value must count the observed split among them,
``(1 + #as extreme) / (1 + MAX_SPLITS)``: never 0, and unbiased for the exact p-value."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lowprec_lab.stats import StabilityMetrics, stability_verdict
from lowprec_lab.stats.stability import MAX_SPLITS, permutation_pvalues, smallest_pvalue


def _run(spikes: int) -> StabilityMetrics:
    return StabilityMetrics(100, spikes, (), 0.0, 0, None, 0, (), 0)


def test_ten_runs_a_side_count_the_observed_split():
    """Every recipe run spikes more than every control run: among 20,000 random splits of 184,756 none is as extreme
    (expected 0.1 copies of the observed one), so p is the observed split's own share, 1 / 20,001, not 0."""
    assert math.comb(20, 10) > MAX_SPLITS
    v = stability_verdict([_run(3)] * 10, [_run(0)] * 10)
    assert v.p == pytest.approx(1 / (MAX_SPLITS + 1), rel=1e-12) and v.verdict == "less stable"
    assert smallest_pvalue(10, 10) == pytest.approx(1 / (MAX_SPLITS + 1))


def test_ten_runs_a_side_monte_carlo_p_matches_the_exact_enumeration():
    """Spike counts drawn with a fixed seed (7): the Monte Carlo p over 20,000 random splits plus the observed one
    is within 4 standard errors (sqrt(p (1 - p) / 20,000)) of the exact p over all 184,756 splits."""
    rng = np.random.default_rng(7)
    recipe = rng.poisson(1.6, 10).astype(float)[:, None]
    control = rng.poisson(1.0, 10).astype(float)[:, None]
    p_mc, _ = permutation_pvalues(recipe, control)
    runs = np.vstack([recipe, control])[:, 0]
    total = runs.sum()
    observed = recipe.sum()
    # the statistic is monotone in the recipe group's sum: count splits whose recipe sum is at least the observed
    sums = np.array([runs[list(c)].sum() for c in itertools.combinations(range(20), 10)])
    exact = float(np.mean(sums >= observed - 1e-9))
    assert total > 0 and 0.005 < exact < 0.5, exact  # a p-value the test can resolve
    assert abs(p_mc - exact) <= 4 * math.sqrt(exact * (1 - exact) / MAX_SPLITS), (p_mc, exact)
