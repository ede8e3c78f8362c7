"""``seeds=auto``'s replay (lowprec_lab/stats/auto_seeds.py) on fixed per-seed results: who gets the next seed, at which
look a recipe stops, and at which confidence level its verdict was taken."""

import numpy as np
import pytest

from lowprec.errors import ConfigError
from lowprec_lab.report.verdict_table import build_table, verdict_section
from lowprec_lab.stats import minimum_detectable_difference, seeds_needed, verdicts
from lowprec_lab.stats.auto_seeds import plan_for, replay, replay_results
from lowprec_lab.tracking.runs import RunData

SEEDS = list(range(8))
MARGIN = 0.0025


def _values(effects: dict[str, list[float]], n: int, control=None) -> dict:
    """Control losses near 5 (seed noise 0.03), each recipe = control * (1 + effect of that seed)."""
    rng = np.random.default_rng(0)
    ctl = control or list(5 + 0.03 * rng.standard_normal(8))
    out = {("bf16", s): ctl[s] for s in range(n)}
    for name, eff in effects.items():
        out.update({(name, s): ctl[s] * (1 + eff[s]) for s in range(min(n, len(eff)))})
    return out


def test_a_clear_recipe_stops_at_the_first_look_and_an_open_one_asks_for_the_next_seed():
    plan = plan_for(8)
    effects = {"fp8_clear": [0.0001, 0.00012, 0.00011], "fp8_open": [0.002, -0.001, 0.004]}
    values = _values(effects, 3)
    state = replay(values, set(values), "bf16", ["fp8_clear", "fp8_open"], SEEDS, plan, MARGIN)
    (look,) = state.looks
    assert look.n == 3 and look.level == pytest.approx(plan.level_at(3))
    assert state.final["fp8_clear"][0].verdict == "non-inferior"
    assert state.final["fp8_clear"][1].reason == "conclusive"
    assert state.final["fp8_open"][0].verdict == "inconclusive" and state.final["fp8_open"][1].more
    assert state.wanting == ["fp8_open"] and state.next_seed == 3
    # the verdict is the Holm verdict at the look's level, over the recipes still running at that look
    pairs = {n: ([values[(n, s)] for s in range(3)], [values[("bf16", s)] for s in range(3)]) for n in effects}
    direct = verdicts(pairs, MARGIN, plan.level_at(3), "holm", bootstrap=False)
    assert {n: v.verdict for n, v in direct.items()} == {n: state.final[n][0].verdict for n in effects}


def test_the_next_look_waits_for_its_seed_and_then_takes_only_the_running_recipes():
    plan = plan_for(8)
    effects = {"fp8_clear": [0.0001, 0.00012, 0.00011], "fp8_open": [0.002, -0.001, 0.004, 0.003]}
    values = _values(effects, 4)
    ran = {k for k in values if not (k[0] == "fp8_clear" and k[1] == 3)}  # the stopped recipe never trains seed 3
    values = {k: v for k, v in values.items() if k in ran}
    state = replay(values, ran, "bf16", ["fp8_clear", "fp8_open"], SEEDS, plan, MARGIN)
    assert [lk.n for lk in state.looks] == [3, 4]
    assert set(state.looks[1].decisions) == {"fp8_open"}
    assert state.final["fp8_open"][0].effect.n == 4 and state.final["fp8_open"][0].level == pytest.approx(
        plan.level_at(4)
    )
    # without the control's seed 3 the look at 4 is not taken yet
    early = {k for k in ran if k != ("bf16", 3)}
    state = replay({k: values[k] for k in early}, early, "bf16", ["fp8_clear", "fp8_open"], SEEDS, plan, MARGIN)
    assert [lk.n for lk in state.looks] == [3] and state.next_seed == 3


def test_an_open_recipe_stops_at_max_seeds():
    plan = plan_for(4)
    effects = {"fp8_open": [0.002, -0.001, 0.004, 0.0025]}
    values = _values(effects, 4)
    state = replay(values, set(values), "bf16", ["fp8_open"], SEEDS, plan, MARGIN)
    verdict, decision = state.final["fp8_open"]
    assert decision.reason == "max_seeds" and not decision.more and verdict.effect.n == 4
    assert state.wanting == [] and state.next_seed is None


def test_a_failed_seed_is_unpaired_and_the_look_still_happens():
    plan = plan_for(8)
    effects = {"fp8_open": [0.002, -0.001, 0.004]}
    values = _values(effects, 3)
    ran = set(values)
    del values[("fp8_open", 1)]  # trained, failed
    state = replay(values, ran, "bf16", ["fp8_open"], SEEDS, plan, MARGIN)
    assert state.final["fp8_open"][0].effect.n == 2 and state.next_seed == 3


