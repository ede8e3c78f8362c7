"""The front door and the documentation: README.md stays a front door of at most 200 lines with the two
commands of a fresh clone, every page of docs/ is in the MkDocs navigation, no page or the README refers outside the
repository (a link is an http(s) address or a file of this checkout; no absolute machine path in the text), and
``mkdocs build --strict`` passes (broken links and anchors fail it)."""

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
# Absolute paths of a machine (home folders, scratch and temporary folders, the lab's work tree, Windows drives) or
# file URLs; system files named as facts (/proc/<pid>/stat, /usr/bin/time) are not places on the writer's machine.
# Built from pieces, so that this file does not match itself.
MACHINE_PATH = re.compile(
    r"(?<![\w.~-])/(?:" + "|".join(["work", "home", "root", "tmp", "Users", "mnt", "scratch"]) + r")/"
    r"|" + "file" + r"://|\b[A-Z]:\\"
)


def _targets(text: str) -> list[str]:
    """Every link and image target of a Markdown text, as markdown-it parses it (code spans and fenced blocks, where
    brackets are shell or Hydra syntax, hold none); raw HTML ``href``/``src`` attributes too."""
    out = []

    def walk(tokens):
        for tok in tokens:
            if tok.type == "link_open":
                out.append(tok.attrs.get("href", ""))
            elif tok.type == "image":
                out.append(tok.attrs.get("src", ""))
            elif tok.type in ("html_inline", "html_block"):
                out.extend(re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", tok.content))
            if tok.children:
                walk(tok.children)

    walk(MarkdownIt("commonmark").enable("table").parse(text))
    return out


def _outside(page: Path, target: str) -> str | None:
    """Why ``target`` (a link of ``page``) refers outside the repository, or None when it does not."""
    parts = urlsplit(target)
    if parts.scheme in ("http", "https"):
        return None
    if parts.scheme or parts.netloc:
        return f"{target}: a {parts.scheme or 'network'} address"
    if not parts.path:
        return None  # an anchor on the same page
    if parts.path.startswith("/"):
        return f"{target}: an absolute path"
    resolved = (page.parent / unquote(parts.path)).resolve()
    if not resolved.is_relative_to(ROOT):
        return f"{target}: resolves outside the repository"
    if not resolved.exists():
        return f"{target}: no such file in the repository"
    return None


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_refers_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    found = [why for t in _targets(text) if (why := _outside(page, t))]
    lines = enumerate(text.splitlines(), 1)
    found += [f"line {n}: {line.strip()[:100]}" for n, line in lines if MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)


def test_the_link_check_sees_what_it_must_refuse():
    # the checks above on known bad and good links, so that a parser change cannot make them vacuous
    page = DOCS / "index.md"
    bad = "[a](/etc/x.md) [b](../../elsewhere.md) ![c](../../x.png) [d](nope.md) <a href='ftp://h/x'>e</a>"
    good = "[a](cli.md#examples) [b](https://arxiv.org/abs/2412.19437) [c](#top) `[not](a-link.md)`"
    assert [t for t in _targets(bad) if _outside(page, t)] == _targets(bad) and len(_targets(bad)) == 5
    assert not [t for t in _targets(good) if _outside(page, t)] and len(_targets(good)) == 3
    # markdown-it does not parse file: URLs as links at all; the text check catches them and machine paths
    assert MACHINE_PATH.search("![c](" + "file" + ":///x.png)") and MACHINE_PATH.search("see " + "/" + "home/me/x")
    assert not MACHINE_PATH.search("`/proc/<pid>/stat` and /usr/bin/time")


def test_readme_is_a_front_door_with_the_two_commands_of_a_fresh_clone():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    quick = text.split("## Quick start", 1)[1]
    block = quick.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["bash scripts/setup.sh && .venv/bin/lowprec ablate", "bash scripts/test.sh"]
    assert "docs/report_screenshot.png" in text  # what comes out


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_every_page_is_in_the_navigation_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    assert sorted(nav) == sorted(str(p.relative_to(DOCS)) for p in PAGES)
    assert len(nav) == len(set(nav))
    assert config["strict"] is True


def test_mkdocs_builds_the_site_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    # not --quiet: with it MkDocs 1.6 counts no warning and --strict passes a broken link
    build = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    config = ["-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)]
    done = subprocess.run([*build, *config], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index.html").is_file() and (tmp_path / "estimator" / "index.html").is_file()
    # An offline reader's browser fetches nothing: every script and stylesheet of every page is in the site (the
    # theme's highlight.js came from a CDN: two console errors per page and no highlighting), and code is highlighted.
    fetched = re.compile(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//", re.I)
    pages = sorted(tmp_path.rglob("*.html"))
    assert pages and not [str(p.relative_to(tmp_path)) for p in pages if fetched.search(p.read_text(encoding="utf-8"))]
    assert 'class="codehilite"' in (tmp_path / "cli" / "index.html").read_text(encoding="utf-8")
    # Wide tables and command lines scroll instead of being clipped by the theme's 800 px column.
    assert "max-width: none" in (tmp_path / "css" / "layout.css").read_text(encoding="utf-8")
