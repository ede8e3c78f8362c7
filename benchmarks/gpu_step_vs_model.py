"""lowprec's own training step on one GPU beside the cost model's and the memory model's predictions (issue 17).

    python benchmarks/gpu_step_vs_model.py [--model llama3_1b] [--batch 1] [--seq 8192] [--steps 12]
                                           [--recipes bf16,fp8_tensorwise,fp8_current,fp8_rowwise] [--out F.json]

Each recipe is built with ``lowprec.train.build`` (no MLflow, no Hydra: the core alone) on ``cuda`` with
``train.compile=true`` and ``train.ac=selective``, telemetry off, and trained ``--steps`` steps on synthetic
token sequences (an arithmetic progression mod the vocabulary from a random start: step time does not depend on
the data; the losses are not a quality measurement). Printed per recipe: the median step time of the steps after
the fourth (compilation happens in the first), tokens/s, ``torch.cuda.max_memory_allocated``; beside them the
per-op cost model's tokens/s (``step_cost``, the shipped calibration, one GPU of the detected part, same layout,
compiled) and the memory model's allocated peak (``peak_breakdown(..., compiled_loss=True)``), with
measured / predicted. ``benchmarks/gpu_suite.py`` does the same through ``lowprec train`` with FSDP2 on a node.

Exits with code 2 and one line on stderr without CUDA or on a GPU the hardware table does not know.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lowprec.build_optim import OptimHParams  # noqa: E402
from lowprec.estimate.cost_model import Layout, step_cost  # noqa: E402
from lowprec.estimate.hardware import cuda_device_hardware  # noqa: E402
from lowprec.estimate.memory_model import peak_breakdown  # noqa: E402
from lowprec.model import model_args  # noqa: E402
from lowprec.train.build import build  # noqa: E402
from lowprec.train.spec import TrainSpec  # noqa: E402
from lowprec.train.step import train_step  # noqa: E402
from recipes import get_recipe  # noqa: E402


def measure(name: str, args, batch: int, seq: int, steps: int) -> dict:
    """Median step seconds (steps after the fourth), tokens/s and peak allocated GiB of ``name``."""
    torch.manual_seed(0)
    spec = TrainSpec(
        steps=steps,
        batch_size=batch,
        seq_len=seq,
        val_every=0,
        val_batches=1,
        progress=False,
        ac="selective",
        compile=True,
        warmup_steps=2,
        telemetry_every=0,
    )
    b = build(get_recipe(name), args, spec, OptimHParams(), 0, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for s in range(steps):
        seq_ids = torch.randint(0, args.vocab_size, (batch, 1), generator=gen) + 7 * torch.arange(seq + 1)
        seq_ids = seq_ids % args.vocab_size
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = train_step(b, [(seq_ids[:, :-1], seq_ids[:, 1:])], 1.0, s)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(r.loss))
    step = statistics.median(times[4:])
    out = {
        "step_s": step,
        "tokens_per_s": batch * seq / step,
        "first_step_s": times[0],
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
    }
    del b, r
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3_1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--recipes", default="bf16,fp8_tensorwise,fp8_current,fp8_rowwise")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        name, hw = cuda_device_hardware()
    except (RuntimeError, LookupError) as e:
        print(f"gpu_step_vs_model: {e}", file=sys.stderr)
        return 2
    args = model_args(a.model)
    lo = Layout(1, 1, a.batch, a.seq, "selective", True)
    print(f"{name} ({hw.name}), torch {torch.__version__}; {a.model}, {a.batch} x {a.seq}, compile, selective AC")
    print(f"{'recipe':<16}{'tok/s':>9}{'predicted':>11}{'ratio':>7}{'alloc GiB':>11}{'predicted':>11}{'ratio':>7}")
    rows = {}
    for rn in a.recipes.split(","):
        recipe = get_recipe(rn)
        m = measure(rn, args, a.batch, a.seq, a.steps)
        pred = step_cost(args, recipe, hw, lo).tokens_per_s_per_gpu
        mem = peak_breakdown(args, recipe, batch=a.batch, seq=a.seq, ac="selective", compiled_loss=True)
        mem_gib = mem.allocated / 2**30
        rows[rn] = {**m, "predicted_tokens_per_s": pred, "predicted_allocated_gib": mem_gib}
        print(
            f"{rn:<16}{m['tokens_per_s']:>9,.0f}{pred:>11,.0f}{m['tokens_per_s'] / pred:>7.3f}"
            f"{m['max_allocated_gib']:>11.1f}{mem_gib:>11.1f}{m['max_allocated_gib'] / mem_gib:>7.3f}",
            flush=True,
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
