"""A new MLflow sqlite store made in the tests is a copy of one that MLflow itself made earlier in the session.

MLflow makes a new sqlite store's tables by running its ~50 alembic migrations one after another
(``mlflow.store.db.utils._initialize_tables``): ~2 s of CPU per store on the 2-core machine, paid by nearly every
test that trains, in-process or in a CLI subprocess. A copy of a store that has just been made the same way (its
tables and nothing else) takes ~30 ms and holds the same schema at the same alembic revision.

``install()`` wraps ``_initialize_tables`` in this process; ``install_hook()`` does it when (if ever) a process
imports MLflow's db utilities, so a process that never tracks pays nothing. Both act only while the environment
variable ``LOWPREC_TEST_STORE_TEMPLATE`` names the template's path (tests/conftest.py sets it). The first store a
test session makes is made by MLflow's own migrations and then copied to that path; later ones are copies of it.
A test whose claim is about making a new store (tests/integration/test_sqlite_concurrency.py) removes the variable
from its subprocesses' environment and gets MLflow's own path.

Only for tests: the lab never imports this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sqlite3
import sys
from pathlib import Path

ENV = "LOWPREC_TEST_STORE_TEMPLATE"
_MODULE = "mlflow.store.db.utils"


def _sqlite_path(engine) -> Path | None:
    """The database file of a sqlite engine, else None (another database, or sqlite in memory)."""
    if engine.url.get_backend_name() != "sqlite" or not engine.url.database:
        return None
    return Path(engine.url.database)


def _copy(src: Path, dst: Path) -> None:
    """Write the sqlite database ``src`` into ``dst`` (SQLite's online backup: safe while ``dst`` is open)."""
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    a.close()
    b.close()


def _wrap(utils) -> None:
    """Wrap ``utils._initialize_tables``: copy the template into a new sqlite store, or make the template."""
    original = utils._initialize_tables
    if getattr(original, "_from_template", False):
        return

    def initialize_tables(engine):
        template = os.environ.get(ENV)
        db = _sqlite_path(engine)
        if not template or db is None:
            return original(engine)
        template = Path(template)
        if template.exists():
            utils._logger.info("Creating initial MLflow database tables...")  # the line MLflow prints here
            try:
                _copy(template, db)
                return None
            except sqlite3.Error:  # a full or read-only disk: MLflow's own path meets it and raises its own error
                return original(engine)
        original(engine)
        partial = template.with_name(f"{template.name}.{os.getpid()}.part")
        _copy(db, partial)
        os.replace(partial, template)  # atomic: a concurrent maker writes the same schema
        return None

    initialize_tables._from_template = True
    utils._initialize_tables = initialize_tables


def install() -> None:
    """Wrap MLflow's table creation in this process now (imports MLflow's db utilities)."""
    _wrap(importlib.import_module(_MODULE))


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps ``_initialize_tables`` right after ``mlflow.store.db.utils`` is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


def install_hook() -> None:
    """Wrap MLflow's table creation when (if ever) this process imports it; nothing while ``ENV`` is unset."""
    if not os.environ.get(ENV):
        return
    if _MODULE in sys.modules:
        _wrap(sys.modules[_MODULE])
    else:
        sys.meta_path.insert(0, _Finder())
