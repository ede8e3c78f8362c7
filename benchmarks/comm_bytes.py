"""Bytes per optimizer step by collective kind for each recipe under FSDP2 (world size 2, gloo), measured by
lowprec's communication meter at the process-group call, with the ratios the FP8-communication claims rest on;
then the step time of FSDP2 world size 2 over one process for the fp32 recipe.

    .venv/bin/python benchmarks/comm_bytes.py [--model tiny] [--steps 8]

CPU/gloo timings say nothing about NCCL on a GPU node; the byte counts are exact and layout-independent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lowprec.parallel.spawn import run_ranks  # noqa: E402

RECIPES = [
    ("fp32", {}),
    ("bf16", {}),
    ("bf16", {"grad_reduce": "bf16"}),
    ("fp8_current", {}),
    ("fp8_comm8", {}),
    ("fp8_tensorwise", {}),
    ("fp8_tensorwise_fsdp8", {}),
    ("fp8_blockwise", {}),
    ("deepseek_v3_comm8", {}),
]


def _run(recipe_name: str, comm: dict, model: str, steps: int, dims: dict | None) -> dict:
    from lowprec.build_optim import OptimHParams
    from lowprec.data import DataSpec, TokenBatches, prepare
    from lowprec.model import model_args
    from lowprec.parallel import ParallelDims
    from lowprec.recipes import get_recipe
    from lowprec.train.build import build
    from lowprec.train.loop import run_training
    from lowprec.train.spec import TrainSpec

    recipe = get_recipe(recipe_name).with_fields("comm", **(comm or {}))
    data = prepare(DataSpec(cache_dir=os.environ.get("LOWPREC_CACHE", "~/.cache/lowprec")))
    spec = TrainSpec(
        steps=steps,
        batch_size=8,
        seq_len=128,
        warmup_steps=1,
        val_every=0,
        val_batches=1,
        timing_warmup_steps=2,
        telemetry_every=1000,
        progress=False,
    )
    built = build(
        recipe, model_args(model), spec, OptimHParams(), 0, torch.device("cpu"), ParallelDims(**dims) if dims else None
    )
    rows = []

    class Sink:
        def log_metrics(self, m, step):
            rows.append(m)

    run_training(built, TokenBatches(data.train, data.val, spec.seq_len, spec.batch_size, 0), spec, Sink())
    return {
        "comm": {k: v for k, v in rows[0].items() if k.startswith("comm_")},
        "step_times": [r["step_time_s"] for r in rows[spec.timing_warmup_steps :]],
        "loss": rows[-1]["loss"],
    }


def _many(rank: int, ws: int, jobs: list) -> list[dict]:
    return [_run(*job) for job in jobs]


def mib(b: float) -> str:
    return f"{b / 2**20:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    jobs = [(name, comm, a.model, 3, {"dp_shard": 2}) for name, comm in RECIPES]
    res = run_ranks(_many, 2, jobs)[0]
    print(
        f"FSDP2 world size 2, model={a.model}, 8 x 128 tokens per step; MiB per optimizer step on rank 0 "
        "(all-gather = gathered output, reduce-scatter = full input)"
    )
    print(
        f"{'recipe':<34}{'all-gather':>11}{'  of which fp8':>15}"
        f"{'reduce-scat':>12}{'  of which fp8':>15}{'all-reduce':>11}"
    )
    by = {}
    for (name, comm), r in zip(RECIPES, res):
        c = r["comm"]
        label = name + ("[" + ",".join(f"{k}={v}" for k, v in comm.items()) + "]" if comm else "")
        by[label] = c
        print(
            f"{label:<34}{mib(c['comm_all_gather_bytes']):>11}{mib(c.get('comm_all_gather_fp8_bytes', 0)):>15}"
            f"{mib(c['comm_reduce_scatter_bytes']):>12}{mib(c.get('comm_reduce_scatter_fp8_bytes', 0)):>15}"
            f"{mib(c['comm_all_reduce_bytes']):>11}"
        )

    def fp8_weight_ratio(fp8_label: str, base_label: str) -> tuple[float, float]:
        f, b = by[fp8_label], by[base_label]
        same = f.get("comm_all_gather_bfloat16_bytes", 0.0)  # weights kept in BF16 in both runs
        return (
            f["comm_all_gather_bytes"] / b["comm_all_gather_bytes"],
            (f["comm_all_gather_bytes"] - same) / (b["comm_all_gather_bytes"] - same),
        )

    print("\nratios (measured side by side in this run):")
    for fp8, base in (
        ("fp8_comm8", "fp8_current"),
        ("fp8_tensorwise_fsdp8", "fp8_tensorwise"),
        ("deepseek_v3_comm8", "fp8_blockwise"),
    ):
        tot, lin = fp8_weight_ratio(fp8, base)
        print(
            f"  weight all-gather {fp8} / {base} (BF16 gather): whole model {tot:.3f}, FP8-gathered weights "
            f"{lin:.3f} (target <= 0.55)"
        )
    for fp8 in ("fp8_comm8", "deepseek_v3_comm8"):
        print(
            f"  reduce-scatter {fp8} / fp32: "
            f"{by[fp8]['comm_reduce_scatter_bytes'] / by['fp32']['comm_reduce_scatter_bytes']:.3f} (target <= 0.30)"
        )
    print(
        f"  reduce-scatter bf16[grad_reduce=bf16] / fp32: "
        f"{by['bf16[grad_reduce=bf16]']['comm_reduce_scatter_bytes'] / by['fp32']['comm_reduce_scatter_bytes']:.3f}"
    )

    one = _run("fp32", {}, a.model, a.steps, None)["step_times"]
    two = run_ranks(_many, 2, [("fp32", {}, a.model, a.steps, {"dp_shard": 2})])[0][0]["step_times"]
    t1, t2 = statistics.median(one), statistics.median(two)
    print(
        f"\nfp32 step time (median of {len(one)} steps after warm-up, same global batch): one process {t1 * 1e3:.1f} "
        "ms, "
        f"FSDP2 world size 2 {t2 * 1e3:.1f} ms, ratio {t2 / t1:.2f} (CPU, {os.cpu_count()} cores, gloo; "
        "each rank has 1 thread, one process has all cores)"
    )


if __name__ == "__main__":
    main()
