"""The report as one self-contained HTML page: figures embedded, no network access, readable in MLflow's viewer.

The markdown the report writes (``lowprec_lab.report.build``) is parsed with markdown-it-py (CommonMark plus tables);
the token stream is then changed in two places before rendering: every image's ``src`` becomes a ``data:image/png``
URI read from the report folder, and recipe names in table cells become links to their child runs when the
tracking store is a server whose UI can show them.

The page is uploaded to the tracking server and shown to others, so the inliner embeds only a plain file directly in
the report's own folder (a bare file name: no folder, no ``..``, no absolute path or URL, not a symlink, resolving
inside the folder); anything else is refused with one line before a byte of it is read. Raw HTML in the markdown is
not rendered (markdown-it's ``html`` option off): it is shown escaped.
"""

from __future__ import annotations

import base64
import html
import mimetypes
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.token import Token

from lowprec.errors import UserError

# Plain CSS, no web fonts or scripts: the page must render the same offline and inside MLflow's artifact iframe.
STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1rem; color: #1d1d1f; }
h1 { font-size: 1.6rem; border-bottom: 2px solid #ddd; padding-bottom: .3rem; }
h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: .8rem 0; font-size: 13px; display: block; overflow-x: auto; }
th, td { border: 1px solid #d0d7de; padding: .25rem .5rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
tr:nth-child(even) td { background: #fbfbfc; }
code { font: 12px ui-monospace, SFMono-Regular, Menlo, monospace; background: #f3f3f3; padding: 0 .2rem; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
blockquote { border-left: 4px solid #e5a50a; margin: 1rem 0; padding: .2rem 1rem; background: #fff8e5; }
a code { color: #0b5cad; text-decoration: underline; }
"""


class ReportFigureError(UserError, FileNotFoundError):
    """A figure the report's markdown names is not a plain file of the report folder."""


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark", {"html": False}).enable("table")


def _figure(folder: Path, src: str) -> Path:
    """The file ``src`` names in ``folder``, or ``ReportFigureError``: only a bare file name of a regular file, not a
    symlink, whose resolved path lies in ``folder`` (a path from a store record must not bring another file into the
    page)."""
    root = Path(folder).resolve()
    shown = src[:200]
    if not src or src != Path(src).name or src in (".", ".."):
        raise ReportFigureError(f"the report names the figure {shown!r}, which is not a file name in {root}")
    path = root / src
    if path.is_symlink() or not path.is_file() or path.resolve().parent != root:
        raise ReportFigureError(f"the report names the figure {shown!r}, which is not a plain file in {root}")
    return path


def _data_uri(path: Path) -> str:
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _embed_images(tokens: list[Token], folder: Path) -> None:
    for tok in tokens:
        for child in tok.children or []:
            if child.type == "image":
                child.attrSet("src", _data_uri(_figure(folder, str(child.attrGet("src") or ""))))


def _link_recipes(tokens: list[Token], links: dict[str, str]) -> None:
    """Wrap ``code`` spans naming a linked recipe inside table cells in ``<a href=...>``."""
    in_cell = False
    for tok in tokens:
        if tok.type in ("td_open", "th_open"):
            in_cell = True
        elif tok.type in ("td_close", "th_close"):
            in_cell = False
        elif tok.type == "inline" and in_cell and tok.children:
            out: list[Token] = []
            for child in tok.children:
                url = links.get(child.content) if child.type == "code_inline" else None
                if url is None:
                    out.append(child)
                    continue
                opened = Token("link_open", "a", 1, attrs={"href": url, "title": f"MLflow run of {child.content}"})
                out += [opened, child, Token("link_close", "a", -1)]
            tok.children = out


def markdown_to_html(markdown: str, folder: Path, title: str, links: dict[str, str] | None = None) -> str:
    """One HTML document from the report's ``markdown``.

    ``folder``: where the figures named by ``![...](file.png)`` lie (each is embedded as a base64 data URI; only a
    plain file of ``folder`` itself, ``_figure``); ``links``: recipe name -> URL of its run in the MLflow UI (table
    cells that name the recipe become links). Raises ``ReportFigureError`` for a figure that is not a plain file in
    ``folder``.
    """
    md = _parser()
    tokens = md.parse(markdown)
    _embed_images(tokens, Path(folder))
    if links:
        _link_recipes(tokens, links)
    body = md.renderer.render(tokens, md.options, {})
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}</body>\n</html>\n"
    )
