"""The report's first screen: the one-line summary (conclusive count, seeds needed, the measured cause, diverged
recipes first), the advice to add seeds, the forest plot and the compact verdict table that fits 1280 px, from
runs built in memory (``RunData``, as the report reads them back) and the real verdict code."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from lowprec_lab.report import plots
from lowprec_lab.report.verdict_table import (
    add_seeds_line,
    build_table,
    forest_rows,
    seeds_mapping,
    summary_line,
    verdict_section,
)
from lowprec_lab.stats import StabilityMetrics
from lowprec_lab.tracking.runs import RunData

MARGIN = 0.0025
CONTROL = "bf16"
CONTROL_LOSS = [3.40, 3.43, 3.38]


def _stab(diverged: bool = False) -> StabilityMetrics:
    return StabilityMetrics(100, 0, (), 0.0, int(diverged), 90 if diverged else None, 0, 0)


def _run(recipe: str, seed: int, final: float | None, anomalies=()) -> RunData:
    """A finished run with final validation loss ``final``; None: FAILED by a NaN loss (diverged)."""
    done = final is not None
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
        curves={"val_loss": [(99, final)] if done else []},
        stability=_stab(not done),
        anomalies=list(anomalies),
    )


def _ablation(effects: dict[str, list[float | None]], anomalies: dict | None = None):
    """Runs of the control and of each recipe: seed s of a recipe is the control's loss times 1 + effects[s]."""
    anomalies = anomalies or {}
    runs = [_run(CONTROL, s, c, anomalies.get((CONTROL, s), ())) for s, c in enumerate(CONTROL_LOSS)]
    for name, ds in effects.items():
        for s, d in enumerate(ds):
            loss = None if d is None else CONTROL_LOSS[s] * (1 + d)
            runs.append(_run(name, s, loss, anomalies.get((name, s), ())))
    order = [CONTROL, *effects]
    return runs, build_table(runs, order, CONTROL, MARGIN, 100)


NOISY = {"fp8_a": [0.001, 0.006, -0.003], "fp8_b": [0.004, -0.002, 0.007], "fp8_c": [0.0, 0.003, -0.004]}


def test_the_summary_counts_the_conclusive_recipes_and_states_seeds_needed_and_the_measured_cause():
    runs, t = _ablation(NOISY)
    line = summary_line(t, runs)
    needed = sorted(r.final.seeds_needed for r in t.rows)
    assert all(r.final.verdict == "inconclusive" for r in t.rows)
    assert line.startswith(f"**0 of 3 recipes conclusive at 0.25%**; {needed[0]}-{needed[-1]} seeds needed (3 ran); ")
    sds = sorted(100 * r.final.effect.sd for r in t.rows)
    assert f"cause: paired sd {sds[0]:.3g}-{sds[-1]:.3g}% of the loss, so 95% intervals of ±" in line, line
    assert "wider than the margin" in line and "\n" not in line
    advice = add_seeds_line(t)
    assert all(f"`{r.recipe}` {r.final.seeds_needed}" in advice for r in t.rows)
    # within 10x its 3 seeds: a count to rerun with; beyond: out of reach, with the measured reason
    rows = {r.recipe: r for r in t.rows}
    near = [r for r in t.rows if r.final.seeds_needed <= 30]
    assert [r.recipe for r in near] == ["fp8_c"] and rows["fp8_a"].final.seeds_needed > 30
    assert advice.startswith(f"**Add seeds:** rerun with `'seeds={{others: 3, fp8_c: {near[0].final.seeds_needed}}}'`")
    for name in ("fp8_a", "fp8_b"):
        v = rows[name].final
        gap = abs(v.effect.mean - MARGIN)
        assert (
            f"**Out of reach at this scale:** `{name}` needs {v.seeds_needed} seeds, {v.seeds_needed / 3:.0f}x the 3 "
            f"it ran: its mean ({100 * v.effect.mean:+.3f}%) lies {100 * gap:.3g}% from the margin, "
            f"{gap / v.effect.sd:.2g} of its paired sd"
        ) in advice, advice
    # what the advice costs: fp8_c's seeds, the control's as many, the others' 3 each, against the 12 trained
    need = 2 * near[0].final.seeds_needed + 3 + 3
    assert f"That is about {need} runs against the 12 this ablation trained ({need / 12:.1f}x its " in advice


