"""A run's anomaly events in MLflow: ``anomalies.json`` on the run, rewritten at every event, and read back.

The training loop's health monitor (``lowprec.train.health``) hands each ``AnomalyEvent`` over as it happens; the
artifact is rewritten then (events are rare: a handful per run), so a run killed right after an event still has it.
The ``anomaly/*`` counters go with the step's metrics. The report lists each run's events from this artifact.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from lowprec.train.health import AnomalyEvent
from lowprec_lab.tracking.tracker import Tracker

ANOMALY_ARTIFACT = "anomalies.json"


class AnomalyLog:
    """Collects one run's events and keeps ``anomalies.json`` (``{"events": [AnomalyEvent.to_dict(), ...]}``, in
    order) current on the run ``run_id``."""

    def __init__(self, tracker: Tracker, run_id: str):
        self.tracker, self.run_id = tracker, run_id
        self.events: list[dict] = []

    def record(self, event: AnomalyEvent) -> None:
        self.events.append(event.to_dict())
        self.tracker.log_dict(self.run_id, {"events": self.events}, ANOMALY_ARTIFACT)


def has_anomalies(metrics: dict[str, float]) -> bool:
    """Whether a run's latest metrics hold an ``anomaly/*`` counter (it logged at least one event)."""
    return any(k.startswith("anomaly/") for k in metrics)


def read_anomalies(tracker: Tracker, run_id: str) -> list[dict]:
    """The events of ``anomalies.json`` on the run (empty when the run has none)."""
    names = {a.path for a in tracker.client.list_artifacts(run_id)}
    if ANOMALY_ARTIFACT not in names:
        return []
    with tempfile.TemporaryDirectory() as d:
        path = tracker.client.download_artifacts(run_id, ANOMALY_ARTIFACT, d)
        return json.loads(Path(path).read_text())["events"]
