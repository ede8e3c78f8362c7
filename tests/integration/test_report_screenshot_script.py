"""``scripts/report_screenshot.py``: an ablation in a real MLflow store (fabricated, no training: the shared
``main_ablation``) rebuilt with the current report code and its first screen drawn by headless Chromium at 1280 px,
with the record of what drew it."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
from PIL import Image

from lowprec_lab.report.html_check import CHROMIUM_PACKAGE, report_code_hash

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "report_screenshot.py"


def test_the_script_draws_the_first_screen_and_records_the_code_that_drew_it(request, tmp_path, capsys):
    if shutil.which("chromium") is None:
        pytest.skip(f"no chromium on PATH: install the Debian package `{CHROMIUM_PACKAGE}` (scripts/test.sh does)")
    main_ablation = request.getfixturevalue("main_ablation")  # only once Chromium is there to draw it
    uri = main_ablation.uri  # the script rebuilds the report into a folder of its own: the shared one stays as it is
    main = runpy.run_path(str(SCRIPT))["main"]
    png, record = tmp_path / "shot.png", tmp_path / "shot.json"
    args = ["abl-main", f"tracking.uri={uri}", f"paths.runs={main_ablation.root / 'runs'}", "--png", str(png)]
    assert main([*args, "--record", str(record)]) == 0
    assert "0 console errors" in capsys.readouterr().out
    assert Image.open(png).size == (1280, 1000)
    r = json.loads(record.read_text())
    assert r["ablation_id"] == "abl-main" and r["report_code_sha256"] == report_code_hash()
    assert r["command"].startswith("scripts/report_screenshot.py abl-main tracking.uri=")
    # an unknown ablation is one line, and nothing is drawn
    assert main(["abl-nope", f"tracking.uri={uri}", "--png", str(tmp_path / "no.png"), "--record", str(record)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report_screenshot: error: no ablation 'abl-nope'") and err.count("\n") == 1
    assert not (tmp_path / "no.png").exists()
