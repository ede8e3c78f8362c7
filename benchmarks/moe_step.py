"""Step time of the DeepSeekMoE ``moe_tiny`` against the dense ``tiny`` on this machine, side by side.

Both train under the same recipe, batch and sequence length; they run in alternating blocks so machine noise hits
both alike. Prints total and activated parameters, median step times and their ratio (moe / dense). The MoE runs
its experts as a Python loop (one GEMM per expert, lowprec/model/moe.py), the CPU path; a GPU would use grouped
GEMMs, which this does not measure.

    .venv/bin/python benchmarks/moe_step.py [--recipe bf16] [--steps 12] [--block 3] [--batch 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lowprec.build_optim import OptimHParams
from lowprec.data import DataSpec, TokenBatches, prepare
from lowprec.estimate.inventory import param_counts
from lowprec.model import model_args
from lowprec.recipes import get_recipe
from lowprec.train.build import build
from lowprec.train.loop import train_step
from lowprec.train.spec import TrainSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--dense", default="tiny")
    ap.add_argument("--moe", default="moe_tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    spec = TrainSpec(steps=a.steps + 2, batch_size=a.batch, seq_len=a.seq, val_every=0, progress=False)
    data = prepare(DataSpec())
    batches = TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0)
    runs = {}
    for name in (a.dense, a.moe):
        built = build(get_recipe(a.recipe), model_args(name), spec, OptimHParams(), 0, torch.device("cpu"))
        runs[name] = {"built": built, "times": [], "step": 0}
    for model in runs.values():  # one warm-up step each
        train_step(model["built"], [batches.train_batch(0)], 1.0, 0)
        model["step"] = 1
    done = 0
    while done < a.steps:
        for model in runs.values():
            b = model["built"]
            for _ in range(a.block):
                hooks = b.before_step
                for h in hooks:
                    h(model["step"], b)
                t0 = time.perf_counter()
                train_step(b, [batches.train_batch(model["step"])], 1.0, model["step"])
                model["times"].append(time.perf_counter() - t0)
                for h in b.after_step:
                    h(model["step"], b)
                model["step"] += 1
        done += a.block
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu} ({platform.machine()}, {torch.get_num_threads()} threads); recipe {a.recipe}, ", end="")
    print(f"batch {a.batch} x seq {a.seq}, {a.steps} timed steps each")
    med = {}
    for name, model in runs.items():
        pc = param_counts(model_args(name))
        med[name] = statistics.median(model["times"])
        tok = a.batch * a.seq / med[name]
        print(f"{name:10s} total {pc.total:>12,} activated {pc.activated:>12,}  median step {med[name]:.3f} s ", end="")
        print(f"({tok:,.0f} tokens/s)")
    print(f"ratio {a.moe}/{a.dense} step time: {med[a.moe] / med[a.dense]:.2f}")


if __name__ == "__main__":
    main()
