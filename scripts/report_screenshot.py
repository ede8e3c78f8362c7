"""The README's screenshot of an HTML report: the first screen of an ablation's ``report.html`` as headless Chromium
renders it at 1280 px, rebuilt from the tracking store with the current report code.

    .venv/bin/python scripts/report_screenshot.py ABLATION_ID [tracking.uri=...] [paths.runs=...]

writes ``docs/report_screenshot.png`` and ``docs/report_screenshot.json`` (the ablation, its experiment, this
command, the date and ``report_code_hash``: the hash of the report's code and templates that drew it;
``tests/unit/test_report_screenshot.py`` fails once the report's code no longer matches it). The report is rebuilt
into a temporary folder as ``lowprec report ABLATION_ID`` would (same margin, re-logged on the parent run), so the
picture is the current report's, not the one the ablation wrote. Chromium: Debian's ``chromium`` package
(``lowprec_lab.report.html_check``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PNG = ROOT / "docs" / "report_screenshot.png"
RECORD = ROOT / "docs" / "report_screenshot.json"
WIDTH, HEIGHT = 1280, 1000


def main(argv: list[str] | None = None) -> int:
    """Build the report of ``ABLATION_ID``, screenshot its first screen, write the PNG and its record; 2 with one
    line on stderr for a bad id, an unknown ablation, an unreachable store or no Chromium."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ablation_id")
    p.add_argument("overrides", nargs="*", help="config overrides, as for lowprec report (tracking.uri=...)")
    p.add_argument("--png", type=Path, default=PNG)
    p.add_argument("--record", type=Path, default=RECORD)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from lowprec_lab.cli import _user_errors, compose, one_line
    from lowprec_lab.report.build import build_report, find_ablation
    from lowprec_lab.report.html_check import render, report_code_hash
    from lowprec_lab.tracking.tracker import Tracker

    try:
        cfg = compose("ablate", a.overrides)
        tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, cfg.paths.runs)
        tags = find_ablation(tracker, a.ablation_id).data.tags
        with tempfile.TemporaryDirectory() as d:
            report = build_report(tracker, a.ablation_id, Path(d))
            page = render(report.parent / "report.html", screenshot=a.png, width=WIDTH, height=HEIGHT, full_page=False)
    except _user_errors() as e:
        print(f"report_screenshot: error: {one_line(e)}", file=sys.stderr)
        return 2
    record = {
        "ablation_id": a.ablation_id,
        "experiment": tags.get("experiment", ""),
        "model": tags.get("model", ""),
        "recipes": json.loads(tags.get("recipes", "[]")),
        "seeds": tags.get("seeds", ""),
        "command": shlex.join(["scripts/report_screenshot.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "viewport": [WIDTH, HEIGHT],
        "report_code_sha256": report_code_hash(),
    }
    a.record.write_text(json.dumps(record, indent=2) + "\n")
    errors = len(page.console_errors) + len(page.failed_requests)
    print(f"{a.png}: {len(page.tables)} tables, {len(page.images)} images, {errors} console errors; {a.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
