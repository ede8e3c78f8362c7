"""``scripts/report_screenshot.py``: an ablation in a real MLflow store (fabricated, no training) rebuilt with the
current report code and its first screen drawn by headless Chromium at 1280 px, with the record of what drew it."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
from fabricated_ablation import fabricate_ablation, main_runs
from PIL import Image
from store_dirs import migrated_uri

from lowprec_lab.report.html_check import CHROMIUM_PACKAGE, report_code_hash
from lowprec_lab.tracking.tracker import Tracker

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "report_screenshot.py"


def test_the_script_draws_the_first_screen_and_records_the_code_that_drew_it(tmp_path, capsys):
    if shutil.which("chromium") is None:
        pytest.skip(f"no chromium on PATH: install the Debian package `{CHROMIUM_PACKAGE}` (scripts/test.sh does)")
    uri = migrated_uri(tmp_path / "mlflow.db")
    tracker = Tracker(uri, "lowprec", tmp_path / "runs")
    fabricate_ablation(tracker, "abl-shot", main_runs())
    main = runpy.run_path(str(SCRIPT))["main"]
    png, record = tmp_path / "shot.png", tmp_path / "shot.json"
    args = ["abl-shot", f"tracking.uri={uri}", f"paths.runs={tmp_path / 'runs'}", "--png", str(png)]
    assert main([*args, "--record", str(record)]) == 0
    assert "0 console errors" in capsys.readouterr().out
    assert Image.open(png).size == (1280, 1000)
    r = json.loads(record.read_text())
    assert r["ablation_id"] == "abl-shot" and r["report_code_sha256"] == report_code_hash()
    assert r["command"].startswith("scripts/report_screenshot.py abl-shot tracking.uri=")
    # an unknown ablation is one line, and nothing is drawn
    assert main(["abl-nope", f"tracking.uri={uri}", "--png", str(tmp_path / "no.png"), "--record", str(record)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report_screenshot: error: no ablation 'abl-nope'") and err.count("\n") == 1
    assert not (tmp_path / "no.png").exists()
