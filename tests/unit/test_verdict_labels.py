"""What the verdict table says about a recipe beyond the margin: a diverged run, the labels against 0 (Holm-corrected,
negligible gains), bounds near 0 or the margin, the sign-flip cross-check, the 1-seed stability verdict, and the
``seeds=auto`` fields after a report is re-judged at another margin.

Simulations use fixed seeds and state their tolerances; together they take a few seconds.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from scipy import stats

from lowprec_lab.report.verdict_table import _bound, build_table, parent_records, verdict_section
from lowprec_lab.stats import StabilityMetrics, stability_verdict, verdicts
from lowprec_lab.stats.auto_seeds import replay_results
from lowprec_lab.stats.paired import SIGN_FLIP_RESAMPLES, sign_flip_pvalues
from lowprec_lab.stats.verdict import LABELS, consort_label, mark_diverged, rule_text
from lowprec_lab.tracking.runs import RunData

MARGIN = 0.0025
CONTROL = "bf16"


def _pair(d, base: float = 3.4):
    d = np.asarray(d, dtype=float)
    c = np.full(d.size, base)
    return c * (1 + d), c


def _metrics(diverged: bool = False) -> StabilityMetrics:
    return StabilityMetrics(
        steps=100,
        loss_spikes=0,
        loss_spike_steps=(),
        largest_excursion=0.0,
        nonfinite_loss=int(diverged),
        divergence_step=90 if diverged else None,
        grad_norm_spikes=0,
        nonfinite_grad_norm=0,
    )


def _run(recipe: str, seed: int, final: float | None, *, diverged: bool = False) -> RunData:
    """A run as the report reads it back: finished with ``final`` (validated at steps 79, 89, 99 of 100), or, when
    ``diverged``, FAILED by a NaN loss at step 90 with no final loss."""
    done = not diverged
    curve = [(79, final), (89, final), (99, final)] if done else []
    return RunData(
        run_id=f"{recipe}-{seed}",
        recipe=recipe,
        seed=seed,
        status="FINISHED" if done else "FAILED",
        reason="" if done else "NonFiniteError: loss is nan at step 90",
        comparable=done,
        short=recipe,
        effective={},
        metrics={"final_val_loss": final} if done else {},
        tokens_per_step=128,
        curves={"val_loss": curve},
        stability=_metrics(diverged),
    )


def _row_cells(text: str, recipe: str) -> list[str]:
    """The cells of ``recipe``'s row of the full verdict table (under the compact one, "### Every column")."""
    full = text.split("### Every column", 1)[1]
    (line,) = [ln for ln in full.splitlines() if ln.startswith(f"| `{recipe}` |")]
    return [c.strip() for c in line.strip("|").split("|")]


def _column(text: str, name: str) -> int:
    header = next(ln for ln in text.split("### Every column", 1)[1].splitlines() if ln.startswith("| recipe |"))
    return [c.strip() for c in header.strip("|").split("|")].index(name)


# --- divergence ---------------------------------------------------------------------------------------------------


def test_one_diverged_seed_of_eight_makes_the_row_say_diverged_in_every_draw():
    """A recipe equal to the control in 7 seeds whose 8th diverged: before, its row read non-inferior / as stable in
    about every draw (the diverged seed has no final loss; 1 of 8 diverged is p = 1/2 over runs). 30 draws (seed 3):
    every one must say diverged in the verdict, the last-quarter verdict, the stability column, the tags and the
    section's first line."""
    rng = np.random.default_rng(3)
    order = [CONTROL, "fp8_x"]
    for _ in range(30):
        ctl = 3.4 + 0.01 * rng.standard_normal(8)
        rec = ctl * (1 + 0.0002 * rng.standard_normal(8))
        bad = int(rng.integers(8))
        runs = [_run(CONTROL, s, ctl[s]) for s in range(8)]
        runs += [_run("fp8_x", s, rec[s], diverged=s == bad) for s in range(8)]
        table = build_table(runs, order, CONTROL, MARGIN, 100)
        (row,) = table.rows
        assert row.final.verdict == "diverged" and row.final.label == "diverged"
        assert row.final.verdict_finished == "non-inferior"  # the 7 finished seeds alone
        assert row.late.verdict == "diverged"
        assert row.stability_verdict.verdict == "diverged"  # not "as stable": p = 1/2 cannot call it less stable
        text = "\n".join(verdict_section(table, on_cpu=True))
        # the controls' line opens the section; the divergence is the first thing after it
        first = [x for x in text.split("## Verdicts", 1)[1].strip().splitlines() if x][1]
        assert first.startswith("**Diverged: `fp8_x` in 1 of 8 run(s).**"), first
        cells = _row_cells(text, "fp8_x")
        assert cells[_column(text, "verdict")].startswith("**diverged** (1/8 runs; the 7 paired seed(s) alone: ")
        assert cells[_column(text, "stability vs control")].startswith("**diverged** (diverged in 1/8 runs vs 0/8")
        tags, _ = parent_records(table)
        assert tags["verdict.fp8_x"] == tags["verdict_label.fp8_x"] == "diverged"
        assert tags["verdict_late.fp8_x"] == "diverged" and tags["stability.fp8_x"] == "diverged"


