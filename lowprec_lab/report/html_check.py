"""Render ``report.html`` in a real headless Chromium and read back what a reader would see.

Used by the browser test (``tests/integration/test_report_html.py``) and by ``scripts/report_screenshot.py`` (the
README's screenshot). Chromium is Debian's ``chromium`` package (``scripts/setup.sh`` installs it where it can),
driven by Playwright (the ``dev`` extra) through ``executable_path``; Playwright's own browser download is never
used. The launch flags are the ones found to work on machines without network access (containers, CI): without the
background-networking flags Chromium's connections are refused by the closed network, many at a time.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from lowprec.errors import UserError

CHROMIUM_PACKAGE = "chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",  # root in a container: Chromium's sandbox needs user namespaces it may not have
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class BrowserMissingError(UserError, FileNotFoundError):
    """No Chromium binary, or no Playwright, on this machine."""


def chromium_path() -> str:
    """Path of the Chromium binary; raises ``BrowserMissingError`` naming the Debian package when there is none."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    raise BrowserMissingError(f"no chromium binary on PATH (Debian package `{CHROMIUM_PACKAGE}`)")


@dataclass
class RenderedPage:
    """What the browser showed: per-table header texts, per-image ``(alt, naturalWidth)``, console errors and
    failed requests (none are expected from a self-contained page), the heading texts, the links' targets, and
    where things lie on the page (which tables overflow their width, each image's bottom edge)."""

    tables: list[list[str]] = field(default_factory=list)
    images: list[tuple[str, int]] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    headings: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    #: per table: its content is wider than the box it is laid out in (a reader must scroll sideways to see it all)
    tables_overflow: list[bool] = field(default_factory=list)
    #: per image: ``(alt, bottom)``, the bottom edge in CSS pixels from the top of the page
    image_bottoms: list[tuple[str, float]] = field(default_factory=list)


def render(
    html_path: Path, screenshot: Path | None = None, width: int = 1280, height: int = 900, full_page: bool = True
) -> RenderedPage:
    """Open ``html_path`` (a ``file://`` URL, no server) in headless Chromium at ``width`` x ``height`` CSS pixels,
    wait for every image, and return the ``RenderedPage``; with ``screenshot``, also save a PNG there (the whole
    page, or only the first screen with ``full_page=False``).

    Raises ``BrowserMissingError`` without Chromium or Playwright.
    """
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise BrowserMissingError("playwright is not installed (pip install -e '.[dev]')") from None
    exe = chromium_path()
    page_out = RenderedPage()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: page_out.console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: page_out.console_errors.append(str(e)))
            page.on("requestfailed", lambda r: page_out.failed_requests.append(r.url[:120]))
            page.goto(Path(html_path).resolve().as_uri(), wait_until="load")
            page.wait_for_function("Array.from(document.images).every(i => i.complete)")
            page_out.tables = page.eval_on_selector_all(
                "table", "ts => ts.map(t => Array.from(t.querySelectorAll('th')).map(h => h.textContent.trim()))"
            )
            page_out.images = [
                (alt, int(w))
                for alt, w in page.eval_on_selector_all("img", "is => is.map(i => [i.alt, i.naturalWidth])")
            ]
            page_out.headings = page.eval_on_selector_all("h1, h2", "hs => hs.map(h => h.textContent.trim())")
            page_out.links = [
                tuple(x) for x in page.eval_on_selector_all("a", "as => as.map(a => [a.textContent, a.href])")
            ]
            page_out.tables_overflow = page.eval_on_selector_all(
                "table", "ts => ts.map(t => t.scrollWidth > t.clientWidth + 1)"
            )
            page_out.image_bottoms = [
                (alt, float(b))
                for alt, b in page.eval_on_selector_all(
                    "img", "is => is.map(i => [i.alt, i.getBoundingClientRect().bottom + window.scrollY])"
                )
            ]
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=full_page)
        finally:
            browser.close()
    return page_out


#: What the README's screenshot depends on: the report's code and templates (``report_code_hash``).
REPORT_CODE = Path(__file__).resolve().parent


def report_code_hash(root: Path = REPORT_CODE) -> str:
    """SHA-256 (hex) of the report's build code and templates: every ``*.py`` and ``templates/*.j2`` under ``root``
    (this package), each as its path relative to ``root`` and its bytes, in path order. ``docs/report_screenshot.json``
    records it; a test compares it with the current one, so a changed report makes a stale screenshot fail."""
    h = hashlib.sha256()
    files = sorted([*root.glob("*.py"), *root.glob("templates/*.j2")], key=lambda p: p.relative_to(root).as_posix())
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()
