"""The report's "Anomalies" section: every run's anomaly events (``anomalies.json``, ``lowprec.train.health``), one
table row per event, and why a run whose FP8 layers fell back to high precision is not compared as its recipe."""

from __future__ import annotations

import math

#: Events listed per run before the rest is summarised as a count (the artifact has them all).
MAX_ROWS_PER_RUN = 12


def _value(v) -> str:
    if isinstance(v, str):  # non-finite numbers are stored as strings ("nan", "inf")
        return v
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def anomalies_section(runs) -> list[str]:
    """Markdown lines: a table of each run's events (``RunData.anomalies``), in recipe and seed order; nothing when
    no run recorded one."""
    with_events = sorted((r for r in runs if r.anomalies), key=lambda r: (r.recipe, r.seed))
    if not with_events:
        return []
    lines = [
        "",
        "## Anomalies",
        "",
        "Events of the health monitor (`train.on_anomaly`, `train.fp8_fallback`; each run's `anomalies.json`): "
        "non-finite loss or gradient norm, loss and grad-norm spikes by the stability rule, FP8 linears whose overflow "
        "or underflow share stayed above the threshold; value = the loss (nats), grad norm or share, threshold = "
        "what it was compared with (a spike's EMA + k robust sd). Action: `skipped` (the update was dropped), "
        "`rolled_back` (the last checkpoint was reloaded and the batch skipped), `fp8_fallback` (the layer runs in "
        "high precision from the next step: the run is left out of the comparison), `failed`, `recorded`.",
        "",
        "| run | step | kind | value | threshold | action | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in with_events:
        for e in r.anomalies[:MAX_ROWS_PER_RUN]:
            detail = " ".join(x for x in (f"`{e['layer']}`" if "layer" in e else "", e.get("detail", "")) if x)
            cells = [
                f"`{r.recipe}` seed {r.seed}",
                str(e["step"]),
                e["kind"],
                _value(e.get("value")),
                _value(e.get("threshold")),
                e["action"],
                detail,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        if len(r.anomalies) > MAX_ROWS_PER_RUN:
            more = len(r.anomalies) - MAX_ROWS_PER_RUN
            lines.append(f"| `{r.recipe}` seed {r.seed} | | {more} more events in its `anomalies.json` | | | | |")
    return lines