def test_a_recipe_whose_every_run_diverged_is_diverged_not_no_data():
    runs = [_run(CONTROL, s, 3.4 + 0.01 * s) for s in range(3)]
    runs += [_run("fp8_x", s, None, diverged=True) for s in range(3)]
    table = build_table(runs, [CONTROL, "fp8_x"], CONTROL, MARGIN, 100)
    text = "\n".join(verdict_section(table, on_cpu=True))
    assert "**diverged** (3/3 runs; no finished seed to pair)" in _row_cells(text, "fp8_x")
    assert parent_records(table)[0]["verdict.fp8_x"] == "diverged"
    with pytest.raises(ValueError, match="diverged runs must be in"):
        mark_diverged(verdicts({"r": _pair([0.0, 0.001])}, MARGIN)["r"], 3, 2)


# --- labels against 0 -----------------------------------------------------------------------------------------------


def test_superior_is_holm_corrected_across_recipes_equal_to_the_control():
    """Three recipes equal to the control, 5 seeds, paired sd 0.2%: 2000 simulated ablations (seed 11). Unadjusted,
    some recipe reads superior in 1 - 0.975^3 = 7.3% of them (the issue measured 6.2-6.7%); Holm-corrected it must
    be at most 2.5% + 1.0% (about 3 standard errors of 2000 draws), and the unadjusted rate above 5.5% shows the
    simulation can see the difference."""
    rng = np.random.default_rng(11)
    trials, holm_any, plain_any, worse_any = 2000, 0, 0, 0
    for _ in range(trials):
        results = {f"r{i}": _pair(rng.normal(0.0, 0.002, 5)) for i in range(3)}
        out = verdicts(results, MARGIN, bootstrap=False)
        holm_any += any(v.label.startswith("superior") for v in out.values())
        plain_any += any(v.label_unadjusted.startswith("superior") for v in out.values())
        worse_any += any("worse than control" in v.label for v in out.values())
    assert holm_any / trials <= 0.035, holm_any / trials
    assert worse_any / trials <= 0.035, worse_any / trials  # "(worse than control)" is corrected the same way
    assert plain_any / trials >= 0.055, plain_any / trials


#: A Holm family of three: ``below`` and ``above`` are non-inferior by their intervals alone (one wholly below 0,
#: one wholly above) and both demoted by Holm; ``other`` is the third recipe. Neither side against 0 survives Holm
#: (adjusted p 0.058 and 0.033).
DEMOTED = {
    "below": [-0.0115, 0.0021, -0.0099, -0.0151, -0.0094],
    "above": [0.0003, 0.0017, 0.0006, 0.0015, 0.0021],
    "other": [0.001, 0.004, -0.002, 0.006, 0.001],
}


def test_a_holm_demotion_treats_intervals_below_and_above_0_alike():
    """Before: a demoted interval wholly above 0 kept "(worse than control)" while one wholly below 0 lost its
    side. Now each side is its own Holm-corrected family and the label names a side exactly when Holm confirms it."""
    out = verdicts({k: _pair(d) for k, d in DEMOTED.items()}, MARGIN, bootstrap=False)
    for name in ("below", "above"):
        v = out[name]
        assert v.verdict_unadjusted == "non-inferior" and v.verdict == "inconclusive", (name, v)
    assert out["below"].effect.hi < 0 < out["above"].effect.lo
    for v in out.values():
        assert ("better than control" in v.label or v.label.startswith("superior")) == (
            v.effect.hi < 0 and v.p_superior_adj <= 0.025
        )
        assert ("worse than control" in v.label) == (v.effect.lo > 0 and v.p_worse_adj <= 0.025)
    # before: "above" kept "(worse than control)" unconfirmed while "below" was plain
    assert out["below"].label == out["above"].label == "inconclusive"
    # the rule itself is symmetric
    assert consort_label("inconclusive", True, False) == "inconclusive (better than control)"
    assert consort_label("inconclusive", False, True) == "inconclusive (worse than control)"
    with pytest.raises(ValueError, match="both better and worse"):
        consort_label("inconclusive", True, True)


