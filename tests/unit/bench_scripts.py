"""Shared by the tests of the GPU benchmark scripts: load a script under ``benchmarks/`` as a module, and check that
without CUDA it exits 2 with one line on stderr."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str):
    """``benchmarks/<name>.py`` imported as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_needs_cuda(name: str, timeout_s: int = 300) -> None:
    """Run ``benchmarks/<name>.py`` with no GPU visible: exit 2, nothing on stdout, one line naming CUDA."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py")], capture_output=True, text=True, env=env, timeout=timeout_s
    )
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{name}: error: needs CUDA"), err
    assert p.stdout == ""
