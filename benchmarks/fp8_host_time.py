"""Host time of one FP8 linear's forward and backward, against ``nn.Linear`` under the same autocast.

At a tiny shape (``--tokens 16 --dim 128``) the arithmetic is negligible and what is left is what the host spends
per linear and per step: Python, dispatch and the compiled casts' call overhead (dynamo's guard and wrapper). On a
GPU in eager mode that is the time the host needs to queue one linear's kernels; if it exceeds the kernels' own
time the step is host-bound (``benchmarks/gpu_step_vs_model.py --profile`` tells). Printed per recipe, with the
fused casts off and on (``train.fused_casts``): median microseconds per forward+backward of 300, and the ratio to
``nn.Linear``; side by side in one run, one intra-op thread.

    .venv/bin/python benchmarks/fp8_host_time.py [--tokens 16] [--dim 128] [--reps 300]
                                                 [--recipes fp8_current,fp8_rowwise,fp8_blockwise,deepseek_v3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lowprec.float8.config import linear_config  # noqa: E402
from lowprec.float8.linear import Float8Linear  # noqa: E402
from lowprec.kernels import cpu_model  # noqa: E402
from lowprec.recipes import get_recipe  # noqa: E402


def host_us(mod: torch.nn.Module, x: torch.Tensor, reps: int) -> float:
    """Median microseconds of ``mod``'s forward and backward on ``x`` under BF16 autocast (after 10 warm-ups)."""
    times = []
    for i in range(reps + 10):
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            y = mod(x)
        y.backward(torch.ones_like(y))
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--recipes", default="fp8_current,fp8_rowwise,fp8_blockwise,deepseek_v3")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.dim, requires_grad=True)
    base = host_us(torch.nn.Linear(a.dim, a.dim, bias=False), x, a.reps)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {a.tokens} x {a.dim} -> {a.dim}, 1 thread")
    print(f"{'nn.Linear (bf16 autocast)':<34}{base:9.1f} us  1.00")
    for name in a.recipes.split(","):
        for fused in (False, True):
            mod = Float8Linear.from_linear(
                torch.nn.Linear(a.dim, a.dim, bias=False), linear_config(get_recipe(name).fp8)
            )
            mod.fused_casts = fused
            us = host_us(mod, x, a.reps)
            label = f"{name} ({'fused' if fused else 'eager'} casts)"
            print(f"{label:<34}{us:9.1f} us  {us / base:4.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
