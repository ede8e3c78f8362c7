"""What the report says beside its numbers, on a fabricated ablation in a real MLflow store:

- a throughput measured while several runs trained at a time is marked as contended next to the number (the
  verdict table's ratio, the summary's tokens/s, the throughput figure), not only in the setup section;
- step 0 of a delayed-scaling run (cast with the initial scale 1.0: 100% grad_output underflow) is left out of the
  telemetry heatmap, and the report says why; a current-scaling run keeps it.
"""

import json

import pytest
from fabricated_ablation import TOKENS_PER_S, fabricate_ablation
from mlflow.entities import Metric
from store_dirs import sqlite_uri

from lowprec.recipes import get_recipe
from lowprec_lab.report.build import build_report, find_ablation
from lowprec_lab.tracking.runs import load_runs
from lowprec_lab.tracking.tracker import PARENT_TAG, Tracker

ABL = "abl-marks"
RUNS = {"bf16": {0: 4.00, 1: 4.05}, "fp8_rowwise": {0: 4.001, 1: 4.049}, "fp8_delayed": {0: 4.002, 1: 4.051}}
LAYER = "fp8/layers.0.attention.wq"
#: What a real fp8_delayed debug run logged (train.telemetry_every=2): step 0 cast with the initial scale.
TELEMETRY = {
    "grad_output/underflow": [(0, 1.0), (50, 0.0), (99, 0.0)],
    "grad_input/sqnr_db": [(0, 0.0), (50, 24.6), (99, 24.7)],
    "output/sqnr_db": [(0, 27.5), (50, 28.5), (99, 28.3)],
    "input/overflow": [(0, 0.0), (50, 0.0), (99, 0.0)],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """``workers -> (tracker, report.md text)``, each ablation fabricated and its report built once for the tests
    that read it (a build draws every figure)."""
    built: dict[int, tuple[Tracker, str]] = {}

    def get(workers: int) -> tuple[Tracker, str]:
        if workers not in built:
            built[workers] = _report(tmp_path_factory.mktemp(f"marks{workers}"), workers)
        return built[workers]

    return get


def _report(tmp_path, workers: int) -> tuple[Tracker, str]:
    tracker = Tracker(sqlite_uri(tmp_path / "mlflow.db"), "lowprec", tmp_path)
    parent = fabricate_ablation(tracker, ABL, RUNS)
    tracker.set_tags(parent, {"workers": str(workers)})
    children = tracker.client.search_runs([tracker.experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'")
    for c in children:
        recipe = c.data.tags["recipe"]
        if recipe == "bf16":
            continue
        tracker.set_tags(c.info.run_id, {"recipe_json": json.dumps(get_recipe(recipe).to_dict())})
        ms = [Metric(f"{LAYER}/{k}", v, 0, s) for k, series in TELEMETRY.items() for s, v in series]
        tracker.client.log_batch(c.info.run_id, metrics=ms)
    return tracker, build_report(tracker, ABL, tmp_path / "reports").read_text()


def _row(text: str, recipe: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| `{recipe}` | 2 | "))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_throughput_measured_under_contention_is_marked_beside_the_number(reports, workers):
    _, text = reports(workers)
    ratio = f"{TOKENS_PER_S['fp8_delayed'] / TOKENS_PER_S['bf16']:.2f}x"
    if workers == 1:
        assert "contended" not in text and f" {ratio} |" in _row(text, "fp8_delayed")
        return
    assert f" {ratio} (contended: 2 runs at a time) |" in _row(text, "fp8_delayed")  # the verdict table
    assert "| tokens/s (contended: 2 runs at a time) |" in text  # the summary's header
    assert "## Throughput (contended: 2 runs at a time)" in text


def test_step_0_of_delayed_scaling_is_left_out_of_the_telemetry_heatmap_and_explained(reports):
    tracker, text = reports(1)
    runs = {r.recipe: r for r in load_runs(tracker, find_ablation(tracker, ABL).info.run_id) if r.seed == 0}
    delayed, rowwise = runs["fp8_delayed"], runs["fp8_rowwise"]
    assert [s for s, _ in delayed.telemetry[f"{LAYER}/grad_output/underflow"]] == [50, 99]
    assert delayed.telemetry_left_out == (0,)
    assert [s for s, _ in rowwise.telemetry[f"{LAYER}/grad_output/underflow"]] == [0, 50, 99]
    assert "`fp8_delayed`: step 0 is left out: delayed scaling" in text
    assert "`fp8_rowwise`: step 0" not in text
