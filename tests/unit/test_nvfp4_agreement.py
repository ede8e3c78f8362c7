"""The NVFP4 study's last column: whether this scale agrees with the paper, which found each stabiliser helps."""

import numpy as np
import pytest

from lowprec_lab.stats import verdicts
from lowprec_lab.stats.verdict import mark_diverged
from lowprec_lab.studies.nvfp4 import agreement

BASE = np.array([6.50, 6.52, 6.48, 6.51])


def _v(rel: list[float]):
    return verdicts({"r": (BASE * (1 + np.array(rel)), BASE)}, 0.0025, bootstrap=False)["r"]


@pytest.mark.parametrize(
    "rel, expected",
    [
        ([0.010, 0.011, 0.012, 0.010], "agrees: removing it hurt beyond the margin"),
        ([0.0001, -0.0001, 0.0002, 0.0], "disagrees: no harm beyond the margin at this scale"),
        ([0.004, -0.002, 0.006, 0.001], "same direction as the paper (+0.225%), not resolved: "),
        ([-0.004, 0.002, -0.006, 0.003], "opposite direction to the paper (-0.125%), not resolved: "),
    ],
)
def test_each_verdict_against_nvfp4_is_set_against_the_papers_direction(rel, expected):
    got = agreement(_v(rel))
    assert got.startswith(expected), got
    if "not resolved" in expected:
        assert got.endswith(f"{_v(rel).seeds_needed} seeds needed")


def test_a_diverged_run_agrees_and_no_seed_says_so():
    assert agreement(mark_diverged(_v([0.0, 0.0, 0.0, 0.0001]), 1, 4)) == "agrees: a run without it diverged"
    assert agreement(None) == "no paired seed"
