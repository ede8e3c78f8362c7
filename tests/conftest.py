"""Shared fixtures: the real default corpus (tokenized once into the lowprec cache) and temp tracking dirs."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import warnings

# One intra-op thread per test process (set before torch is imported; subprocesses and ranks inherit it). The
# debug/tiny models' ops are too small to gain from a second OpenMP thread, whose spin-waiting took the core
# from the other pytest worker and from gloo ranks: the parity tests ran 1.7-2.3x faster in wall time with one
# thread on the 2-core EPYC. scripts/test.sh runs three workers (pytest-xdist) on the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in-process instead of starting a pool of compile workers (each one a cold import of torch)
# in every test process that compiles: the compile tests took 13% less wall time on the 2-core EPYC.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor takes the vector ISAs /proc/cpuinfo lists instead of compiling and loading a probe per ISA in a child
# process first (~2.5 s at the first compile of every process that compiles); tests/kernels/test_compile_isa.py
# checks that it picks the same ISAs as the probe on this machine.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# A new MLflow sqlite store, in this process and in every process a test starts, is a copy of the first one MLflow
# made in this process (tests/startup/store_template.py): MLflow's ~50 migrations cost ~2 s of CPU per new store.
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
_TEMPLATE_DIR = tempfile.mkdtemp(prefix="lowprec-store-template-")
atexit.register(shutil.rmtree, _TEMPLATE_DIR, ignore_errors=True)
os.environ["LOWPREC_TEST_STORE_TEMPLATE"] = os.path.join(_TEMPLATE_DIR, "mlflow.db")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, _SITE)

import pytest  # noqa: E402
import store_template  # noqa: E402
import torch  # noqa: E402

store_template.install_hook()

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def token_data():
    """The default stdlib corpus, BPE vocab 8192 (built and cached on first use, ~30 s)."""
    from lowprec.data import DataSpec, prepare

    return prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))


@pytest.fixture
def run_dirs(tmp_path):
    """Hydra overrides that keep MLflow, reports and multirun output inside ``tmp_path``."""
    from store_dirs import dirs_under

    return dirs_under(tmp_path)


@pytest.fixture
def mlflow_makes_new_stores(monkeypatch):
    """For a test whose claim is about making a new store (a race, a full disk, a log line): a new sqlite store, in
    this process and in the processes the test starts, gets its tables from MLflow's own migrations instead of a
    copy of the session's template (tests/startup/store_template.py)."""
    monkeypatch.delenv(store_template.ENV)


def pytest_terminal_summary(terminalreporter):
    """The suite's worker time per test directory (``tests/suite_time.py``), so a slow directory shows in CI."""
    from suite_time import per_directory, table

    reports = [r for group in terminalreporter.stats.values() for r in group if hasattr(r, "duration")]
    rows = per_directory(reports)
    if rows:
        terminalreporter.section("time per test directory")
        for line in table(rows):
            terminalreporter.write_line(line)
