"""Terminal tables drawn by rich: a recipe name longer than the hand-made tables' fixed columns
widens its column instead of pushing its row out of line, and the text is plain (no colour codes, no rich markup
read into cells). Real catalog recipes, the ``estimate`` command's own code; milliseconds on the ``debug`` model."""

from __future__ import annotations

import dataclasses

from lowprec.recipes import CATALOG
from lowprec_lab.cli import main
from lowprec_lab.sizing.tables import render_table

LONG = "bf16_with_a_name_much_longer_than_the_old_twenty_one_columns"


def test_a_long_recipe_name_keeps_the_estimate_ranking_aligned(monkeypatch, capsys):
    """``lowprec estimate recipe=all``: its recipe column was 21 characters wide; a longer name shifted every later
    cell of its row. Now every line of the table is as wide as the header and the name is whole."""
    monkeypatch.setitem(CATALOG, LONG, dataclasses.replace(CATALOG["bf16"], name=LONG))
    assert main(["estimate", "model=debug", "recipe=all", "train.seq_len=256"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.split()[:3] == ["mem", "rank", "recipe"])
    table = out[start : out.index("", start)]
    assert len(table) == len(CATALOG) + 1
    # the last column ("time rank") is right-justified: a row in line ends exactly where the header ends
    assert {len(line) for line in table} == {len(table[0])}, "\n".join(table)
    row = next(line for line in table if LONG in line)
    assert row.split()[1] == LONG
    assert table[0].index("state GiB") + len("state GiB") == row.index(row.split()[2]) + len(row.split()[2])


def test_cells_are_plain_text():
    """Brackets and colons in a cell are text, not rich markup or emoji codes; no escape codes; no trailing spaces."""
    text = render_table([("#", "right"), ("evidence", "left")], [(1, "[a1] [bold]x :smile:"), (12, "")], {0: 2})
    assert text.splitlines() == [" # evidence", " 1 [a1] [bold]x :smile:", "12"]
    assert "\x1b" not in text
