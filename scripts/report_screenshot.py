"""The README's screenshot of an HTML report: the first screen of ``report.html`` as headless Chromium renders it.

.venv/bin/python scripts/report_screenshot.py reports/<ablation-id>/report.html docs/report_screenshot.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.report.html_check import render


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("html", type=Path)
    p.add_argument("png", type=Path)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1500)
    a = p.parse_args()
    page = render(a.html, screenshot=a.png, width=a.width, height=a.height, full_page=False)
    print(f"{a.png}: {len(page.tables)} tables, {len(page.images)} images, {len(page.console_errors)} console errors")


if __name__ == "__main__":
    main()
