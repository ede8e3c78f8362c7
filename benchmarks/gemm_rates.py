"""GEMM and FP8-cast rates measured on this GPU beside what the cost model assumes for them.

    python benchmarks/gemm_rates.py [--tokens 8192] [--model llama3_8b] [--reps 30] [--out gemm_rates.json]

For every linear of one Llama 3 block and the ``output`` head (torchtitan's names; shapes of ``--model``) at
``--tokens`` tokens, each of the three GEMMs of a training step (forward ``M x K x N``, dgrad ``M x N x K``, wgrad
``K x M x N``) is timed in:

- ``bf16``: ``torch.mm`` of bf16 operands;
- ``fp8_tensorwise``: ``torch._scaled_mm`` of e4m3 operands with one FP32 scale each, bf16 output
  (``use_fast_accum`` in the forward only: torchao's ``Float8LinearConfig`` default);
- ``fp8_rowwise``: the same with a scale per row of A and per column of B (torchao's rowwise recipe).

Each figure is the median of ``--reps`` CUDA-event-timed calls after warm-up, on normal random data. Beside it:
the cost model's time for the same GEMM (``lowprec.estimate.cost_model.gemm_time`` with the shipped calibration on
the detected part), and ``measured / model`` of the *rates*. The model's efficiencies are fitted on end-to-end
step times, so its GEMM rates also carry what a step loses between kernels: an isolated GEMM is expected to run
faster than the model's rate; what must hold is the *ratios* (FP8 over bf16, rowwise over tensorwise, small
``N`` over large), printed at the end summed over the block's GEMMs.

Casts: lowprec's own casts (``quantize_operand``, compiled by Inductor as in a compiled block) of a ``tokens x
dim`` and a ``tokens x ffn`` bf16 tensor to e4m3 in both layouts: tensorwise current scaling (amax, scale, cast,
transposed copy) and rowwise (a per-row amax and cast per layout), with the HBM bytes the cost model counts for
them (``_cast_bytes``) over the measured time: the model assumes ``BW_FRAC`` (0.8) of the datasheet bandwidth.

Exits with code 2 and one line on stderr without CUDA. Nothing here is a training-step measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lowprec.estimate.cost_model import BW_FRAC, Calibration, _cast_bytes, gemm_time  # noqa: E402
from lowprec.estimate.hardware import cuda_device_hardware  # noqa: E402
from lowprec.estimate.inventory import inventory  # noqa: E402
from lowprec.model import model_args  # noqa: E402
from lowprec.numerics.formats import E4M3  # noqa: E402
from lowprec.numerics.scaling import quantize_operand  # noqa: E402
from lowprec.recipes import get_recipe  # noqa: E402


def block_linears(args) -> dict[str, tuple[int, int]]:
    """``short name -> (in_features, out_features)`` of block 0's linears and the head (``inventory``)."""
    lins = inventory(args, get_recipe("bf16").fp8).linears
    return {
        f.rsplit(".", 1)[-1]: (li.in_features, li.out_features)
        for f, li in lins.items()
        if f.startswith("layers.0.") or f == "output"
    }