def test_a_negligible_superiority_says_so():
    """The sharded 2-step example: -0.000% [-0.001%, -0.000%] read superior. A gain under a tenth of the margin is
    labelled negligible, and its bounds print with the digits that tell them from 0."""
    tiny = verdicts({"fp8_comm8": _pair([-4e-6, -5e-6, -3e-6, -6e-6])}, MARGIN, correction="none")["fp8_comm8"]
    assert tiny.label == "superior (negligible: under a tenth of the margin)" and tiny.label in LABELS
    real = verdicts({"r": _pair([-0.001, -0.0012, -0.0009, -0.0011])}, MARGIN, correction="none")["r"]
    assert real.label == "superior"
    runs = [_run(CONTROL, s, 3.4) for s in range(4)]
    runs += [_run("fp8_comm8", s, 3.4 * (1 + d)) for s, d in enumerate([-4e-6, -5e-6, -3e-6, -6e-6])]
    text = "\n".join(verdict_section(build_table(runs, [CONTROL, "fp8_comm8"], CONTROL, MARGIN, 100), True))
    cell = _row_cells(text, "fp8_comm8")[2]
    numbers = [float(x) for x in re.findall(r"[-+]\d+\.\d+", cell)]
    assert len(numbers) == 3 and all(x < 0 for x in numbers), cell  # none reads -0.000%


@pytest.mark.parametrize(
    ("x", "shown"),
    [
        (MARGIN - 4e-7, "+0.24996%"),
        (MARGIN + 4e-7, "+0.25004%"),
        (-4e-7, "-0.00004%"),
        (3e-9, "+0.0000003%"),
        (MARGIN, "+0.250%"),
        (0.0, "+0.000%"),
        (0.0123, "+1.230%"),
        (MARGIN - 1e-14, "<+0.250%"),
    ],
)
def test_bounds_near_the_margin_or_0_never_print_equal_to_it(x, shown):
    assert _bound(x, MARGIN) == shown


# --- sign-flip cross-check ------------------------------------------------------------------------------------------


def test_sign_flip_pvalues_enumerate_every_sign_vector():
    d = np.array([0.001, -0.0004, 0.0022, 0.0007, -0.0001])
    z = d - MARGIN
    sums = [np.dot(s, z) for s in itertools.product([1, -1], repeat=5)]
    p_less, p_greater = sign_flip_pvalues(d, MARGIN)
    assert p_less == pytest.approx(np.mean([x <= z.sum() + 1e-15 for x in sums]), abs=1e-12)
    assert p_greater == pytest.approx(np.mean([x >= z.sum() - 1e-15 for x in sums]), abs=1e-12)
    assert p_less == 1 / 32  # every difference below the margin: only the observed signs are as extreme


def test_sign_flip_beyond_16_seeds_counts_the_observed_signs():
    """20 differences all below the margin: no random sign vector is as extreme (2^-20), so the Monte Carlo p is
    exactly the observed one's share, 1 / (1 + resamples), never 0."""
    d = np.full(20, -0.001) + np.linspace(0, 1e-4, 20)
    assert sign_flip_pvalues(d, MARGIN)[0] == pytest.approx(1 / (1 + SIGN_FLIP_RESAMPLES), rel=1e-12)


def test_sign_flip_has_its_level_under_a_symmetric_null():
    """Normal differences centred on the margin, 8 seeds, 3000 draws (seed 5): the sign-flip test declares
    non-inferior in at most 2.5% + 0.8% (about 3 standard errors)."""
    rng = np.random.default_rng(5)
    rate = np.mean([sign_flip_pvalues(rng.normal(MARGIN, 0.002, 8), MARGIN)[0] <= 0.025 for _ in range(3000)])
    assert rate <= 0.033, rate


def test_one_much_worse_seed_makes_the_cross_check_disagree_and_the_report_say_so():
    """Seven seeds 0.3% below the margin and one 0.35% above it: the t-interval ends below the margin
    (non-inferior) because the outlier widens it less than it moves the mean; the exact sign-flip test finds
    9 of the 256 sign vectors as extreme (p = 0.035 > 0.025): inconclusive. The disagreement is in the report."""
    d = np.r_[np.full(7, MARGIN - 0.003) + np.arange(7) * 1e-6, MARGIN + 0.0035]
    v = verdicts({"fp8_x": _pair(d)}, MARGIN, correction="none")["fp8_x"]
    hi = stats.ttest_1samp(d, 0).confidence_interval(0.95).high
    assert hi < MARGIN and v.verdict == "non-inferior"
    assert v.p_noninferior_perm == pytest.approx(9 / 256) and v.verdict_perm == "inconclusive" and v.perm_disagrees
    runs = [_run(CONTROL, s, 3.4) for s in range(8)] + [_run("fp8_x", s, 3.4 * (1 + x)) for s, x in enumerate(d)]
    text = "\n".join(verdict_section(build_table(runs, [CONTROL, "fp8_x"], CONTROL, MARGIN, 100), True))
    start = "- **Sign-flip cross-check disagrees** for `fp8_x` (final_val_loss)"
    (line,) = [ln for ln in text.splitlines() if ln.startswith(start)]
    assert "p=0.0352 (non-inferior)" in line and "**inconclusive**, against the t-interval's **non-inferior**" in line
    # too few seeds for the test to reach alpha: no verdict, hence no disagreement
    few = verdicts({"r": _pair(d[:5])}, MARGIN, correction="none")["r"]
    assert few.verdict_perm is None and not few.perm_disagrees


