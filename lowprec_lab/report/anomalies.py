"""The report's "Anomalies" section: every run's anomaly events (``anomalies.json``, ``lowprec.train.health``), one
table row per event, and why a run whose FP8 layers fell back to high precision is not compared as its recipe."""

from __future__ import annotations

import math

from lowprec_lab.report import markdown

#: Events listed per run before the rest is summarised as a count (the artifact has them all).
MAX_ROWS_PER_RUN = 12


def _value(v) -> str:
    if isinstance(v, str):  # non-finite numbers are stored as strings ("nan", "inf")
        return v
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def anomalies_section(runs) -> list[str]:
    """Markdown lines: a table of each run's events (``RunData.anomalies``), in recipe and seed order; nothing when
    no run recorded one (template ``anomalies.md.j2``)."""
    with_events = sorted((r for r in runs if r.anomalies), key=lambda r: (r.recipe, r.seed))
    if not with_events:
        return []
    shown = []
    for r in with_events:
        events = []
        for e in [e for e in r.anomalies if isinstance(e, dict)][:MAX_ROWS_PER_RUN]:
            # every field is the text of an artifact of the run: escaped, and a missing one is blank
            layer = markdown.code(e["layer"]) if e.get("layer") else ""
            detail = " ".join(x for x in (layer, markdown.text(e.get("detail", ""))) if x)
            events.append(
                [
                    f"{markdown.code(r.recipe)} seed {r.seed}",
                    markdown.text(e.get("step", "")),
                    markdown.text(e.get("kind", "")),
                    markdown.text(_value(e.get("value"))),
                    markdown.text(_value(e.get("threshold"))),
                    markdown.text(e.get("action", "")),
                    detail,
                ]
            )
        shown.append((r, events, max(0, len(r.anomalies) - MAX_ROWS_PER_RUN)))
    return markdown.lines("anomalies.md.j2", runs=shown)
