"""What this CPU is: its model name and the instruction-set flags that decide how fast low-precision GEMMs run.

On the 2-core machines of this project a native BF16 GEMM cost about 17x FP32 on an AVX2-only EPYC, 2x on an
AVX-512-BF16 Xeon and 0.14x on a Xeon with AMX (docs/architecture.md, "Platform facts"), so the flags below are
recorded with every CPU run beside the kernel choice they informed.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

#: The ISA flags (as /proc/cpuinfo names them) that matter for BF16/FP16/FP8 matmuls on x86.
RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    path = Path("/proc/cpuinfo")
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            break  # the first processor's block is enough: the machines are homogeneous
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` "model name", else ``platform.processor()``, else "unknown")."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def isa_flags() -> tuple[str, ...]:
    """The flags of ``RELEVANT_FLAGS`` this CPU has, in that order (empty off Linux/x86)."""
    flags = set(_cpuinfo().get("flags", "").split())
    return tuple(f for f in RELEVANT_FLAGS if f in flags)


def has_bf16_instructions() -> bool:
    """True when the CPU has native BF16 dot-product instructions (AVX-512-BF16 or AMX-BF16). Without them
    oneDNN converts BF16 to FP32 in software inside its GEMM, which is what made BF16 17x slower on AVX2."""
    return bool({"avx512_bf16", "amx_bf16"} & set(isa_flags()))
