"""A study's three files beside the report: ``<stem>.md``, ``<stem>.json`` and ``<stem>.csv``.

The ``lr`` and ``noise`` studies each write one table three ways: the markdown for a reader, the JSON for a script
(``indent=2``) and the CSV for a spreadsheet. The study builds the lines, the record and the rows; this module only
writes them, so every study's files have the same form.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path


def write_study_files(
    out: Path,
    stem: str,
    lines: list[str],
    record: dict,
    csv_header: Sequence[str],
    csv_rows: Iterable[Sequence],
    json_default: Callable | None = None,
) -> Path:
    """Write ``out/<stem>.md`` (``lines`` joined by newlines, no final newline added), ``out/<stem>.json``
    (``record``, ``indent=2``; ``json_default``: ``json.dumps``'s ``default`` for values JSON lacks) and
    ``out/<stem>.csv`` (``csv_header`` then each of ``csv_rows``, in the ``csv`` module's default dialect); returns
    the markdown path. ``OSError`` from the file system passes through."""
    path = out / f"{stem}.md"
    path.write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=json_default))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(csv_header)
        w.writerows(csv_rows)
    return path
