"""A sqlite MLflow store whose tables already exist, for tests that fabricate or read runs in a store of their own.

MLflow makes a new sqlite store's tables by running its migrations, ~6 s of CPU per store on the 2-core machine; a
copy of ``store_dirs``' template takes 30 ms. Not for a test whose claim is about creating a store or about no
store being written (tests/integration/test_sqlite_concurrency.py, test_quiet_output.py): those make their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from store_dirs import _template


def migrated_uri(db: Path) -> str:
    """``sqlite:///db`` after copying the migrated, empty template to ``db`` (its folder made; an existing file kept).

    The store holds MLflow's tables and nothing else: the experiment is still created by the Tracker or command under
    test."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template(), db)
    return f"sqlite:///{db}"
