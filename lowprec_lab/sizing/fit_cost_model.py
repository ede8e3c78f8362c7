"""Fit the cost model's free parameters on the ``fit`` points of ``lowprec/estimate/published.yaml`` and report
the error on every point (fitted and held out).

    python -m lowprec_lab.sizing.fit_cost_model [--json | --docs]

Prints the fitted ``Calibration`` (paste it into ``lowprec.estimate.cost_model.Calibration``'s defaults, and the
fragmentation factor into ``lowprec.estimate.memory_model.FRAGMENTATION``; ``tests/unit/test_cost_model.py``
fails while the defaults differ from a refit) and the predicted-vs-published table that ``lowprec estimate
--validate`` prints with the shipped defaults. ``--docs`` rewrites the predicted-vs-published table of
``docs/estimator.md`` from the data file with the shipped calibration (``tests/unit/test_cost_model.py`` checks
they are equal).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowprec_lab.sizing.cost_validation import (
    FITTED,
    fit_calibration,
    fit_fragmentation,
    format_table,
    markdown_table,
    replace_table_block,
    summary,
    validate,
)


def estimator_page() -> Path:
    """``docs/estimator.md`` of this checkout, found from the repository root (the folder holding ``mkdocs.yml``)
    so that the path does not depend on where this module sits among ``lowprec_lab``' folders; raises
    ``FileNotFoundError`` outside a checkout (an installed wheel has no docs)."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "mkdocs.yml").is_file():
            return folder / "docs" / "estimator.md"
    raise FileNotFoundError("no mkdocs.yml above this module: --docs needs a source checkout")


def main(argv: list[str]) -> int:
    if "--docs" in argv:
        page = estimator_page()
        page.write_text(replace_table_block(page.read_text(), markdown_table(validate())))
        print(f"rewrote the table in {page}")
        return 0
    cal = fit_calibration()
    frag = fit_fragmentation()
    rows = validate(cal, fragmentation=frag)
    if "--json" in argv:
        print(
            json.dumps(
                {
                    "calibration": cal.to_dict(),
                    "fragmentation": frag,
                    "rows": [r.to_dict() for r in rows],
                    **summary(rows),
                },
                indent=1,
            )
        )
        return 0
    print("Calibration(" + ", ".join(f"{k}={getattr(cal, k):.4f}" for k in FITTED) + f"); FRAGMENTATION = {frag:.4f}")
    print(format_table(rows, cal))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
