"""Fixtures shared by the integration tests that only read a finished ablation."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import pytest
from fabricated_ablation import fabricate_ablation, main_runs
from store_dirs import sqlite_uri

from lowprec_lab.report.build import build_report
from lowprec_lab.tracking.tracker import Tracker


class MainAblation:
    """``abl-main`` (``fabricated_ablation.main_runs``: every verdict kind, margin 0.25%) in a real MLflow sqlite
    store under ``root/runs`` (``uri``); ``report``: its ``report.md``, built on first use into ``root/reports``."""

    def __init__(self, root: Path):
        self.root = root
        self.uri = sqlite_uri(root / "runs" / "mlflow.db")
        self.tracker = Tracker(self.uri, "lowprec", root / "runs")
        fabricate_ablation(self.tracker, "abl-main", main_runs(), margin=0.0025)

    @cached_property
    def report(self) -> Path:
        """``root/reports/abl-main/report.md``, built once (a build draws every figure, seconds each)."""
        return build_report(self.tracker, "abl-main", self.root / "reports")


@pytest.fixture(scope="session")
def main_ablation(tmp_path_factory) -> MainAblation:
    """One fabricated ablation, and its report, for every test of the process that reads them. Tests may add
    ablations of other names to the store or rebuild ``abl-main``'s report into folders of their own; none may
    change ``abl-main``'s runs or the report files under ``root/reports`` (copy them first)."""
    return MainAblation(tmp_path_factory.mktemp("main-ablation"))
