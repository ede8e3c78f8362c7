"""The report's FP8 telemetry heatmap draws runs whose telemetry holds infinite values: unscaled FP8 casts flush
whole gradients to zero, whose SQNR against an equally zero reference is +inf, stored by MLflow as the largest
float; such a value left the colour scale no range (matplotlib raised OverflowError and the ablation's report was
lost)."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import matplotlib.image

from lowprec_lab.report.plots import telemetry_heatmap


def test_a_heatmap_with_infinite_and_nan_cells_is_drawn(tmp_path):
    layer = "layers.0.attention.wq"
    run = SimpleNamespace(
        recipe="fp8_unscaled",
        seed=0,
        telemetry={
            # as MLflow reads +inf back, beside a real inf and a NaN
            f"fp8/{layer}/grad_input/sqnr_db": [(0, 0.4), (10, sys.float_info.max), (20, float("nan"))],
            "fp8/layers.1.attention.wq/grad_input/sqnr_db": [(0, 12.0), (10, float("inf")), (20, 5.0)],
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing printed under the report either (an overflow scaling the mask)
        path = telemetry_heatmap(run, [("grad_input", "sqnr_db")], tmp_path / "t.png")
    assert matplotlib.image.imread(path).shape[0] > 100  # a real PNG
