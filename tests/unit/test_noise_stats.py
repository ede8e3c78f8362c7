"""The noise study's statistics (``lowprec_lab.stats.noise``): seeds needed for a zero-gap recipe against the
noncentral t power computed here from scipy alone, and the per-point spreads against numpy on hand-made curves."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from lowprec_lab.stats.noise import last_k_mean, last_k_point, noise_curve, seeds_for_zero_gap

ALPHA, MARGIN, POWER = 0.025, 0.0025, 0.8


def _power(n: int, es: float) -> float:
    """Power of the one-sided one-sample t-test at ALPHA with n observations and standardized effect ``es``:
    P(T > t_{1-alpha, n-1}) with T noncentral t (df n-1, noncentrality es * sqrt(n)) (scipy, not statsmodels)."""
    crit = stats.t.ppf(1 - ALPHA, n - 1)
    return float(stats.nct.sf(crit, n - 1, es * math.sqrt(n)))


@pytest.mark.parametrize("sd", [0.0005, 0.001, 0.0025, 0.004, 0.01])
def test_seeds_for_zero_gap_is_the_smallest_n_with_power(sd):
    n = seeds_for_zero_gap(sd, MARGIN, ALPHA, POWER)
    es = MARGIN / sd
    assert _power(n, es) >= POWER
    assert n == 2 or _power(n - 1, es) < POWER  # the smallest such n
    # and the large-sample closed form ((z_a + z_b) sd / margin)^2 is a lower bound within a few seeds
    z = stats.norm.ppf(1 - ALPHA) + stats.norm.ppf(POWER)
    assert (z / es) ** 2 <= n <= (z / es) ** 2 + 3


def test_seeds_for_zero_gap_known_value_and_edges():
    # sd equal to the margin (effect size 1): 10 seeds at alpha 0.025 one-sided, power 0.8 (noncentral t)
    assert seeds_for_zero_gap(MARGIN, MARGIN, ALPHA) == 10
    assert seeds_for_zero_gap(0.0, MARGIN, ALPHA) == 2  # identical pairs: any two seeds decide
    assert seeds_for_zero_gap(math.nan, MARGIN, ALPHA) is None


def _curves(values: dict[int, list[float]], steps=(1, 3, 5)):
    return {seed: list(zip(steps, v, strict=True)) for seed, v in values.items()}


def test_noise_curve_spreads_are_the_per_seed_ones():
    ctl = {0: [5.0, 4.0, 3.5], 1: [5.2, 4.1, 3.6], 2: [4.9, 3.9, 3.3]}
    neg = {0: [5.0, 4.02, 3.49], 1: [5.2, 4.09, 3.62], 2: [4.9, 3.9, 3.31]}
    neg[3] = [1.0, 1.0, 1.0]  # a seed the control lacks: unpaired, left out
    curve = noise_curve(_curves(ctl), _curves(neg), tokens_per_step=100, margin=MARGIN, alpha=ALPHA)
    assert [p.step for p in curve] == [1, 3, 5] and [p.tokens for p in curve] == [200, 400, 600]
    for i, p in enumerate(curve):
        c = np.array([ctl[s][i] for s in (0, 1, 2)])
        g = np.array([neg[s][i] for s in (0, 1, 2)])
        d = (g - c) / c
        assert p.n == 3
        assert p.control_sd == pytest.approx(c.std(ddof=1)) and p.control_cv == pytest.approx(c.std(ddof=1) / c.mean())
        assert p.paired_sd == pytest.approx(d.std(ddof=1), abs=1e-15)
        assert p.seeds_needed == seeds_for_zero_gap(d.std(ddof=1), MARGIN, ALPHA)
        assert p.seeds_needed_unpaired == seeds_for_zero_gap(math.sqrt(2) * p.control_cv, MARGIN, ALPHA)
    assert curve[0].paired_sd == 0 and curve[0].seeds_needed == 2  # step 1: every pair equal


def test_last_k_point_averages_each_runs_last_points():
    ctl = {0: [5.0, 4.0, 3.5], 1: [5.2, 4.1, 3.6]}
    neg = {0: [5.0, 4.2, 3.4], 1: [5.2, 4.0, 3.7]}
    assert last_k_mean(_curves(ctl)[0], 2) == pytest.approx(3.75)
    assert last_k_mean(_curves(ctl)[0], 9) == pytest.approx(12.5 / 3)  # fewer points than k: all of them
    p = last_k_point(_curves(ctl), _curves(neg), 2, 100, MARGIN, ALPHA)
    c, g = np.array([3.75, 3.85]), np.array([3.8, 3.85])
    assert p.step == 5 and p.paired_sd == pytest.approx(((g - c) / c).std(ddof=1))
    with pytest.raises(ValueError):
        last_k_mean([], 1)


def test_the_noise_study_states_seeds_needed_at_the_reports_one_sided_alpha(tmp_path, monkeypatch):
    """The study (lowprec_lab/studies/noise.py) on hand-made runs: its seeds needed are those of the report's
    one-sided alpha 0.025 (two-sided 95%), computed here by hand from the noncentral t; at alpha 0.05 the same
    paired sd would need fewer, so a study at the wrong level is caught."""
    from types import SimpleNamespace

    from lowprec_lab.studies import noise as study
    from lowprec_lab.tracking.runs import RunData

    ctl = {0: 3.40, 1: 3.43, 2: 3.38, 3: 3.41}
    d = {0: 0.0021, 1: -0.0018, 2: 0.0009, 3: -0.0012}  # paired relative differences: sd about 0.0018
    neg = {s: ctl[s] * (1 + d[s]) for s in ctl}

    def run(recipe, seed, v):
        return RunData(
            run_id=f"{recipe}-{seed}", recipe=recipe, seed=seed, status="FINISHED", reason="", comparable=True,
            short=recipe, effective={}, metrics={"final_val_loss": v}, tokens_per_step=64,
            curves={"val_loss": [(9, v)]},
        )  # fmt: skip

    runs = [run("fp32", s, v) for s, v in ctl.items()] + [run("fp32_reordered", s, v) for s, v in neg.items()]
    train = SimpleNamespace(
        steps=10, batch_size=2, grad_accum=1, seq_len=32, val_every=10, val_batches=1, warmup_steps=0, eval_ema=0.0
    )
    plan = SimpleNamespace(study={}, train=train, model_name="debug", optim=SimpleNamespace(lr=1e-3), device="cpu")
    monkeypatch.setattr(study, "_plan", lambda ctx: plan)
    ctx = SimpleNamespace(
        runs=runs, order=["fp32", "fp32_reordered"], control="fp32", margin=MARGIN, out=tmp_path, ablation_id="abl-x"
    )
    study.noise_study(ctx)
    out = json.loads((tmp_path / "noise.json").read_text())
    c, g = np.array(list(ctl.values())), np.array(list(neg.values()))
    sd = float(((g - c) / c).std(ddof=1))
    es = MARGIN / sd

    def smallest(alpha):  # smallest n with noncentral-t power >= 0.8 at one-sided alpha, by hand
        return next(
            n for n in range(2, 200)
            if stats.nct.sf(stats.t.ppf(1 - alpha, n - 1), n - 1, es * math.sqrt(n)) >= POWER
        )  # fmt: skip

    assert out["alpha"] == pytest.approx(0.025)
    assert out["curve"][0]["seeds_needed"] == smallest(0.025) and out["final"]["last_1"]["seeds_needed"] == smallest(
        0.025
    )
    assert smallest(0.05) < smallest(0.025)  # the level matters at this sd
