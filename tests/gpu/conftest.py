"""GPU validation kit (``pytest -m gpu tests/gpu``): what the session ran on, printed in pytest's header, and the
command-line overrides of a short CUDA run. Skip marks and NCCL helpers live in ``gpu_helpers.py`` (spawned
ranks import it by name; a ``conftest`` module cannot be imported that way)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return "gpu: none (CUDA not available): every test under tests/gpu is skipped with the check it would make"
    try:
        te = importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        te = "not installed"
    n = torch.cuda.device_count()
    cap = ".".join(map(str, torch.cuda.get_device_capability()))
    return (
        f"gpu: {n} x {torch.cuda.get_device_name(0)} (sm {cap}), torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, Transformer Engine {te}"
    )


@pytest.fixture
def cuda_quick(run_dirs):
    """Overrides of a short run on one GPU: the ``tiny`` Llama (every linear dimension a multiple of 128, as
    Transformer Engine's FP8 and 128x128-block GEMMs want), 4 x 128 tokens per step, 12 steps, validation and
    telemetry at the end, temp MLflow store (``run_dirs``)."""
    return run_dirs + [
        "device=cuda",
        "model=tiny",
        "train.steps=12",
        "train.batch_size=4",
        "train.seq_len=128",
        "train.warmup_steps=2",
        "train.val_every=0",
        "train.val_batches=1",
        "train.timing_warmup_steps=2",
        "train.telemetry_every=6",
    ]
