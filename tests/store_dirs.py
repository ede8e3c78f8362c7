"""Hydra overrides that keep a command's MLflow store, reports and run folders under one directory (the
``run_dirs`` fixture of tests/conftest.py, and tests that need a second such directory)."""

from __future__ import annotations

from pathlib import Path


def dirs_under(root: Path) -> list[str]:
    """``paths.runs``, ``paths.reports``, ``tracking.uri`` (sqlite in ``root/runs``) under ``root``, no progress bar."""
    return [
        f"paths.runs={root / 'runs'}",
        f"paths.reports={root / 'reports'}",
        f"tracking.uri=sqlite:///{root / 'runs' / 'mlflow.db'}",
        "train.progress=false",
    ]