def test_the_advice_names_every_count_that_differs_from_the_most_common_one_quoted_for_a_shell():
    counts = {"fp8_tensorwise": 4, "fp8_rowwise": 3, "fp8_blockwise": 9, "bf16_reordered": 7, "fp8_unscaled": 3}
    assert seeds_mapping(counts) == "'seeds={others: 3, fp8_tensorwise: 4, fp8_blockwise: 9, bf16_reordered: 7}'"
    assert seeds_mapping({"a": 5, "b": 5}) == "'seeds={others: 5}'"
    assert seeds_mapping({"a": 4, "b": 6}) == "'seeds={others: 4, b: 6}'"  # a tie: the smaller is others


def test_a_diverged_recipe_is_named_first_and_a_conclusive_one_has_no_advice():
    tight = [0.0001, -0.0001, 0.0002]
    runs, t = _ablation({"fp8_ok": tight, "fp8_bad": [0.0, None, 0.0001]})
    line = summary_line(t, runs)
    assert line.startswith("**Diverged: `fp8_bad` in 1 of 3 run(s).** **1 of 2 recipes conclusive at 0.25%** "), line
    assert "(`fp8_ok` non-inferior)" in line and "seeds needed" not in line and "cause" not in line
    assert add_seeds_line(t) is None
    rows = {r.name: r for r in forest_rows(t)}
    assert rows["fp8_bad"].kind == "diverged" and rows["fp8_bad"].label.startswith("diverged (1/3 runs)")
    assert rows["fp8_ok"].kind == "non-inferior" and rows["fp8_ok"].lo < rows["fp8_ok"].mean < rows["fp8_ok"].hi


def test_anomaly_events_of_the_open_recipes_are_a_cause_beside_the_lr_warmup_and_are_escaped():
    event = {"step": 21, "kind": "loss_spike", "value": 5.1, "threshold": 4.0, "action": "recorded"}
    odd = {"step": 30, "kind": "![x](/etc/passwd)|", "action": "recorded"}
    runs, t = _ablation(NOISY, {("fp8_a", 1): [event], (CONTROL, 2): [event, odd]})
    line = summary_line(t, runs, warmup=20)
    assert "anomaly events in their runs or the control's: 2 loss\\_spike, 1 \\!\\[x\\](/etc/passwd)\\|" in line
    assert "at steps 21-30 (LR warmup ends at step 20)" in line, line
    assert "![x]" not in line


def test_the_section_leads_with_summary_advice_forest_and_compact_table_then_every_column():
    runs, t = _ablation(NOISY)
    text = "\n".join(verdict_section(t, True, runs, forest="verdict_forest.png"))
    order = [
        "## Verdicts",
        "**0 of 3 recipes conclusive",
        "**Add seeds:**",
        "![verdicts at the margin](verdict_forest.png)",
        "| recipe | final val loss vs control [95% CI] | verdict | seeds needed | stability |",
        "### Every column",
        "| recipe | seeds | final val loss vs control [95% CI] | verdict |",
        "**Noise floor:**",
        "- Relative difference d = (recipe - control) / control",
    ]
    at = [text.index(s) for s in order]
    assert at == sorted(at), list(zip(order, at))
    r = t.rows[0]
    compact = next(ln for ln in text.splitlines() if ln.startswith(f"| `{r.recipe}` |"))
    assert compact.endswith(f"| **inconclusive** | {r.final.seeds_needed} (3 ran) | **as stable** |"), compact


def test_the_forest_plot_draws_every_recipe_and_a_name_from_the_store_as_typed(tmp_path):
    runs, t = _ablation({**NOISY, "fp8_$\\frac{1}{$": [0.001, 0.002, 0.0015]})
    path = plots.verdict_forest(forest_rows(t), MARGIN, CONTROL, "95%", tmp_path / "verdict_forest.png")
    width, height = Image.open(path).size
    assert 900 <= width <= 1100 and height < 450  # fits the first screen of a 1280 px page beside the summary
    assert plots.plot_text("a$b\nc") == "a\\$b c"
    with pytest.raises(ValueError):  # unescaped, matplotlib would parse the name as mathtext and fail to draw
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.set_title("fp8_$\\frac{1}{$")
        try:
            fig.savefig(tmp_path / "x.png")
        finally:
            plt.close(fig)
    assert np.isfinite([r.mean for r in forest_rows(t)]).all()
