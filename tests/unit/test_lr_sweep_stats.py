"""The learning-rate study's rows and its choice (lowprec_lab/stats/lr_sweep.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lowprec_lab.stats.lr_sweep import WITHIN_BEST, choose, rank, sweep_row
from lowprec_lab.stats.noise import seeds_for_zero_gap

M, A = 0.0025, 0.025


def _row(lr, losses, spikes=None, pair=None):
    spikes = spikes or {s: (0, 0, False) for s in losses}
    pair = pair if pair is not None else {s: v * 1.001 for s, v in losses.items()}
    return sweep_row({"optim.lr": lr}, losses, spikes, "fp32", pair, M, A)


def test_a_row_summarises_the_control_and_the_pair():
    r = sweep_row(
        {"optim.lr": 0.003},
        {0: 6.0, 1: 6.2, 2: float("nan")},
        {0: (1, 0, False), 1: (0, 2, False), 2: (0, 0, True)},
        "fp32",
        {0: 6.06, 1: 6.2, 2: 7.0},
        M,
        A,
    )
    d = np.array([0.01, 0.0])
    assert (
        r.seeds == 2
        and r.runs == 3
        and math.isclose(r.loss_mean, 6.1)
        and math.isclose(r.loss_sd, np.std([6.0, 6.2], ddof=1))
    )
    assert r.spiking_runs == 2 and r.loss_spikes == 1 and r.grad_spikes == 2 and r.diverged == 1
    assert r.pairs == 2 and math.isclose(r.paired_mean, d.mean()) and math.isclose(r.paired_sd, d.std(ddof=1))
    assert r.seeds_needed == seeds_for_zero_gap(d.std(ddof=1), M, A)
    assert not r.stable


def test_the_choice_is_the_smallest_paired_sd_among_stable_points_near_the_best():
    low = _row(0.001, {0: 6.50, 1: 6.50}, pair={0: 6.50, 1: 6.50})  # 1.6% above the best: undertrained
    best = _row(0.006, {0: 6.40, 1: 6.40}, spikes={0: (1, 0, False), 1: (0, 0, False)})  # best loss, but spiked
    good = _row(0.003, {0: 6.45, 1: 6.45}, pair={0: 6.46, 1: 6.451})  # 0.78% above the best, no spike
    rows, chosen = rank([low, best, good])
    assert chosen is not None and chosen.point == {"optim.lr": 0.003} and chosen.chosen
    assert [r.chosen for r in rows] == [False, False, True]
    assert math.isclose(rows[2].gap_to_best, 0.05 / 6.40)
    assert rows[1].gap_to_best == 0.0 and not rows[1].stable


@pytest.mark.parametrize("gap, ok", [(WITHIN_BEST, True), (WITHIN_BEST * 1.001, False)])
def test_within_one_percent_is_the_boundary(gap, ok):
    best = _row(0.006, {0: 6.0, 1: 6.0}, spikes={0: (1, 0, False), 1: (0, 0, False)})
    near = _row(0.003, {0: 6.0 * (1 + gap), 1: 6.0 * (1 + gap)})
    _, chosen = rank([best, near])
    assert (chosen is not None) is ok


def test_grad_norm_spikes_are_counted_but_do_not_disqualify():
    """The detector flags grad-norm spikes at every learning rate of the tiny sweep, pairs agreeing or not: only
    loss spikes and divergence make a point unstable."""
    grad = _row(0.003, {0: 6.0, 1: 6.0}, spikes={0: (0, 3, False), 1: (0, 0, False)})
    loss = _row(0.003, {0: 6.0, 1: 6.0}, spikes={0: (1, 0, False), 1: (0, 0, False)})
    div = _row(0.003, {0: 6.0, 1: 6.0}, spikes={0: (0, 0, True), 1: (0, 0, False)})
    assert grad.stable and grad.spiking_runs == 1 and grad.grad_spikes == 3
    assert not loss.stable and not div.stable


def test_no_point_qualifies_when_every_stable_point_is_undertrained():
    best = _row(0.006, {0: 6.0, 1: 6.0}, spikes={0: (1, 0, False), 1: (1, 0, False)})
    low = _row(0.001, {0: 6.5, 1: 6.5})
    assert rank([best, low])[1] is None
    assert choose([]) is None
