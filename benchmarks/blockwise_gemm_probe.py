"""Probe of the blockwise FP8 GEMM kernels on this GPU: does each run, how close is it to the
emulated reference, and how fast is it against a BF16 matmul of the same shape.

    python benchmarks/blockwise_gemm_probe.py [--shapes 8192x4096x14336,...] [--reps 10] [--out F.json] [--dry-run]

Shapes are M x K x N of ``out = a @ bt.T`` with ``a`` (M, K) and ``bt`` (N, K); the default is Llama-3-8B's
``w1``/``w3`` forward GEMM at 8192 tokens (8192 x 4096 x 14336) and its weight-gradient GEMM
(14336 x 8192 x 4096, contraction over tokens). Per shape and kernel (``lowprec.kernels.blockwise``: torch's
cuBLASLt ``torch_scaled_mm_blockwise``, torchao's ``torchao_triton_blockwise``, and ``emulated``, lowprec's
128-wide K chunks of rowwise ``_scaled_mm`` calls) and per pair (1x128 x 128x128, 1x128 x 1x128): the probe's
verdict (``probe_blockwise_gemm``), SQNR of the bf16 output against the FP32 reference of the same FP8 operands
(``fp8_gemm(..., backend="emulated")`` on the GPU), and the median time of ``--reps`` calls of the GEMM alone
(operands quantized beforehand) in ms and TFLOP/s, with the BF16 ``torch.mm`` time and the tensorwise and
rowwise ``torch._scaled_mm`` times of the same shape beside them. ``select_blockwise_gemm`` says what a run
would choose. ``--dry-run`` runs everything on the CPU at a small shape with the reference kernel only (a check
of the script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lowprec.float8.gemm import fp8_gemm  # noqa: E402
from lowprec.kernels.blockwise import probe_blockwise_gemm, select_blockwise_gemm  # noqa: E402
from lowprec.numerics.formats import E4M3, sqnr_db  # noqa: E402
from lowprec.numerics.scaling import quantize_operand  # noqa: E402

KERNELS = ("torch_scaled_mm_blockwise", "torchao_triton_blockwise", "emulated")
PAIRS = {"1x128 x 128x128": "block128x128", "1x128 x 1x128": "tile1x128"}


def timed_ms(fn, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after two warm-up calls (CUDA events on a GPU)."""
    fn()
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def probe_shape(m: int, k: int, n: int, reps: int, device: torch.device, kernels) -> dict:
    """Every kernel and pair at one shape (module doc)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16)
    tflop = 2 * m * k * n / 1e12
    res: dict = {"shape": [m, k, n]}
    bf16_ms = timed_ms(lambda: x @ w.t(), reps, device)
    res["bf16_mm"] = {"ms": bf16_ms, "tflops": tflop / bf16_ms * 1e3}
    for gran in ("tensorwise", "rowwise"):
        qa, qb = quantize_operand(x, E4M3, gran), quantize_operand(w, E4M3, gran)
        try:
            ms = timed_ms(lambda qa=qa, qb=qb: fp8_gemm(qa, qb, torch.bfloat16), reps, device)
            res[f"{gran}_scaled_mm"] = {"ms": ms, "tflops": tflop / ms * 1e3, "vs_bf16": bf16_ms / ms}
        except Exception as e:  # noqa: BLE001 - a missing kernel is a result
            res[f"{gran}_scaled_mm"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    a = quantize_operand(x, E4M3, "tile1x128")
    for pair, gran_b in PAIRS.items():
        bt = quantize_operand(w, E4M3, gran_b)
        ref = fp8_gemm(a, bt, torch.float32, backend="emulated")
        for kernel in kernels:
            key = f"{kernel} {pair}"
            try:
                out = fp8_gemm(a, bt, torch.bfloat16, blockwise_gemm=kernel)
                db = sqnr_db(ref, out.float())
                ms = timed_ms(
                    lambda bt=bt, kernel=kernel: fp8_gemm(a, bt, torch.bfloat16, blockwise_gemm=kernel), reps, device
                )
                res[key] = {"sqnr_db": db, "ms": ms, "tflops": tflop / ms * 1e3, "vs_bf16": bf16_ms / ms}
            except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
                res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x4096x14336,14336x8192x4096", help="MxKxN,...")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if any(len(s) != 3 or s[1] % 128 for s in shapes):
        ap.error(f"--shapes {a.shapes}: each is MxKxN with K a multiple of 128")
    if a.dry_run:
        device, shapes, kernels, reps = torch.device("cpu"), [(128, 256, 256)], ("emulated",), 2
    elif not torch.cuda.is_available():
        print("blockwise_gemm_probe: needs CUDA (or --dry-run)", file=sys.stderr)
        return 2
    else:
        device, kernels, reps = torch.device("cuda"), KERNELS, a.reps
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        report["device"] = torch.cuda.get_device_name(device)
        report["probe"] = {k: probe_blockwise_gemm(k, device) or "ok" for k in KERNELS[:2]}
        try:
            report["selected"] = select_blockwise_gemm(device)
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            report["selected"] = f"refused: {e}"
        print(f"{report['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
        for k, v in report["probe"].items():
            print(f"probe {k}: {v}", flush=True)
        print(f"selected: {report['selected']}", flush=True)
    report["shapes"] = []
    for m, k, n in shapes:
        res = probe_shape(m, k, n, reps, device, kernels)
        report["shapes"].append(res)
        print(f"\n{m} x {k} x {n}", flush=True)
        for key, v in res.items():
            if key == "shape":
                continue
            if "error" in v:
                print(f"  {key:<42} failed: {v['error'][:160]}", flush=True)
                continue
            db = f"{v['sqnr_db']:6.1f} dB" if "sqnr_db" in v else " " * 9
            vs = f"{v['vs_bf16']:6.2f}x bf16" if "vs_bf16" in v else ""
            print(f"  {key:<42}{db}{v['ms']:9.3f} ms{v['tflops']:8.0f} TFLOP/s  {vs}", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
