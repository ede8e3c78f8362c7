"""The controls in the report (``ablate controls=true``): a real MLflow sqlite store whose child runs are logged with
known per-seed losses (no training). The control rows are judged by the same rule as every recipe, first and each
alone, and open the recipes' tests only when both pass (lowprec_lab/stats/order.py); they are marked by their role;
the report's first line says whether the experiment could see a difference of the margin."""

from __future__ import annotations

import fabricated_ablation
import pytest
from fabricated_ablation import CONTROL, CONTROL_LOSS, SEEDS, fabricate_ablation
from store_dirs import sqlite_uri

from lowprec_lab.report.build import ReportError, build_report
from lowprec_lab.report.verdict_table import build_table, controls_line, forest_rows
from lowprec_lab.tracking.runs import load_runs
from lowprec_lab.tracking.tracker import Tracker

NEG, POS = "bf16_reordered", "bf16_pure"
#: relative differences to the control by seed: the reordered control within roundings, bf16_pure 2% worse
TINY, WORSE, ZERO = [1e-5, -1e-5, 2e-5, 0.0], [0.020, 0.021, 0.019, 0.022], [0.002, -0.003, 0.001, -0.0005]


def _runs(neg: list[float], pos: list[float]) -> dict[str, dict[int, float]]:
    runs = {CONTROL: dict(zip(SEEDS, CONTROL_LOSS))}
    runs["fp8_rowwise"] = {s: CONTROL_LOSS[s] * (1 + 0.001 * (s - 1.5)) for s in SEEDS}
    runs[NEG] = {s: CONTROL_LOSS[s] * (1 + neg[s]) for s in SEEDS}
    runs[POS] = {s: CONTROL_LOSS[s] * (1 + pos[s]) for s in SEEDS}
    return runs


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # the fabricated runs' throughput is looked up by recipe; the reordered control's is the control's
    fabricated_ablation.TOKENS_PER_S.setdefault(NEG, fabricated_ablation.TOKENS_PER_S[CONTROL])
    root = tmp_path_factory.mktemp("controls")
    tracker = Tracker(sqlite_uri(root / "runs" / "mlflow.db"), "lowprec", root / "runs")
    cases = {"abl-pass": (TINY, WORSE), "abl-flatpos": (TINY, ZERO), "abl-badneg": (WORSE, WORSE)}
    for abl, (neg, pos) in cases.items():
        parent = fabricate_ablation(tracker, abl, _runs(neg, pos), margin=0.0025)
        # what preflight records on the parent run (Plan.params): the resolved names
        tracker.log_params(parent, {"controls": "True", "negative_control": NEG, "positive_control": POS})
    fabricate_ablation(tracker, "abl-off", _runs(TINY, WORSE), margin=0.0025)
    return tracker, root, {}


def _report(store, abl: str) -> str:
    """``report.md`` of ``abl``, built once for the tests that only read it (a build draws every figure, ~4 s)."""
    tracker, root, built = store
    if abl not in built:
        built[abl] = build_report(tracker, abl, root / "reports").read_text()
    return built[abl]


def _first_line(text: str) -> str:
    return text.split("## Verdicts", 1)[1].strip().splitlines()[0]


def test_both_controls_passing_say_so_and_rows_are_marked(store):
    text = _report(store, "abl-pass")
    first = _first_line(text)
    assert first.startswith(
        "**Controls passed at the 0.25% margin**: the negative control `bf16_reordered` came out non-inferior"
    ), first
    assert "the positive control `bf16_pure` came out inferior" in first
    assert "| `bf16_reordered` (negative control) |" in text and "| `bf16_pure` (positive control) |" in text
    assert "Resolution at the 0.25% margin" in text
    html = (store[1] / "reports" / "abl-pass" / "report.html").read_text()
    assert "Controls passed at the 0.25% margin" in html.split("Verdicts", 1)[1][:600]


def test_a_positive_control_with_no_effect_means_the_experiment_could_not_tell(store):
    first = _first_line(_report(store, "abl-flatpos"))
    assert first.startswith(
        "**This experiment could not tell at the 0.25% margin**: the positive control `bf16_pure` came out "
    ), first
    assert first.endswith("its verdicts are not evidence.") and "negative control" not in first


