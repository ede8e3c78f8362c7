"""Fit the cost model's free parameters on the ``fit`` points of ``lowprec/estimate/published.yaml`` and report
the error on every point (fitted and held out).

    python -m experiments.planning.fit_cost_model [--json | --readme]

Prints the fitted ``Calibration`` (paste it into ``lowprec.estimate.cost_model.Calibration``'s defaults, and the
fragmentation factor into ``lowprec.estimate.memory_model.FRAGMENTATION``; ``tests/unit/test_cost_model.py``
fails while the defaults differ from a refit) and the predicted-vs-published table that ``lowprec estimate
--validate`` prints with the shipped defaults. ``--readme`` rewrites README.md's predicted-vs-published table
from the data file with the shipped calibration (``tests/unit/test_cost_model.py`` checks they are equal).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.planning.cost_validation import (
    FITTED,
    fit_calibration,
    fit_fragmentation,
    format_table,
    markdown_table,
    replace_readme_block,
    summary,
    validate,
)


def main(argv: list[str]) -> int:
    if "--readme" in argv:
        readme = Path(__file__).resolve().parents[2] / "README.md"
        readme.write_text(replace_readme_block(readme.read_text(), markdown_table(validate())))
        print(f"rewrote the table in {readme}")
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
