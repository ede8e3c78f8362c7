"""Shared fixtures: the real default corpus (tokenized once into the lowprec cache) and temp tracking dirs."""

from __future__ import annotations

import os
import warnings

import pytest

warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def token_data():
    """The default stdlib corpus, BPE vocab 8192 (built and cached on first use, ~30 s)."""
    from lowprec.data import DataSpec, prepare

    return prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))


@pytest.fixture
def run_dirs(tmp_path):
    """Hydra overrides that keep MLflow, reports and multirun output inside ``tmp_path``."""
    return [
        f"paths.runs={tmp_path / 'runs'}",
        f"paths.reports={tmp_path / 'reports'}",
        f"tracking.uri=sqlite:///{tmp_path / 'runs' / 'mlflow.db'}",
        "train.progress=false",
    ]
