"""The report's markdown from Jinja2 templates (``lowprec_lab/report/templates/*.md.j2``): the templates hold the
document's structure and prose, the section functions of ``build.py`` and ``verdict_table.py`` the numbers, which
reach the templates as values and are formatted there by the filters below.

Whitespace is the templates' own: ``trim_blocks`` and ``lstrip_blocks`` drop the lines of block tags, so each other
template line is one line of the report, and a template ends with the newline of its last line (kept). No HTML
escaping (the output is markdown); an undefined name raises ``jinja2.UndefinedError`` instead of printing nothing.

A string read from the tracking store (a tag, a param, a failure reason, a recipe or run name, an artifact's text) is
data that whoever can write the store chose: it reaches the markdown only through ``text`` (escaped, literal) or
``code`` (a code span only when it is safe as one), never as markdown of its own, so ``![x](/etc/passwd)`` reads as
those characters and no image, link, HTML or table cell comes from it.
"""

from __future__ import annotations

import math
import re
from functools import cache

import jinja2


def num(x, fmt: str) -> str:
    """``format(x, fmt)``, or ``n/a`` for None and NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def pct(x: float) -> str:
    """A relative difference as a signed percentage with 3 decimals: 0.0123 -> ``+1.230%``."""
    return f"{100 * x:+.3f}%"


#: Line breaks and other control characters: a string from the store is one line of the report (a newline would
#: start a block of its own: a heading, an image, a table row).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: The characters that make markdown of text (inline markup, links and images, HTML and entities, table cells,
#: headings, block quotes): each is backslash-escaped, which CommonMark reads as the character itself.
_MARKUP = re.compile(r"([\\`*_\[\]<>&|#!~{}])")
#: What a code span may hold as it is: no backtick (it would end the span), no pipe (it would end a table cell).
_CODE_SAFE = re.compile(r"[^`|]+")


def text(x) -> str:
    """``x`` as literal markdown text: control characters (newlines included) become spaces and every markup
    character is backslash-escaped (``![x](/etc/passwd)`` -> ``\\!\\[x\\](/etc/passwd)``, shown as typed)."""
    return _MARKUP.sub(r"\\\1", _CONTROL.sub(" ", str(x)))


def code(x) -> str:
    """Inline markdown code: ``x`` between backticks, when it is safe as a code span (no backtick or pipe, no
    leading or trailing space, one line); else ``text(x)``."""
    s = _CONTROL.sub(" ", str(x))
    if _CODE_SAFE.fullmatch(s) and s.strip() == s:
        return f"`{s}`"
    return text(s)


def md_row(cells) -> str:
    """One markdown table row: ``| a | b |``."""
    return "| " + " | ".join(cells) + " |"


def md_rule(columns) -> str:
    """The header rule of a markdown table of ``len(columns)`` columns: ``|---|---|``."""
    return "|---" * len(columns) + "|"


@cache
def environment() -> jinja2.Environment:
    """The templates' environment (one per process): templates found beside this module, filters ``fmt``
    (``format``), ``num``, ``pct``, ``code``, ``text``, ``row`` (``md_row``) and ``rule`` (``md_rule``)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("lowprec_lab.report", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(fmt=format, num=num, pct=pct, code=code, text=text, row=md_row, rule=md_rule)
    return env


def render(name: str, **context) -> str:
    """The text of template ``name`` (e.g. ``"report.md.j2"``) rendered with ``context``. Raises
    ``jinja2.TemplateNotFound`` / ``jinja2.UndefinedError`` for a missing template or name."""
    return environment().get_template(name).render(**context)


def lines(name: str, **context) -> list[str]:
    """``render``'s text as a list of lines (its final newline ends the last line; it adds no empty line)."""
    return render(name, **context).removesuffix("\n").split("\n")