def test_bad_plans_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"seeds=auto needs max_seeds >= 3 \(got 2\)"):
        plan_for(2)
    with pytest.raises(ValueError, match="need 8 seeds"):
        replay({}, set(), "bf16", ["x"], SEEDS[:3], plan_for(8), MARGIN)


def test_a_stopped_recipes_mdd_and_seeds_needed_are_stated_at_the_final_analysis_alpha():
    """At the first look's level (one-sided alpha 0.00025 with 3 seeds) the MDD is about ten times the
    one at alpha 0.025; the table states them at the final analysis' alpha."""
    plan = plan_for(8)
    effects = {"fp8_clear": [0.0001, 0.00012, 0.00011], "fp8_open": [0.002, -0.001, 0.004]}
    values = _values(effects, 3)
    state = replay(values, set(values), "bf16", ["fp8_clear", "fp8_open"], SEEDS, plan, MARGIN)
    assert state.final_alpha == plan.final_alpha and 0.015 < plan.final_alpha < 0.025
    for name in effects:
        v = state.final[name][0]
        e = v.effect
        assert v.level == pytest.approx(plan.level_at(3))  # the interval stays the look's
        assert v.mdd == pytest.approx(minimum_detectable_difference(3, e.sd, plan.final_alpha), rel=1e-12)
        assert v.seeds_needed == seeds_needed(e.mean, e.sd, MARGIN, plan.final_alpha)
        assert v.mdd < minimum_detectable_difference(3, e.sd, plan.nominal_alpha(3)) / 5


def _run(recipe: str, seed: int, final: float, late: float):
    """A finished run as the report reads it back: final validation loss and a validation curve whose last quarter
    (steps 75..99 of 100) averages ``late``."""
    curve = [(49, final + 0.1), (79, late - 0.001), (89, late + 0.001), (99, final)]
    return RunData(
        run_id=f"{recipe}-{seed}",
        recipe=recipe,
        seed=seed,
        status="FINISHED",
        reason="",
        comparable=True,
        short=recipe,
        effective={},
        metrics={"final_val_loss": final},
        tokens_per_step=128,
        curves={"val_loss": curve},
    )


def test_the_seeds_auto_table_prints_each_rows_level_and_judges_the_last_quarter_at_it():
    """Under seeds=auto the rows' intervals have different levels (0.9995 at 3 seeds,
    lower later): the header may not say 95%, each row says its level, the rule is not the first row's, MDD is
    labelled with the final analysis' alpha, and the last quarter is judged at the same look and level."""
    effects = {"fp8_clear": [0.0001, 0.00012, 0.00011], "fp8_open": [0.002, -0.001, 0.004, 0.003, 0.001]}
    values = _values(effects, 5)
    ran = {k for k in values if not (k[0] == "fp8_clear" and k[1] >= 3)}
    runs = [_run(r, s, v, v * 1.0002) for (r, s), v in values.items() if (r, s) in ran]
    state = replay_results(
        [(r.recipe, r.seed, r.metrics["final_val_loss"]) for r in runs], "bf16", ["fp8_clear", "fp8_open"], 0, 5, MARGIN
    )
    plan = plan_for(5)
    assert state.final["fp8_open"][1].seeds == 5 and state.final["fp8_clear"][1].seeds == 3
    table = build_table(runs, ["bf16", "fp8_clear", "fp8_open"], "bf16", MARGIN, 100, auto=state)
    text = "\n".join(verdict_section(table, on_cpu=True))
    header = next(line for line in text.splitlines() if line.startswith("| recipe"))
    assert "95% CI" not in header and "[CI at the row's look level]" in header
    rows = {r.recipe: r for r in table.rows}
    for name, n in (("fp8_clear", 3), ("fp8_open", 5)):
        # the full table's row (the compact table above it has the final-loss interval only)
        row = [line for line in text.splitlines() if line.startswith(f"| `{name}`")][-1]
        level = f"({100 * plan.level_at(n):.4g}% CI)"
        assert row.count(level) == 2, row  # the final-loss and the last-quarter interval
        late = rows[name].late
        assert late.level == pytest.approx(plan.level_at(n)) and late.effect.n == n
    assert "two-sided 0.9995" not in text and "at the look's level" in text
    assert f"alpha={plan.final_alpha:.3g} (the one-sided nominal level of the final `seeds=auto` analysis" in text