# --- stability with too few runs ------------------------------------------------------------------------------------


def test_a_one_seed_ablation_says_no_stability_test_is_possible():
    v = stability_verdict([_metrics()], [_metrics()])
    assert v.verdict == "no test possible" and "smallest permutation p-value, 0.5, exceeds 0.05" in v.reason
    runs = [_run(CONTROL, 0, 3.4), _run("fp8_x", 0, 3.401)]
    text = "\n".join(verdict_section(build_table(runs, [CONTROL, "fp8_x"], CONTROL, MARGIN, 100), True))
    cell = _row_cells(text, "fp8_x")[_column(text, "stability vs control")]
    assert cell.startswith("**no test possible**") and "as stable" not in cell
    assert stability_verdict([_metrics()] * 3, [_metrics()] * 3).verdict == "as stable"  # 1/20 can reach 0.05


# --- seeds=auto fields ----------------------------------------------------------------------------------------------


def _auto_runs(effects: dict[str, list[float]], n: int) -> list[RunData]:
    rng = np.random.default_rng(0)
    ctl = 5 + 0.03 * rng.standard_normal(n)
    runs = [_run(CONTROL, s, ctl[s]) for s in range(n)]
    for name, eff in effects.items():
        runs += [_run(name, s, ctl[s] * (1 + eff[s])) for s in range(min(n, len(eff)))]
    return runs


def test_seeds_auto_fields_agree_with_the_statistics_after_rejudging_at_another_margin():
    """An ablation that ran 5 seeds of ``fp8_open`` (inconclusive at 0.25%) re-judged at 1%: the replay stops it at
    an earlier look (4 seeds). The seeds column, the interval and ``verdict/seeds`` must all say 4, not 5; the rule
    tag is the one common to every look; the Holm note names each look's family size; the bootstrap
    cross-check exists."""
    effects = {
        "fp8_open": [0.002, -0.001, 0.004, 0.003, 0.001],
        "fp8_clear": [0.0001, 0.00012, 0.00011],
        "fp8_skew": [0.0001, 0.02, 0.0002, 0.0001, 0.0002],
    }
    runs = _auto_runs(effects, 5)
    names = list(effects)
    margin = 0.01
    state = replay_results(
        [(r.recipe, r.seed, r.metrics["final_val_loss"]) for r in runs], CONTROL, names, 0, 5, margin
    )
    table = build_table(runs, [CONTROL, *names], CONTROL, margin, 100, auto=state)
    text = "\n".join(verdict_section(table, on_cpu=True))
    tags, metrics = parent_records(table)
    rows = {r.recipe: r for r in table.rows}
    for name in names:
        n = rows[name].final.effect.n
        seeds_cell = _row_cells(text, name)[1]
        assert seeds_cell.startswith(f"{n} of {rows[name].runs} (auto:") or seeds_cell.startswith(f"{n} (auto:")
        assert metrics[f"verdict/seeds.{name}"] == n
    n_open = rows["fp8_open"].final.effect.n
    assert n_open < len(rows["fp8_open"].paired) == 5  # stopped earlier at this margin than the ablation did
    assert f"{5 - n_open} later paired seed(s) unused at this margin" in _row_cells(text, "fp8_open")[1]
    assert tags["verdict_rule"] == rule_text(margin, None, "holm", None)  # not the first row's look-specific rule
    assert "at the look's level" in tags["verdict_rule"] and "still running at each look" in tags["verdict_rule"]
    looks = ", ".join(f"{len(lk.verdicts)} recipe(s) at {lk.n} seeds" for lk in state.looks)
    assert f"still running at the look where each stopped ({looks})" in text
    assert all(rows[n].final.effect.boot_lo is not None for n in names)  # the cross-check ran under seeds=auto
    disagree = [n for n in names if rows[n].final.effect.disagree]
    for name in disagree:
        assert f"- Bootstrap cross-check disagrees for `{name}`" in text
    assert disagree, "the skewed recipe's bootstrap interval is off-centre"


def test_mark_diverged_leaves_a_verdict_without_divergence_alone():
    v = verdicts({"r": _pair([0.0, 0.001, -0.001])}, MARGIN)["r"]
    assert mark_diverged(v, 0, 3) is v and v.label_finished is None
    assert math.isclose(mark_diverged(v, 1, 3).effect.mean, v.effect.mean)
