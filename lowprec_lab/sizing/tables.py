"""Plain-text terminal tables drawn by ``rich``: columns as wide as their widest cell, so a long recipe name widens
its column instead of pushing the rest of its row out of line (the hand-made fixed-width tables did that).

Rendered without colour, markup or box characters, to a string, so the same text goes to a terminal, a pipe and a
test: one space between columns, no trailing spaces.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

#: Wide enough that no table here wraps: a row is one line, whatever the terminal (lines are never padded to it).
_WIDTH = 100_000


def render_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]], min_width=None) -> str:
    """The table as text: a header line, then one line per row, ``\\n``-separated, no trailing newline.

    ``columns``: (header, justification) pairs, justification ``"left"`` or ``"right"``; ``rows``: one value per
    column each, shown by ``str`` verbatim (no rich markup: ``[a1]`` stays ``[a1]``); ``min_width``: optional
    {column index: minimum width in characters}. Columns are separated by one space; a cell never wraps or folds.
    """
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), show_edge=False, header_style="", expand=False)
    for i, (header, justify) in enumerate(columns):
        table.add_column(header, justify=justify, no_wrap=True, min_width=(min_width or {}).get(i))
    for row in rows:
        table.add_row(*(Text(str(c)) for c in row))
    out = io.StringIO()
    console = Console(
        file=out, width=_WIDTH, force_terminal=False, color_system=None, markup=False, emoji=False, highlight=False
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())
