#!/usr/bin/env python3
"""Print this machine's CPU, its matrix-instruction flags, and the cost of each GEMM kind relative to FP32.

Usage: .venv/bin/python scripts/cpu_probe.py   (about 10-30 s)
Why: CPUs differ (AVX2-only, AVX-512-BF16, AMX) and the cost of BF16 and FP8 GEMMs relative to FP32 differs by two
orders of magnitude between them (the README's CPU kernels section: what `cpu_kernels=auto` chose where). Measure,
then decide.
Run it on an idle machine: anything else running on the 2 cores distorts the ratios.
"""

import platform
import re
import time

import torch


def flags() -> tuple[str, list[str]]:
    model, fl = platform.processor() or "?", []
    try:
        text = open("/proc/cpuinfo").read()
        model = re.search(r"model name\s*:\s*(.*)", text).group(1)
        fl = sorted(set(re.search(r"flags\s*:\s*(.*)", text).group(1).split()))
    except (OSError, AttributeError):
        pass
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_fp16", "amx_tile")
    return model, [f for f in fl if f in keep]


def ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    model, fl = flags()
    print(f"CPU: {model}; threads {torch.get_num_threads()}; flags: {' '.join(fl) or 'none of the matrix ones'}")
    print(f"torch {torch.__version__}")
    m, k, n = 512, 256, 384
    a, b = torch.randn(m, k), torch.randn(n, k)
    base = ms(lambda: a @ b.t(), 20)
    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    cases = {
        "bf16 matmul (native)": (lambda: a.bfloat16() @ b.bfloat16().t(), 20),
        "bf16 emulated (round, fp32 matmul, round)": (
            lambda: (a.bfloat16().float() @ b.bfloat16().float().t()).bfloat16(),
            20,
        ),
        "fp8 _scaled_mm rowwise": (
            lambda: torch._scaled_mm(qa, qb.t(), torch.ones(m, 1), torch.ones(1, n), out_dtype=torch.float32),
            3,
        ),
        "fp8 _scaled_mm tensorwise": (lambda: torch._scaled_mm(qa, qb.t(), one, one, out_dtype=torch.float32), 1),
        "fp8 emulated (dequantize, fp32 matmul)": (lambda: qa.float() @ qb.float().t(), 20),
    }
    print(f"GEMM {m}x{k}x{n}: fp32 {base:.2f} ms = 1.00x")
    for name, (fn, reps) in cases.items():
        try:
            t = ms(fn, reps)
            print(f"  {name:<45} {t:9.2f} ms = {t / base:7.2f}x fp32")
        except RuntimeError as e:  # a kernel this build or CPU does not have
            print(f"  {name:<45} not available: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