def test_a_negative_control_with_a_large_effect_means_the_experiment_could_not_tell(store):
    first = _first_line(_report(store, "abl-badneg"))
    assert first.startswith(
        "**This experiment could not tell at the 0.25% margin**: the negative control "
        "`bf16_reordered` came out inferior"
    ), first


def test_without_controls_the_first_line_says_so(store):
    first = _first_line(_report(store, "abl-off"))
    assert first.startswith("This experiment ran without controls") and "`controls=true`" in first
    assert "(negative control)" not in _report(store, "abl-off")


def _table(store, abl: str, **kw):
    tracker = store[0]
    parent = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.`lowprec.ablation_id` = '{abl}' and tags.`lowprec.kind` = 'ablation'"
    )[0]
    runs = load_runs(tracker, parent.info.run_id, [])
    return parent, build_table(runs, [CONTROL, "fp8_rowwise", NEG, POS], CONTROL, 0.0025, 100, **kw)


def test_control_rows_are_judged_alone_first_and_the_recipes_after_them(store):
    parent, with_roles = _table(store, "abl-pass", controls=(NEG, POS))
    _, plain = _table(store, "abl-pass")
    ordered, flat = ({r.recipe: r.final for r in t.rows} for t in (with_roles, plain))
    # the same rule and intervals; the controls each alone (no Holm), the recipe in a family without them
    assert all(ordered[n].effect == flat[n].effect and ordered[n].rule != flat[n].rule for n in ordered)
    assert {n: v.n_tests for n, v in ordered.items()} == {"fp8_rowwise": 1, NEG: 1, POS: 1}
    assert {v.n_tests for v in flat.values()} == {3}
    assert [ordered[n].stage for n in ("fp8_rowwise", NEG, POS)] == ["other", "control", "control"]
    assert ordered[NEG].p_noninferior_adj == ordered[NEG].p_noninferior
    assert ordered[POS].p_inferior_adj == ordered[POS].p_inferior
    # the recipe's adjusted p-value is never below the controls' gate
    gate = max(ordered[NEG].p_noninferior, ordered[POS].p_inferior)
    assert ordered["fp8_rowwise"].p_noninferior_adj == max(ordered["fp8_rowwise"].p_noninferior, gate)
    assert controls_line(with_roles).startswith("**Controls passed")
    names = [r.name for r in forest_rows(with_roles)]
    assert names == ["fp8_rowwise", "bf16_reordered (negative control)", "bf16_pure (positive control)"]
    assert parent.data.tags.get("verdict_controls") in (None, "passed")  # the parent's tag once the report ran


def test_when_a_control_fails_no_recipe_verdict_is_tested_and_the_row_says_why(store):
    text = _report(store, "abl-flatpos")
    _, t = _table(store, "abl-flatpos", controls=(NEG, POS))
    v = {r.recipe: r.final for r in t.rows}["fp8_rowwise"]
    assert v.verdict_unadjusted == "non-inferior" and v.verdict == "inconclusive"
    assert v.untested == "the controls did not both come out as they must"
    assert "| `fp8_rowwise` | " in text
    assert "(CI alone: non-inferior; not tested: the controls did not both come out as they must)" in text
    assert "tested in a fixed order stated before the run" in text


def test_a_primary_tag_orders_the_report_and_a_tampered_one_is_refused(store):
    tracker, root, built = store
    parent, _ = _table(store, "abl-pass")
    tracker.client.set_tag(parent.info.run_id, "primary", '["fp8_rowwise"]')
    built.pop("abl-pass", None)  # the tag changes what the report says: built again, not read from the cache
    text = _report(store, "abl-pass")
    assert "then the primary comparison(s) fp8_rowwise (Holm among them)" in text
    for bad in ('["bf16"]', f'["{NEG}"]', '["nope"]', '"fp8_rowwise"', "[1]", "not json"):
        tracker.client.set_tag(parent.info.run_id, "primary", bad)
        with pytest.raises(ReportError, match="primary tag is not a list of this ablation's recipes"):
            build_report(tracker, "abl-pass", root / "reports")
    tracker.client.delete_tag(parent.info.run_id, "primary")
    built.pop("abl-pass", None)
