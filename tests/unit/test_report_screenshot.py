"""The README's screenshot (``docs/report_screenshot.png``) is the current report's: its record
(``docs/report_screenshot.json``) holds the hash of the report code and templates that drew it, and this test fails
once they change without the screenshot being redrawn (``scripts/report_screenshot.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from PIL import Image

from lowprec_lab.report.html_check import REPORT_CODE, report_code_hash

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "report_screenshot.json"


def test_the_screenshot_was_drawn_by_the_current_report_code():
    record = json.loads(RECORD.read_text())
    redraw = f".venv/bin/python {record['command']}"
    assert record["report_code_sha256"] == report_code_hash(), (
        f"docs/report_screenshot.png is stale: the report's code or templates changed since it was drawn; redraw "
        f"it from a current default ablation: {redraw}"
    )
    assert record["experiment"] and record["ablation_id"].startswith("abl-") and record["date"]
    assert Image.open(ROOT / "docs" / "report_screenshot.png").size == tuple(record["viewport"]) == (1280, 1000)


def test_the_hash_covers_every_template_and_module_of_the_report(tmp_path):
    copy = tmp_path / "report"
    shutil.copytree(REPORT_CODE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = report_code_hash(copy)
    assert base == report_code_hash()
    for name in ("templates/verdicts.md.j2", "verdict_table.py", "templates/noise_floor.md.j2"):
        f = copy / name
        old = f.read_bytes()
        f.write_bytes(old + b"\n")
        assert report_code_hash(copy) != base, name
        f.write_bytes(old)
    (copy / "templates" / "new.md.j2").write_text("x")
    assert report_code_hash(copy) != base
