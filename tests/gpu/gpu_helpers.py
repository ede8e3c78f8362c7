"""Shared by the GPU tests: skip marks that say what a test would check, and NCCL ranks on one GPU each.

Every test under ``tests/gpu`` carries ``pytest.mark.gpu`` (deselected by default in ``pyproject.toml``) and
one of the skip marks below, so ``pytest -m gpu tests/gpu`` on a machine without CUDA lists each test as
skipped with the check it would have made, never as a failure.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lowprec.parallel.spawn import run_ranks


def needs_cuda(check: str) -> pytest.MarkDecorator:
    """Skip without CUDA; the reason names the check (``check``: what the test verifies, one phrase)."""
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs CUDA; would check {check}")


def needs_gpus(n: int, check: str) -> pytest.MarkDecorator:
    """Skip with fewer than ``n`` CUDA devices (NCCL needs one GPU per rank)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs (found {have}); would check {check}")


def needs_sm(major: int, minor: int, check: str) -> pytest.MarkDecorator:
    """Skip without CUDA or below compute capability ``major.minor`` (FP8 tensor cores: 8.9 Ada, 9.0 Hopper)."""
    found = "sm {}.{}".format(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else "no CUDA"
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (major, minor)
    return pytest.mark.skipif(
        not ok, reason=f"needs CUDA compute capability >= {major}.{minor} (found {found}); would check {check}"
    )


def needs_te(check: str) -> pytest.MarkDecorator:
    """Skip without Transformer Engine (``pip install -e '.[te]'``)."""
    missing = importlib.util.find_spec("transformer_engine") is None
    return pytest.mark.skipif(missing, reason=f"needs Transformer Engine (pip install -e '.[te]'); would check {check}")


def _on_own_gpu(rank: int, world_size: int, fn, *args):
    # NCCL needs each rank on its own device before the first collective; run_ranks's worker does not pick one.
    torch.cuda.set_device(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    return fn(rank, world_size, *args)


def run_nccl_ranks(fn, world_size: int, *args, timeout_s: float = 900):
    """``lowprec.parallel.spawn.run_ranks`` on NCCL with rank r on ``cuda:r``; ``fn(rank, world_size, *args)``
    must be a module-level function. Returns the ranks' results in rank order."""
    return run_ranks(_on_own_gpu, world_size, fn, *args, backend="nccl", timeout_s=timeout_s)


def rel(a: list[float], b: list[float]) -> float:
    """Largest step-wise relative difference of two equally long loss curves."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