def cuda_time_ms(fn, reps: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event-timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gemm_fn(m: int, k: int, n: int, kind: str, fast_accum: bool):
    """A zero-argument callable running one ``m x k x n`` GEMM of ``kind`` on fresh random CUDA operands."""
    dev = "cuda"
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)  # (N, K) row-major: B = b.t() is column-major
    if kind == "bf16":
        bt = b.t()
        return lambda: torch.mm(a, bt)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    if kind == "fp8_tensorwise":
        sa = torch.tensor(1.0, device=dev)
        sb = torch.tensor(1.0, device=dev)
    else:
        sa = torch.ones(m, 1, device=dev)
        sb = torch.ones(1, n, device=dev)
    return lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def cast_fns(m: int, k: int):
    """lowprec's own casts (``quantize_operand``) of an ``m x k`` bf16 tensor to e4m3, compiled as a compiled block
    runs them, in both layouts: tensorwise (one cast, then the transposed copy the wgrad GEMM reads) and rowwise
    (a cast per layout: the scales differ per axis, as ``lowprec.float8.linear`` requantizes)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def tensorwise(x):
        q = quantize_operand(x, E4M3, "tensorwise")
        return q.data, q.data.t().contiguous(), q.scale

    def rowwise(x):
        q, qt = quantize_operand(x, E4M3, "rowwise"), quantize_operand(x.t(), E4M3, "rowwise")
        return q.data, qt.data.contiguous(), q.scale, qt.scale

    tw, rw = torch.compile(tensorwise), torch.compile(rowwise)
    return {"fp8_tensorwise": lambda: tw(x), "fp8_rowwise": lambda: rw(x)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        name, hw = cuda_device_hardware()
    except (RuntimeError, LookupError) as e:
        print(f"gemm_rates: {e}", file=sys.stderr)
        return 2
    cal, args, m = Calibration(), model_args(a.model), a.tokens
    print(f"{name} (table entry {hw.name}), torch {torch.__version__}, CUDA {torch.version.cuda}; {a.model}, M={m}")
    rows, totals = [], {}
    for lin, (k, n) in block_linears(args).items():
        for direction, (gm, gk, gn) in {"fwd": (m, k, n), "dgrad": (m, n, k), "wgrad": (k, m, n)}.items():
            for kind in ("bf16", "fp8_tensorwise", "fp8_rowwise"):
                fn = gemm_fn(gm, gk, gn, kind, fast_accum=direction == "fwd")
                ms = cuda_time_ms(fn, a.reps)
                flops = 2.0 * gm * gk * gn
                dt = "bf16" if kind == "bf16" else "fp8"
                scale = cal.rowwise_gemm if kind == "fp8_rowwise" else 1.0
                model_ms = 1e3 * gemm_time(gm, gk, gn, dt, hw, cal, scale)
                peak = hw.peak_tflops(dt)
                r = {
                    "linear": lin,
                    "gemm": direction,
                    "mkn": [gm, gk, gn],
                    "kind": kind,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "frac_of_dense_peak": flops / ms / 1e9 / peak,
                    "model_ms": model_ms,
                    "measured_rate_over_model": model_ms / ms,
                }
                rows.append(r)
                if lin != "output":
                    t = totals.setdefault(kind, {"ms": 0.0, "model_ms": 0.0})
                    t["ms"] += ms
                    t["model_ms"] += model_ms
                del fn
                torch.cuda.empty_cache()
    print(
        f"\n{'linear':<7}{'gemm':<6}{'M x K x N':>22} {'kind':<15}{'ms':>8}{'TFLOP/s':>9}{'of peak':>8}"
        f"{'model ms':>9}{'rate/model':>11}"
    )
    for r in rows:
        mkn = "x".join(map(str, r["mkn"]))
        print(
            f"{r['linear']:<7}{r['gemm']:<6}{mkn:>22} {r['kind']:<15}{r['ms']:>8.3f}{r['tflops']:>9.0f}"
            f"{100 * r['frac_of_dense_peak']:>7.1f}%{r['model_ms']:>9.3f}{r['measured_rate_over_model']:>11.2f}"
        )
    bf, tw, rw = (totals[k] for k in ("bf16", "fp8_tensorwise", "fp8_rowwise"))
    ratios = {
        "tensorwise_speedup_over_bf16": {"measured": bf["ms"] / tw["ms"], "model": bf["model_ms"] / tw["model_ms"]},
        "rowwise_speedup_over_bf16": {"measured": bf["ms"] / rw["ms"], "model": bf["model_ms"] / rw["model_ms"]},
        "rowwise_rate_over_tensorwise": {"measured": tw["ms"] / rw["ms"], "model": tw["model_ms"] / rw["model_ms"]},
        "bf16_block_rate_over_model": {"measured": bf["model_ms"] / bf["ms"], "model": 1.0},
    }
    print("\none block's 21 GEMMs (7 linears x fwd/dgrad/wgrad), summed:")
    for k, v in ratios.items():
        print(f"  {k:<32} measured {v['measured']:.3f}   model {v['model']:.3f}")
    casts = []
    recipes = {"fp8_tensorwise": get_recipe("fp8_tensorwise"), "fp8_rowwise": get_recipe("fp8_rowwise")}
    for shape in ((m, args.dim), (m, block_linears(args)["w1"][1])):
        for kind, fn in cast_fns(*shape).items():
            ms = cuda_time_ms(fn, a.reps)
            nbytes = _cast_bytes(shape[0] * shape[1], recipes[kind], True, 2)
            bw = nbytes / ms / 1e9  # TB/s
            casts.append(
                {
                    "shape": list(shape),
                    "kind": kind,
                    "ms": ms,
                    "model_bytes": nbytes,
                    "tb_s": bw,
                    "frac_of_datasheet_hbm": bw / hw.hbm_tb_s,
                    "model_frac": BW_FRAC,
                }
            )
    print(f"\ncompiled casts to e4m3, both layouts (model: {BW_FRAC:.0%} of {hw.hbm_tb_s} TB/s):")
    for c in casts:
        print(
            f"  {c['kind']:<15}{'x'.join(map(str, c['shape'])):>12} {c['ms']:.3f} ms  "
            f"{c['tb_s']:.2f} TB/s of the model's bytes = {100 * c['frac_of_datasheet_hbm']:.0f}% of datasheet"
        )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "device": name,
                    "hardware": hw.name,
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "model": a.model,
                    "tokens": m,
                    "rows": rows,
                    "block_ratios": ratios,
                    "casts": casts,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
