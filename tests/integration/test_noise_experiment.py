"""``lowprec ablate experiment=noise_quick`` (the noise study, shortened): the fp32 control and its negative control
(and bf16) trained with the same seeds, and the printed curves of seeds-needed against tokens recomputed here from
the MLflow metrics of the runs (not from the study's own numbers)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main
from lowprec_lab.stats.noise import seeds_for_zero_gap


def test_noise_quick_prints_seeds_needed_against_tokens_from_the_runs(run_dirs, tmp_path, capsys):
    assert main(["ablate", "experiment=noise_quick", *run_dirs]) == 0
    out = capsys.readouterr().out
    abl = re.search(r"ablation (abl-[\w-]+) done", out).group(1)
    assert "seeds needed against tokens" in out

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    runs = client.search_runs([exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}'")
    hist = {}
    for r in runs:
        if "recipe" in r.data.tags:
            series = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "val_loss")}
            hist[(r.data.tags["recipe"], int(r.data.tags["seed"]))] = series
            assert r.data.tags["effective_matches"] == "true"
    reordered = json.loads(
        next(r for r in runs if r.data.tags.get("recipe") == "fp32_reordered").data.tags["effective_recipe"]
    )
    assert reordered["reduction_order"] == "reversed"  # the mode ran and the effective recipe says so
    seeds = sorted(s for rec, s in hist if rec == "fp32")
    assert seeds == [0, 1] and sorted(s for rec, s in hist if rec == "fp32_reordered") == seeds
    steps = sorted(hist[("fp32", 0)])
    assert steps == [1, 3, 5, 7]  # validation after every 2nd step: the whole curve

    lines = out.splitlines()
    rows = [line for line in lines if line.startswith("| step ")]
    assert len(rows) == 2 * len(steps)  # the negative control's curve, then bf16's against the control
    assert lines.index("bf16 vs fp32 along the run:") < lines.index(rows[len(steps)])
    tokens_per_step = 4 * 64
    for i, line in enumerate(rows):
        s, arm = steps[i % len(steps)], ("fp32_reordered", "bf16")[i // len(steps)]
        cells = [c.strip() for c in line.strip("|").split("|")]
        c = np.array([hist[("fp32", seed)][s] for seed in seeds])
        g = np.array([hist[(arm, seed)][s] for seed in seeds])
        d = (g - c) / c
        assert cells[0] == f"step {s + 1}" and cells[1] == f"{(s + 1) * tokens_per_step:,}" and cells[2] == "2"
        assert cells[4] == f"{c.std(ddof=1):.4f}"
        assert cells[5] == f"{100 * c.std(ddof=1) / c.mean():.3g}%"
        assert cells[6] == f"{100 * d.std(ddof=1):.3g}%"
        assert cells[8] == str(seeds_for_zero_gap(d.std(ddof=1), 0.0025, 0.025))
    # the reversed order changed the roundings (paired differences not all zero) and only them
    final = np.array([hist[("fp32_reordered", s)][7] / hist[("fp32", s)][7] - 1 for s in seeds])
    assert np.any(final != 0) and np.all(np.abs(final) < 1e-4)

    data = json.loads((tmp_path / "reports" / abl / "noise.json").read_text())
    assert [p["tokens"] for p in data["curve"]] == [(s + 1) * tokens_per_step for s in steps]
    assert set(data["final"]) == {"last_1", "last_2", "bf16 vs fp32 last 1", "bf16 vs fp32 last 2"}
    assert math.isclose(data["final"]["bf16 vs fp32 last 1"]["paired_sd"], data["others"]["bf16"][-1]["paired_sd"])
    assert math.isclose(data["final"]["last_1"]["paired_sd"], data["curve"][-1]["paired_sd"])
    assert "## Along the run" in (tmp_path / "reports" / abl / "noise.md").read_text()


@pytest.mark.slow  # ~22 s, a second ablation; the EMA itself: tests/integration/test_eval_ema.py (~5 s)
def test_noise_quick_with_eval_ema_reports_the_ema_estimator_from_the_runs(run_dirs, tmp_path, capsys):
    """train.eval_ema: the same runs give the EMA estimator's paired sd and seeds needed beside the plain one,
    recomputed here from the runs' ``val_loss_ema`` metrics in MLflow."""
    assert main(["ablate", "experiment=noise_quick", "train.eval_ema=0.9", "seeds=2", *run_dirs]) == 0
    out = capsys.readouterr().out
    abl = re.search(r"ablation (abl-[\w-]+) done", out).group(1)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    runs = client.search_runs([exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}'")
    ema, plain = {}, {}
    for r in runs:
        if "recipe" in r.data.tags:
            key = (r.data.tags["recipe"], int(r.data.tags["seed"]))
            ema[key] = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "val_loss_ema")}
            plain[key] = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "val_loss")}
            assert r.data.metrics["final_val_loss_ema"] == ema[key][7]
    data = json.loads((tmp_path / "reports" / abl / "noise.json").read_text())
    assert "ema" in data["final"] and "bf16 vs fp32 ema" in data["final"]
    assert [p["step"] for p in data["ema_curve"]] == [1, 3, 5, 7]
    for name, arm in (("ema", "fp32_reordered"), ("bf16 vs fp32 ema", "bf16")):
        c = np.array([ema[("fp32", s)][7] for s in (0, 1)])
        g = np.array([ema[(arm, s)][7] for s in (0, 1)])
        d = (g - c) / c
        assert math.isclose(data["final"][name]["paired_sd"], d.std(ddof=1), rel_tol=1e-9, abs_tol=1e-15)
        assert data["final"][name]["seeds_needed"] == seeds_for_zero_gap(d.std(ddof=1), 0.0025, 0.025)
        dp = np.array([plain[(arm, s)][7] / plain[("fp32", s)][7] - 1 for s in (0, 1)])
        assert not np.array_equal(d, dp)  # the EMA is another estimator, not the plain value again
    row = next(line for line in out.splitlines() if line.startswith("| bf16 vs fp32 ema "))
    assert row.split("|")[7].strip() == f"{100 * data['final']['bf16 vs fp32 ema']['paired_sd']:.3g}%"
    assert "## EMA of the weights" in (tmp_path / "reports" / abl / "noise.md").read_text()
