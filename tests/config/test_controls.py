"""``ablate controls=true``: preflight appends a negative and a positive control to the recipes (defaults: the
control with ``compute.reduction_order=reversed`` from the catalog, and ``fp8_unscaled``), carries their roles in the
``Plan`` and the parent run's settings, and refuses in one line, before any run, what it cannot honour."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from lowprec.errors import ConfigError
from lowprec_lab.cli import compose, main
from lowprec_lab.plan.preflight import (
    POSITIVE_CONTROL,
    ablation_controls,
    ablation_recipes,
    default_negative_control,
    preflight,
    saved_plan,
)

DEBUG = ["model=debug", "train.steps=4", "train.batch_size=2", "train.seq_len=64", "device=cpu", "workers=1"]


def _cfg(*overrides: str):
    return compose("ablate", [*DEBUG, *overrides])


def test_defaults_are_the_reordered_control_and_fp8_unscaled():
    assert default_negative_control("bf16") == "bf16_reordered"
    assert default_negative_control("fp32") == "fp32_reordered"
    assert default_negative_control("fp8_tensorwise") is None  # no reordered twin in the catalog
    assert default_negative_control("bf16_reordered") is None  # already reversed
    assert POSITIVE_CONTROL == "fp8_unscaled"


def test_controls_are_appended_once_and_reach_the_plan_and_its_settings(run_dirs):
    cfg = _cfg("recipes=[bf16,fp8_rowwise]", "controls=true")
    assert [r.name for r in ablation_recipes(cfg)] == ["bf16", "fp8_rowwise", "bf16_reordered", "fp8_unscaled"]
    listed = _cfg("recipes=[bf16,fp8_unscaled,fp8_rowwise]", "controls=true")  # already listed: not twice
    assert [r.name for r in ablation_recipes(listed)] == ["bf16", "fp8_unscaled", "fp8_rowwise", "bf16_reordered"]
    plan = preflight(_cfg("recipes=[bf16,fp8_rowwise]", "controls=true", "dry_run=true", *run_dirs))
    assert (plan.negative_control, plan.positive_control) == ("bf16_reordered", "fp8_unscaled")
    assert [r.name for r in plan.recipes] == ["bf16", "fp8_rowwise", "bf16_reordered", "fp8_unscaled"]
    # the parent run's params (Plan.params) and config.yaml name them, resolved: `lowprec report ID` reads them
    params = plan.params(plan.recipes[0])
    assert (params["controls"], params["negative_control"], params["positive_control"]) == (
        "True",
        "bf16_reordered",
        "fp8_unscaled",
    )
    again = saved_plan(plan.config_yaml)
    assert (again.negative_control, again.positive_control) == ("bf16_reordered", "fp8_unscaled")
    assert [r.name for r in ablation_recipes(_cfg("recipes=[bf16,fp8_rowwise]", "controls=false"))] == [
        "bf16",
        "fp8_rowwise",
    ]


def test_named_controls_replace_the_defaults():
    cfg = _cfg("recipes=[fp8_tensorwise,fp8_rowwise]", "controls=true", "negative_control=fp8_current")
    assert ablation_controls(cfg, "fp8_tensorwise") == ("fp8_current", "fp8_unscaled")
    cfg = _cfg("recipes=[fp32,bf16]", "controls=true", "positive_control=fp16_noscale")
    assert ablation_controls(cfg, "bf16") == ("bf16_reordered", "fp16_noscale")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["recipes=[fp8_tensorwise,fp8_rowwise]", "controls=true"],
            "control=fp8_tensorwise has no default negative control",
        ),
        (["recipes=[bf16]", "controls=true", "negative_control=fp9"], "negative_control=fp9 is not a catalog recipe"),
        (["recipes=[bf16]", "controls=true", "positive_control=fp9"], "positive_control=fp9 is not a catalog recipe"),
        (["recipes=[bf16]", "controls=true", "negative_control=bf16"], "negative_control=bf16 is the control itself"),
        (["recipes=[bf16]", "controls=true", "positive_control=bf16"], "positive_control=bf16 is the control itself"),
        (
            ["recipes=[bf16]", "controls=true", "negative_control=fp32", "positive_control=fp32"],
            "negative_control and positive_control are both fp32",
        ),
        (
            ["recipes=[bf16]", "controls=false", "negative_control=fp32"],
            "negative_control=fp32 is set but controls=false",
        ),
        (
            ["recipes=[bf16]", "controls=false", "positive_control=fp32"],
            "positive_control=fp32 is set but controls=false",
        ),
    ],
)
def test_refusals_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        ablation_recipes(_cfg(*overrides))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_refuses_before_any_run(run_dirs, tmp_path, capsys):
    needle = "control=fp8_tensorwise has no default negative control"
    assert main(["ablate", *run_dirs, *DEBUG, "recipes=[fp8_tensorwise,fp8_rowwise]", "controls=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lowprec ablate: error: ") and needle in err, err
    db = tmp_path / "runs" / "mlflow.db"
    if db.exists():
        client = MlflowClient(f"sqlite:///{db}")
        assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
