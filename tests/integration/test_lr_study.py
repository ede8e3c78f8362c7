"""``lowprec ablate experiment=lr_sweep_quick``: one ablation per grid point, grouped, and the ``lr`` study's
printed table recomputed here from MLflow alone (the runs' final losses, the parents' grid points)."""

from __future__ import annotations

import json
import re

import numpy as np
from mlflow.tracking import MlflowClient

from lowprec_lab.cli import main
from lowprec_lab.stats.noise import seeds_for_zero_gap


def test_lr_sweep_quick_tabulates_every_point_from_the_store(run_dirs, tmp_path, capsys):
    assert main(["ablate", "experiment=lr_sweep_quick", *run_dirs]) == 0
    out = capsys.readouterr().out
    ids = re.findall(r"ablation (abl-[\w-]+) done", out)
    assert len(ids) == 2  # one ablation per learning rate
    assert "grid point optim.lr=0.001" in out and "grid point optim.lr=0.008" in out

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lowprec").experiment_id
    parents = client.search_runs([exp], filter_string="tags.`lowprec.kind` = 'ablation'")
    assert {p.data.tags["ablation_group"] for p in parents} == {ids[0]}
    expected = {}
    for p in parents:
        point = json.loads(p.data.tags["grid_point"])
        assert p.data.params["optim.lr"] == str(point["optim.lr"])  # the point is what the runs trained with
        abl = p.data.tags["lowprec.ablation_id"]
        runs = client.search_runs([exp], filter_string=f"tags.`lowprec.ablation_id` = '{abl}'")
        final = {
            (r.data.tags["recipe"], int(r.data.tags["seed"])): r.data.metrics["final_val_loss"]
            for r in runs
            if "recipe" in r.data.tags
        }
        c = np.array([final[("bf16", s)] for s in (0, 1)])
        g = np.array([final[("fp32", s)] for s in (0, 1)])
        d = (g - c) / c
        expected[f"optim.lr={point['optim.lr']}"] = (c, d)

    printed = [line for line in out.splitlines() if line.startswith("| `optim.lr=")]
    last_table = printed[-2:]  # the study after the last point sees both
    best = min(c.mean() for c, _ in expected.values())
    for line in last_table:
        cells = [x.strip() for x in line.strip("|").split("|")]
        c, d = expected[cells[0].strip("`")]
        assert cells[1] == f"{c.mean():.4f}" and cells[2] == f"{c.std(ddof=1):.4f}"
        assert cells[3] == f"{100 * (c.mean() - best) / best:+.3f}%"
        assert cells[6] == "`fp32`"
        assert cells[7] == f"{100 * d.mean():+.3f}%" and cells[8] == f"{100 * d.std(ddof=1):.3f}%"
        assert cells[9] == str(seeds_for_zero_gap(d.std(ddof=1), 0.0025, 0.025))
    data = json.loads((tmp_path / "reports" / ids[1] / "lr.json").read_text())
    assert [r["point"] for r in data["rows"]] == [{"optim.lr": 0.001}, {"optim.lr": 0.008}]
    chosen = [r for r in data["rows"] if r["chosen"]]
    assert len(chosen) <= 1 and (data["chosen"] is None) == (not chosen)
    assert ("Chosen:" in out) or ("No point qualifies" in out)
