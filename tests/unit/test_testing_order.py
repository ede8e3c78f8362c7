"""The testing order of an ablation's comparisons (lowprec_lab/stats/order.py): controls first, each alone; the
primary comparisons next with the full alpha; the rest last; each stage only where every earlier one was rejected."""

import numpy as np
import pytest
from statsmodels.stats.multitest import multipletests

from lowprec_lab.stats import verdicts
from lowprec_lab.stats.order import CONTROLS_FAILED, PRIMARY_OPEN, TestingOrder, ordered_families

ALPHA = 0.025
NI, INF = 0, 1


def _p(ni: float, inf: float = 0.9, better: float = 0.9, worse: float = 0.9) -> tuple[float, ...]:
    return (ni, inf, better, worse)


def test_a_flat_order_is_one_holm_family_equal_to_statsmodels():
    rng = np.random.default_rng(0)
    pvals = {f"r{i}": tuple(rng.uniform(0, 0.05, 4)) for i in range(5)}
    got = ordered_families(pvals, ALPHA, TestingOrder())
    for j in range(4):
        rej, adj, *_ = multipletests([pvals[k][j] for k in pvals], ALPHA, method="holm")
        assert [got[k].adjusted[j] for k in pvals] == pytest.approx(list(adj), abs=1e-15)
        assert [got[k].reject[j] for k in pvals] == list(rej)
        assert all(got[k].stage_size == 5 and got[k].why[j] is None for k in pvals)


def test_the_primary_gets_the_full_alpha_that_a_flat_family_would_split():
    # the measured DeepSeek-V3 case: its interval inside the margin (p = 0.015), beside six other rows
    pvals = {"primary": _p(0.015), **{f"o{i}": _p(0.5) for i in range(6)}}
    flat = ordered_families(pvals, ALPHA, TestingOrder())
    ordered = ordered_families(pvals, ALPHA, TestingOrder(primary=("primary",)))
    assert not flat["primary"].reject[NI]
    assert ordered["primary"].reject[NI] and ordered["primary"].adjusted[NI] == pytest.approx(0.015)
    assert ordered["primary"].stage_size == 1 and ordered["o0"].stage_size == 6


def test_the_others_are_tested_only_where_the_primary_was_rejected_family_by_family():
    # primary non-inferior (NI rejected) but not inferior: the others may be non-inferior, never inferior
    pvals = {"primary": _p(0.001, inf=0.99), "other": _p(1e-9, inf=1e-9)}
    g = ordered_families(pvals, ALPHA, TestingOrder(primary=("primary",)))["other"]
    assert g.reject[NI] and g.why[NI] is None
    assert not g.reject[INF] and g.why[INF] == PRIMARY_OPEN
    assert g.adjusted[INF] == pytest.approx(0.99)  # the largest adjusted p-value of the stage before it


def test_a_primary_without_a_test_keeps_the_others_closed():
    pvals = {"other": _p(1e-9)}
    g = ordered_families(pvals, ALPHA, TestingOrder(primary=("primary",)))["other"]
    assert not g.reject[NI] and g.why[NI] == PRIMARY_OPEN


@pytest.mark.parametrize(
    "neg, pos, opens",
    [
        (_p(0.001), _p(0.9, inf=0.001), True),  # both passed
        (_p(0.02), _p(0.9, inf=0.02), True),  # each alone at alpha: no correction between the two
        (_p(0.03), _p(0.9, inf=0.001), False),  # the negative control not non-inferior at alpha
        (_p(0.001), _p(0.001, inf=0.03), False),  # the positive control not inferior at alpha
    ],
)
def test_the_controls_are_judged_alone_and_both_must_pass_to_open_the_rest(neg, pos, opens):
    pvals = {"neg": neg, "pos": pos, "a": _p(0.001), "b": _p(0.02)}
    g = ordered_families(pvals, ALPHA, TestingOrder("neg", "pos"))
    assert g["neg"].adjusted == neg and g["pos"].adjusted == pos  # alone: no correction
    assert g["neg"].reject[NI] is (neg[NI] <= ALPHA) and g["pos"].reject[INF] is (pos[INF] <= ALPHA)
    assert g["neg"].stage_size == g["pos"].stage_size == 1
    assert g["a"].reject[NI] is opens
    assert g["a"].why[NI] == (None if opens else CONTROLS_FAILED)
    # Holm over the two recipes, never over the controls: b's 0.02 needs 0.025 at the second step
    assert g["b"].reject[NI] is opens


def test_a_control_without_a_test_keeps_every_recipe_closed():
    g = ordered_families({"pos": _p(0.9, inf=0.0), "a": _p(0.0)}, ALPHA, TestingOrder("neg", "pos"))
    assert not g["a"].reject[NI] and g["a"].why[NI] == CONTROLS_FAILED


def test_the_order_keeps_the_family_wise_error_at_alpha_under_true_nulls():
    # controls that pass, a primary and four others whose non-inferiority hypotheses are all true (p uniform):
    # any false rejection among them must happen at most alpha of the time (serial gatekeeping's guarantee)
    rng = np.random.default_rng(1)
    order = TestingOrder("neg", "pos", primary=("p",))
    trials, any_false = 4000, 0
    for _ in range(trials):
        pvals = {"neg": _p(1e-6), "pos": _p(0.9, inf=1e-6)}
        pvals |= {n: _p(float(rng.uniform())) for n in ("p", "a", "b", "c", "d")}
        g = ordered_families(pvals, ALPHA, order)
        any_false += any(g[n].reject[NI] for n in ("p", "a", "b", "c", "d"))
    assert any_false / trials <= ALPHA + 3 * np.sqrt(ALPHA * (1 - ALPHA) / trials)


def test_verdicts_say_why_a_verdict_the_interval_gives_was_not_tested():
    rng = np.random.default_rng(2)
    ctl = 6.0 + rng.normal(0, 0.01, 6)
    close = ctl * (1 + rng.normal(0.0, 0.0003, 6))  # non-inferior by its interval
    unscaled = ctl * (1 + rng.normal(0.0, 0.0003, 6))  # a "positive control" with no effect: not inferior
    results = {"neg": (close, ctl), "pos": (unscaled, ctl), "fp8": (close * 1.0001, ctl)}
    vs = verdicts(results, 0.0025, order=TestingOrder("neg", "pos"), bootstrap=False)
    assert vs["neg"].verdict == "non-inferior" and vs["neg"].stage == "control"
    assert vs["fp8"].verdict_unadjusted == "non-inferior"
    assert vs["fp8"].verdict == "inconclusive" and vs["fp8"].untested == CONTROLS_FAILED
    assert "tested in order" in vs["fp8"].rule
    flat = verdicts(results, 0.0025, bootstrap=False)
    assert flat["fp8"].verdict == "non-inferior" and flat["fp8"].stage == "" and flat["fp8"].untested is None
