"""``report.html``: one self-contained page, verdicts first, then figures, then the detail
tables; rendered in a real headless Chromium (Debian's ``chromium``, driven by Playwright), whose DOM must show the
tables and every image loaded, with no console error. The ablation is fabricated in a real MLflow store
(``fabricated_ablation``: no training), the report is built by the real code."""

from __future__ import annotations

import re
import shutil
from html.parser import HTMLParser

import pytest

from lowprec_lab.report.build import report_figures
from lowprec_lab.report.html_check import CHROMIUM_PACKAGE, render


@pytest.fixture(scope="module")
def report(main_ablation):
    """``report.md`` of a fabricated ablation with every verdict kind (the shared ``main_ablation``, built once)."""
    return main_ablation.report


class _Page(HTMLParser):
    """Headings and image sources in document order, and every URL the page would fetch."""

    def __init__(self):
        super().__init__()
        self.order: list[tuple[str, str]] = []
        self.fetched: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("h1", "h2"):
            self._in = tag
        elif tag == "img":
            self.order.append(("img", a.get("alt", "")))
            self.fetched.append(a["src"])
        elif tag in ("script", "link", "iframe"):
            self.fetched.append(a.get("src") or a.get("href") or tag)

    def handle_data(self, data):
        if self._in:
            self.order.append((self._in, data.strip()))
            self._in = None


def test_the_page_is_self_contained_and_reads_verdicts_then_figures_then_details(report):
    page = _Page()
    page.feed((report.parent / "report.html").read_text())
    assert page.fetched and all(src.startswith("data:image/png;base64,") for src in page.fetched)
    figures = report_figures(report)
    assert len(page.fetched) == len(figures) >= 6  # every figure of report.md, embedded once
    h2 = [text for kind, text in page.order if kind == "h2"]
    assert h2[0] == "Verdicts"
    kinds = [kind for kind, _ in page.order]
    first_img, last_img = kinds.index("img"), len(kinds) - 1 - kinds[::-1].index("img")
    detail = [i for i, (kind, text) in enumerate(page.order) if text in ("Setup", "Summary", "Effective recipes")]
    assert detail and min(detail) > last_img > first_img > page.order.index(("h2", "Verdicts"))
    # the markdown keeps its own order (setup before the figures) and names the same figures
    md = report.read_text()
    assert md.index("## Setup") < md.index("## Memory by component")
    assert "<table>" in (report.parent / "report.html").read_text()


def test_recipe_names_link_only_where_a_server_ui_can_show_the_run(report):
    # a sqlite store has no UI to link to: no anchors (the server case is in test_report_server.py)
    assert "<a href" not in (report.parent / "report.html").read_text()


def test_the_report_renders_in_chromium_with_every_table_and_image(report, tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip(f"no chromium on PATH: install the Debian package `{CHROMIUM_PACKAGE}` (scripts/test.sh does)")
    alone = tmp_path / "report.html"  # the page alone, without the PNGs beside it: it must not need them
    shutil.copy(report.parent / "report.html", alone)
    shot = tmp_path / "report.png"
    page = render(alone, screenshot=shot)
    assert page.console_errors == [] and page.failed_requests == []
    assert page.headings[:2] == ["Precision ablation abl-main", "Verdicts"]
    # the compact verdict table first (five columns), the resolution under it, then the full one
    compact, resolution, verdict_headers = page.tables[:3]
    assert compact == ["recipe", "final val loss vs control [95% CI]", "verdict", "seeds needed", "stability"]
    assert resolution == ["recipe", "paired sd", "MDD at the seeds run", "seeds needed"]
    assert verdict_headers[:2] == ["recipe", "seeds"] and any(re.match(r"verdict", h) for h in verdict_headers)
    assert any(t[:3] == ["recipe", "what it is", "status"] for t in page.tables)  # the summary table
    assert len(page.images) == len(report_figures(report))
    assert all(width > 100 for _, width in page.images), page.images  # every image decoded and laid out
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    # the first screen (1280 x 900): the compact table fits its width and the forest plot lies on it; the full table
    # below may scroll sideways
    assert page.tables_overflow[:2] == [False, False] and page.tables_overflow[2] is True
    alt, bottom = page.image_bottoms[0]
    assert alt == "verdicts at the margin" and bottom <= 900, page.image_bottoms
