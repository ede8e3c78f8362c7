"""Hydra overrides that keep a command's MLflow store, reports and run folders under one directory (the
``run_dirs`` fixture of tests/conftest.py, and tests that need a second such directory), and the URI of a sqlite
store of a test's own.

A new store's tables are a copy of the session's template (tests/startup/store_template.py), whoever makes it:
nothing here makes tables."""

from __future__ import annotations

from pathlib import Path


def store_uri(root: Path) -> str:
    """The tracking URI that ``dirs_under(root)`` sets: sqlite in ``root/runs``."""
    return f"sqlite:///{root / 'runs' / 'mlflow.db'}"


def dirs_under(root: Path) -> list[str]:
    """``paths.runs``, ``paths.reports``, ``tracking.uri`` (``store_uri(root)``) under ``root``, no progress bar."""
    return [
        f"paths.runs={root / 'runs'}",
        f"paths.reports={root / 'reports'}",
        f"tracking.uri={store_uri(root)}",
        "train.progress=false",
    ]


def sqlite_uri(db: Path) -> str:
    """``sqlite:///db`` with ``db``'s folder made, for a test that fabricates or reads runs in a store of its own."""
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"
