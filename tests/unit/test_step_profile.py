"""``benchmarks/step_profile.py`` on a real CPU profile of a real training step (the GPU fields stay ``None``), and
its interval arithmetic."""

from __future__ import annotations

import time

import pytest
import torch
from bench_scripts import load_script
from torch.profiler import ProfilerActivity, profile

from lowprec.build_optim import OptimHParams
from lowprec.model import model_args
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step


@pytest.fixture(scope="module")
def sp():
    return load_script("step_profile")


def test_busy_time_counts_overlaps_once(sp):
    assert sp._busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert sp._busy_us([]) == 0


@pytest.mark.parametrize("recipe", ["bf16", "fp8_current"])
def test_summary_of_a_profiled_cpu_step(sp, recipe):
    args = model_args("debug")
    spec = TrainSpec(steps=4, batch_size=2, seq_len=32, telemetry_every=0, progress=False, timing_warmup_steps=1)
    b = build(CATALOG[recipe], args, spec, OptimHParams(), 0, torch.device("cpu"))
    ids = torch.arange(66).reshape(2, 33) % args.vocab_size
    batch = [(ids[:, :-1], ids[:, 1:])]
    train_step(b, batch, 1.0, 0)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        t0 = time.perf_counter()
        for s in (1, 2):
            train_step(b, batch, 1.0, s)
        wall = time.perf_counter() - t0
    out = sp.summarize(p.events(), 2, wall)
    assert out["wall_ms"] == pytest.approx(wall * 500)
    assert out["device_busy_ms"] is None and out["device_busy_fraction"] is None and out["kernels"] == 0
    assert out["syncs"] == {} and out["top_kernels"] == []
    # every linear dispatches at least its matmul in the forward and two in the backward: 2 blocks x 7 + output
    assert out["host_ops"] >= 3 * (2 * 7 + 1)
    with pytest.raises(ValueError):
        sp.summarize(p.events(), 0, wall)


def test_fp8_linears_dispatch_more_host_ops_than_bf16(sp):
    """The figure the GPU profile is for: FP8's casts add host ops per linear (eager, unfused)."""
    args = model_args("debug")
    counts = {}
    for recipe in ("bf16", "fp8_current"):
        spec = TrainSpec(steps=2, batch_size=2, seq_len=32, telemetry_every=0, progress=False, timing_warmup_steps=1)
        b = build(CATALOG[recipe], args, spec, OptimHParams(), 0, torch.device("cpu"))
        ids = torch.arange(66).reshape(2, 33) % args.vocab_size
        train_step(b, [(ids[:, :-1], ids[:, 1:])], 1.0, 0)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            train_step(b, [(ids[:, :-1], ids[:, 1:])], 1.0, 1)
        counts[recipe] = sp.summarize(p.events(), 1, 1.0)["host_ops"]
    assert counts["fp8_current"] > counts["bf16"] + 2 * 7 * 4, counts
