"""Kernels: which implementation runs each low-precision GEMM and attention on this machine.

``cpu`` (the CPU's model and ISA flags), ``scaled_mm`` (the scaled FP8 matmul as data: native through torch's
public or private op, or exact FP32 emulation; the CUDA contract), ``blockwise`` (which kernel runs blockwise
1x128/128x128 FP8 GEMMs: torch's cuBLASLt kernel, torchao's Triton GEMM, or 128-wide K chunks on a CPU, chosen by a
probe), ``emulated`` (BF16/FP16 linear and attention
computed with FP32 arithmetic, rounded where CUDA rounds), ``policy`` (``cpu_kernels=auto|native|emulated``
resolved to one choice per kind), ``probe`` (the ``auto`` timing probe and its cache). Numerics-neutral by
construction: nothing here knows recipes.
"""

from lowprec.kernels.cpu import cpu_model, has_bf16_instructions, isa_flags
from lowprec.kernels.emulated import EmulatedLinear, emulated_linear, emulated_sdpa
from lowprec.kernels.policy import CPU_KERNELS, KernelPolicy, check_cpu_kernels, resolve_kernels
from lowprec.kernels.scaled_mm import SCALED_MM_OP, ScaledMMCall, emulated_scaled_mm, native_scaled_mm

__all__ = [
    "CPU_KERNELS",
    "SCALED_MM_OP",
    "EmulatedLinear",
    "KernelPolicy",
    "ScaledMMCall",
    "check_cpu_kernels",
    "cpu_model",
    "emulated_linear",
    "emulated_scaled_mm",
    "emulated_sdpa",
    "has_bf16_instructions",
    "isa_flags",
    "native_scaled_mm",
    "resolve_kernels",
]
