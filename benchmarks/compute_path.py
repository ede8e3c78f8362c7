"""The compute path's cost on this CPU, side by side in one run: CPU kernels (native vs emulated) and
torch.compile (compiled vs eager), each step time as a ratio to eager ``fp32`` with the same kernels setting.

On the ``tiny`` model (default batch 8 x seq 256) it times ``fp32``, ``bf16``, ``bf16_pure``, ``fp8_current``
and ``fp8_blockwise`` with ``cpu_kernels=emulated`` and ``native``, and ``fp32`` compiled. Each configuration
trains ``--steps`` steps on the real corpus; the first ``--warmup`` are not timed and the figure is the median
step time of the rest. The configurations of one ``cpu_kernels`` setting train step by step in alternation, and
so do compiled and eager ``fp32`` (2 x ``--steps`` steps), so machine noise hits the compared runs alike; the
first compiled step (compilation) is printed apart. The compiled/eager pair trains in a fresh process of its own:
measured in the same process after the ten other configurations had been built and dropped, eager and compiled
took the same time (1.02 on the 2-core AVX-512-BF16 EPYC), against 0.89-0.94 in three fresh processes. The heap
those runs left behind changes which allocations glibc serves with fresh ``mmap`` pages (a page fault per 4 KiB on
first touch), and a compiled block allocates fewer, larger intermediates than eager; with glibc's
``mmap_threshold``/``trim_threshold`` tunables raised so that nothing is mmapped, eager got 12% faster and the pair
measured 1.00: on a CPU, where GEMMs are three quarters of an FP32 step and inductor does not change them,
compile's gain is the fused elementwise work and the allocations it saves. Targets:
with ``emulated``, ``bf16``/``fp32`` <= 1.3 and every FP8 recipe/``fp32`` <= 1.8; compiled ``fp32``/eager
``fp32`` <= 0.95. CPU timings say nothing about GPU speed; the CPU model and ISA flags are printed with them.

    .venv/bin/python benchmarks/compute_path.py [--model tiny] [--steps 8] [--warmup 3] [--native-steps 4]
                                                [--kernels emulated native]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec, TokenBatches, prepare
from lowprec.kernels import cpu_model, isa_flags
from lowprec.kernels.probe import probe_kernels
from lowprec.model import model_args
from lowprec.recipes import CATALOG
from lowprec.train.build import build
from lowprec.train.spec import TrainSpec
from lowprec.train.step import train_step

RECIPES = ("fp32", "bf16", "bf16_pure", "fp8_current", "fp8_blockwise")
TARGETS = {"bf16": 1.3, "fp8_current": 1.8, "fp8_blockwise": 1.8}
COMPILE_TARGET = 0.95


def _built(data, model: str, recipe: str, kernels: str, steps: int, compile_: bool):
    spec = TrainSpec(steps=steps, batch_size=8, seq_len=256, warmup_steps=2, telemetry_every=0, compile=compile_)
    built = build(CATALOG[recipe], model_args(model), spec, OptimHParams(), 0, torch.device("cpu"), None, kernels)
    return built, spec, TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0)


def _timed_step(built, spec, batches, step: int) -> float:
    t0 = time.perf_counter()
    train_step(built, [batches.train_batch(step)], spec.grad_clip, step)
    return time.perf_counter() - t0


def in_alternation(data, model: str, configs: list[tuple[str, str, bool]], steps: int) -> list[list[float]]:
    """Step times of each ``(recipe, kernels, compile)`` configuration, all built first and then trained step by
    step in turn, so that machine noise (other processes, frequency changes) hits every one alike and the
    ratios stay put even when the absolute times drift."""
    runs = [_built(data, model, r, k, steps, c) for r, k, c in configs]
    times: list[list[float]] = [[] for _ in runs]
    for step in range(steps):
        for i, (built, spec, batches) in enumerate(runs):
            times[i].append(_timed_step(built, spec, batches, step))
    return times


def compile_pair(model: str, steps: int, warmup: int, threads: int) -> tuple[float, float, float]:
    """Median step time of ``fp32`` compiled and eager, trained in alternation for ``steps`` steps each after
    ``warmup`` untimed ones, and the first compiled step (compilation included), in seconds. Meant to run in a
    fresh process (see the module docstring)."""
    torch.set_num_threads(threads)
    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    tc, te = in_alternation(data, model, [("fp32", "auto", True), ("fp32", "auto", False)], steps)
    return statistics.median(tc[warmup:]), statistics.median(te[warmup:]), tc[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--native-steps", type=int, default=4, help="steps for native runs (slow BF16 on AVX2)")
    ap.add_argument("--kernels", nargs="+", default=["emulated", "native"], choices=["emulated", "native"])
    a = ap.parse_args()
    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    print(
        f"CPU: {cpu_model()}; ISA: {' '.join(isa_flags()) or 'none'}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"auto probe (ms per 256^3 GEMM): {probe_kernels().ms}")
    # A discarded first run: the process's first training pays one-time costs (allocator growth, lazy inits)
    # that would otherwise land on whichever configuration runs first.
    in_alternation(data, a.model, [("fp32", "emulated", False)], a.warmup + 2)
    rows = {}
    for kernels in a.kernels:
        steps = a.steps if kernels == "emulated" else max(a.native_steps, 2)
        warm = a.warmup if kernels == "emulated" else 1
        times = in_alternation(data, a.model, [(r, kernels, False) for r in RECIPES], steps)
        for r, t in zip(RECIPES, times):
            rows[(r, kernels, False)] = statistics.median(t[warm:])
            print(f"  {r:14s} {kernels:8s} eager    {rows[(r, kernels, False)]:.3f} s/step", flush=True)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as fresh:
        pair = fresh.submit(compile_pair, a.model, 2 * a.steps, a.warmup, torch.get_num_threads())
        compiled, eager, first = pair.result()
    print(
        f"  fp32           auto     compiled {compiled:.3f} s/step vs eager {eager:.3f} in alternation, in a fresh "
        f"process (first compiled step, compilation included: {first:.0f} s)",
        flush=True,
    )

    print(f"\nstep time / eager fp32 (same cpu_kernels), model={a.model}, batch 8 x seq 256")
    print(f"{'recipe':16s} " + " ".join(f"{k:>9s}" for k in a.kernels))
    for r in RECIPES:
        ratios = [rows[(r, k, False)] / rows[("fp32", k, False)] for k in a.kernels]
        print(f"{r:16s} " + " ".join(f"{x:9.2f}" for x in ratios))
    if "native" in a.kernels:
        n32 = rows[("fp32", "native", False)] / rows[("fp32", "emulated", False)]
        print(f"(fp32 native / fp32 emulated: {n32:.2f}; fp32 runs no emulated GEMM, so this is noise)")
    c = compiled / eager
    print(f"{'fp32 compiled':16s} {c:9.2f}  (vs eager fp32 trained in alternation with it)")
    print("\ntargets:")
    for r, t in TARGETS.items():
        e = rows[(r, "emulated", False)] / rows[("fp32", "emulated", False)]
        print(f"  {r}/fp32 emulated {e:.2f} <= {t}: {'PASS' if e <= t else 'FAIL'}")
    print(f"  fp32 compiled/eager {c:.2f} <= {COMPILE_TARGET}: {'PASS' if c <= COMPILE_TARGET else 'FAIL'}")


if __name__ == "__main__":
    main()
