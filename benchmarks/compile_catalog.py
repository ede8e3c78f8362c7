"""Every one-process catalog recipe, compiled vs eager: losses over 30 steps on ``debug`` and compile time.

For each recipe: the eager run, the eager run with every FP32 matmul's reduction reversed (its FP32-reordering
spread, floored by ``bf16``'s as in ``tests/kernels/test_parity.py``), and the run with every block compiled
(``train.compile``, ``telemetry_every=0``). Prints the max loss gap compiled vs eager, the spread, their ratio
(the test's bound is 10) and the wall time of the compiled run (compilation included, cold or warm inductor
cache as found). Transformer Engine recipes need CUDA; the FP8-communication recipes need FSDP2.

``--floor-only`` skips each recipe's own reordered run (the slow part: a Python dispatch mode on every op) and
judges every recipe against ``bf16``'s spread alone, a yardstick no larger than the recipe's own.

    .venv/bin/python benchmarks/compile_catalog.py [--steps 30] [--floor-only] [recipe ...]
"""

from __future__ import annotations

import argparse
import os
import time

from _support import max_gap, train_losses

from lowprec.data import DataSpec, prepare
from lowprec.kernels import cpu_model, isa_flags
from lowprec.recipes import CATALOG

ONE_PROCESS = [
    n
    for n, r in CATALOG.items()
    if r.fp8.backend != "te" and r.comm.weight_all_gather != "fp8" and r.comm.grad_reduce != "fp8"
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--floor-only", action="store_true", help="yardstick: bf16's reordering spread alone")
    ap.add_argument("recipes", nargs="*", default=ONE_PROCESS)
    a = ap.parse_args()
    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    print(f"CPU: {cpu_model()}; ISA: {' '.join(isa_flags()) or 'none'}; cpu_kernels=auto; model debug, 4 x 64")
    floor = max_gap(
        # the yardstick on the emulated kernels, where every GEMM is an FP32 matmul the reordering reaches
        # (tests/kernels/test_compile.py says why)
        train_losses(data, "bf16", "emulated", steps=a.steps),
        train_losses(data, "bf16", "emulated", reorder=True, steps=a.steps),
    )
    print(f"{'recipe':20s} {'gap':>10s} {'spread':>10s} {'ratio':>6s} {'compiled run s':>15s}")
    for name in a.recipes:
        kw = dict(steps=a.steps, telemetry_every=0)
        eager = train_losses(data, name, "auto", **kw)
        if a.floor_only and name != "fp32":
            spread = floor
        else:
            mine = eager if name == "fp32" else train_losses(data, name, "emulated", **kw)
            own = max_gap(mine, train_losses(data, name, "emulated", reorder=True, **kw))
            spread = own if name == "fp32" else max(own, floor)
        t0 = time.perf_counter()
        try:
            compiled = train_losses(data, name, "auto", compile=True, **kw)
        except Exception as e:  # a recipe that cannot compile is a finding, not a crash of the benchmark
            print(f"{name:20s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        gap = max_gap(eager, compiled)
        print(f"{name:20s} {gap:10.3g} {spread:10.3g} {gap / spread:6.2f} {time.perf_counter() - t0:15.0f}", flush=True)


if __name__ == "__main__":
    main()
