"""Hydra overrides that keep a command's MLflow store, reports and run folders under one directory (the
``run_dirs`` fixture of tests/conftest.py, and tests that need a second such directory)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def dirs_under(root: Path) -> list[str]:
    """``paths.runs``, ``paths.reports``, ``tracking.uri`` (sqlite in ``root/runs``) under ``root``, no progress bar."""
    return [
        f"paths.runs={root / 'runs'}",
        f"paths.reports={root / 'reports'}",
        f"tracking.uri=sqlite:///{root / 'runs' / 'mlflow.db'}",
        "train.progress=false",
    ]


_TEMPLATE: Path | None = None


def _template() -> Path:
    """An MLflow sqlite store holding its tables and nothing else, made once per test process (removed at exit)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        folder = Path(tempfile.mkdtemp(prefix="lowprec-store-template-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        SqlAlchemyStore(f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri())
        _TEMPLATE = folder / "mlflow.db"
    return _TEMPLATE


def dirs_with_store(root: Path) -> list[str]:
    """``dirs_under(root)`` with ``root/runs/mlflow.db`` already holding MLflow's tables (a copy of one template).

    MLflow creates a new sqlite store's tables by running its migrations, ~6 s of CPU per store on the 2-core
    machine; a copy takes 30 ms. For tests that train and read the store, never for one whose claim is about a new
    store or about no store being written (tests/integration/test_sqlite_concurrency.py, test_quiet_output.py,
    the refusals that assert ``mlflow.db`` does not exist): those keep ``dirs_under``. The lab's own experiment is
    still created by the command under test.
    """
    db = root / "runs" / "mlflow.db"
    if not db.exists():  # a store that holds runs already (a second command in the same folder) stays as it is
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template(), db)
    return dirs_under(root)


def migrated_uri(db: Path) -> str:
    """``sqlite:///db`` after copying the migrated, empty template to ``db`` (its folder made; an existing file
    kept), for tests that fabricate or read runs in a store of their own. The store holds MLflow's tables and
    nothing else: the experiment is still created by the Tracker or command under test. Not for a test whose claim
    is about creating a store or about no store being written (test_sqlite_concurrency.py, test_quiet_output.py)."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template(), db)
    return f"sqlite:///{db}"
